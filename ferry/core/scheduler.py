"""Continuous batching under a per-step token budget.

There is no prefill phase and no decode phase. Each request has `num_computed_tokens` and catches up
to `num_tokens` (prompt + output). One step gives every running request what it still lacks, up to
the token budget: a new request's prompt (cut into chunks when the budget is short), a running
request's one new token. Prefill chunks and decodes thus share a step, and a long prompt never
stalls the decodes of others for more than one chunk.

Running requests go first, in arrival order, so that admitted work finishes. When the KV pool runs
dry, the most recently admitted running request is preempted: its blocks are freed and it goes back
to the front of the waiting queue, to be recomputed from its tokens later (recompute is cheaper and
simpler than swapping KV to host memory for the short contexts that usually get preempted).

Admission looks ahead. Every running request will grow by the output it has yet to produce, and a
pool filled with prompts runs dry as they decode: the latest admitted are preempted and recomputed,
over and over (1000 requests of 1000 prompt and 1000 output tokens on Llama-3.1-8B's shape were
preempted 419 times). So a waiting request is admitted only if, after its prompt, the pool still has
blocks for a share of every running request's remaining output (each counted up to 4096 tokens),
and of its own. Outputs often end early (EOS, stop strings), so the share adapts: it starts at
`decode_reserve` (0.7), falls step by step to a tenth while nothing is preempted, and comes back at
a preemption (after SGLang's new_token_ratio). A request is always admitted when none runs.

Without chunked prefill (`enable_chunked_prefill=False`, vLLM's `--no-enable-chunked-prefill`) the
same accounting is scheduled as vLLM does it then: a waiting request is admitted only when its whole
remaining prompt fits the step's budget, and a step that admits anyone runs those prefills alone;
the running requests decode in the steps that admit nobody. Prefills thus go first, and a stream of
arrivals stalls every decode for a whole prompt's step (which chunked prefill exists to avoid).
The budget holds at least max_model_len tokens (SchedulerConfig checks it), so every prompt, and
every preempted request's recompute, fits a step of its own.

Asynchronous scheduling (the engine's `async_scheduling`) calls schedule() for step N+1 before
update_from_output() of step N. A request that step N samples from then has one token in flight: it
is scheduled to decode that unknown token (None in its token_ids), unless the token is sure to be its
last (max_tokens or the context length). A stop that only the token can tell (EOS, stop tokens,
stop strings) is found one step late, and the extra step's token is dropped. The one ledger of what
is in flight is the scheduler's record of each step: the Request objects it samples for, kept until
its output comes back. A token for a request that has finished meanwhile is dropped, even when a new
request has taken the same id; a preempted request keeps its token, and waits for it before it is
recomputed.

Proposed tokens (`Request.draft_token_ids`, from an executor that proposes) ride along with a
running request's decode: they are scheduled as computed, and the ones the step rejects are rolled
back (`num_computed_tokens` goes down by their number) when its output comes back, and the blocks
they alone filled are freed. An executor whose proposer stores K/V of its own guesses (a draft
model) asks for `lookahead_slots` more: a step that samples for a request also gives it, where the
pool has room, blocks for that many slots past its computed tokens.
"""

from __future__ import annotations

import itertools
from collections import deque

from ferry.config import SchedulerConfig
from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.outputs import ModelRunnerOutput, RequestUpdate, ScheduledRequest, SchedulerOutput
from ferry.core.request import FinishReason, Request, RequestStatus
from ferry.core.spec_stats import SpecDecodingStats


# The admission reserve (module docstring): each running request's remaining output counts up to
# this many tokens; the share falls from decode_reserve to a tenth of it over this many steps.
RESERVE_CLIP_TOKENS = 4096
RESERVE_DECAY_STEPS = 600


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, lookahead_slots: int = 0) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.lookahead_slots = lookahead_slots
        self.spec_stats = SpecDecodingStats()  # how proposals fared
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the runner must forget at the next step, and updates the engine has not yet
        # collected for requests that finished outside update_from_output (KV cache too small).
        self._finished_ids: set[str] = set()
        self._pending_updates: list[RequestUpdate] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed tokens that preemptions threw away (computed again later)
        self.reserve_share = config.decode_reserve  # of running requests' remaining output, kept free
        self._preempted_ids: list[str] = []  # in this schedule()
        # Per step scheduled and not yet updated from: the requests it samples for, in row order,
        # with the number of proposals each carries.
        self._sampling: dict[int, list[tuple[Request, int]]] = {}
        self._step_ids = itertools.count()

    # ---- admission and removal ----

    def add_request(self, request: Request) -> None:
        max_tokens = self.kv_cache.num_blocks * self.kv_cache.block_size
        if request.num_tokens + 1 > max_tokens:
            raise ValueError(
                f"the prompt has {request.num_tokens} tokens, but the KV cache holds at most "
                f"{max_tokens} tokens ({self.kv_cache.num_blocks} blocks of {self.kv_cache.block_size})"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> None:
        """Finish requests from outside a step: aborts, and stop strings found by the engine."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, reason)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv_cache.free(request)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self._pending_updates)

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        scheduled: list[ScheduledRequest] = []
        sampling: list[tuple[Request, int]] = []
        copy_blocks: list[tuple[int, int]] = []
        self.kv_cache.begin_step()
        self._preempted_ids = []
        plan = self._plan_chunked if self.config.enable_chunked_prefill else self._plan_whole_prompts
        budget = plan(self.config.max_num_batched_tokens, scheduled, copy_blocks, sampling)
        step_id = next(self._step_ids)
        self._sampling[step_id] = sampling
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_request_ids=self._take_finished_ids(),
            copy_blocks=copy_blocks,
            preempted_request_ids=self._preempted_ids,
            step_id=step_id,
        )

    def _plan_chunked(
        self, budget: int, scheduled: list[ScheduledRequest], copy_blocks: list[tuple[int, int]],
        sampling: list[tuple[Request, int]],
    ) -> int:
        """The running requests first (decodes, and the rest of prompts that earlier steps cut),
        then waiting requests' prompts in what the budget leaves, the last one perhaps cut. Returns
        the budget left."""
        budget = self._schedule_running(budget, scheduled, sampling)
        self._adapt_reserve()
        # Admitting new work right after a preemption would only thrash the pool.
        if not self._preempted_ids:
            budget = self._admit_waiting(budget, scheduled, copy_blocks, sampling)
        return budget

    def _plan_whole_prompts(
        self, budget: int, scheduled: list[ScheduledRequest], copy_blocks: list[tuple[int, int]],
        sampling: list[tuple[Request, int]],
    ) -> int:
        """Without chunked prefill: whole prompts of waiting requests alone, or, when nobody is
        admitted, the running requests' decodes (module docstring). Returns the budget left."""
        budget = self._admit_waiting(budget, scheduled, copy_blocks, sampling)
        if not scheduled:
            budget = self._schedule_running(budget, scheduled, sampling)
        self._adapt_reserve()
        return budget

    def _schedule_running(
        self, budget: int, scheduled: list[ScheduledRequest], sampling: list[tuple[Request, int]],
    ) -> int:
        """What each running request lacks, in arrival order, preempting the latest admitted where
        the pool runs dry. Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_in_flight and request.num_output_tokens + request.num_in_flight >= request.max_tokens:
                i += 1  # its token in flight is its last: nothing more to compute
                continue
            num_new = min(request.num_known_and_in_flight - request.num_computed_tokens, budget)
            drafts = self._drafts_to_verify(request, num_new, budget)
            new_blocks = self._allocate_or_preempt(request, num_new + len(drafts))
            if new_blocks is None:
                # It gave way itself (it was the last running request), so the loop is over; or it
                # waits for its token in flight, which may end it.
                i += request.status is RequestStatus.RUNNING
                continue
            new_blocks += self._lookahead(request, num_new, len(drafts))
            scheduled.append(self._scheduled(request, num_new, new_blocks, sampling, drafts=drafts))
            budget -= num_new + len(drafts)
            i += 1
        return budget

    @staticmethod
    def _drafts_to_verify(request: Request, num_new: int, budget: int) -> list[int]:
        """The proposals a decode of `request` can carry: none unless its one new token is known,
        and no more than the budget, max_tokens and the context length leave room for (a step that
        accepts them all also samples one token more)."""
        drafts = request.draft_token_ids
        if not drafts:
            return drafts
        request.draft_token_ids = []  # proposals are for one step: the next ones follow its tokens
        if num_new != 1 or request.num_in_flight:
            return []
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1)
        return drafts[:max(room, 0)]

    def _allocate_or_preempt(self, request: Request, num_new: int) -> list[int] | None:
        """Allocate blocks for `request`, preempting the lowest-priority running requests until
        they fit. Returns None when `request` itself had to give way."""
        while True:
            new_blocks = self.kv_cache.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                if request.num_in_flight:
                    return None  # its token in flight may stop it; if not, the next step ends it
                # Alone, with every block the pool has, and still too long: it can never fit.
                self.running.pop()
                self._finish(request, FinishReason.LENGTH)
                self._pending_updates.append(
                    RequestUpdate(request.request_id, [], FinishReason.LENGTH, "kv_cache_full")
                )
                return None
            self._preempt(self.running.pop())
            if victim is request:
                return None

    def _lookahead(self, request: Request, num_new: int, num_drafts: int = 0) -> list[int]:
        """Blocks for the proposer's lookahead slots past a request that samples this step, where the
        pool has them without preempting anyone (a proposer without them guesses less)."""
        if not self.lookahead_slots or request.num_computed_tokens + num_new < request.num_known_and_in_flight:
            return []
        return self.kv_cache.allocate_slots(request, num_new + num_drafts + self.lookahead_slots) or []

    def _adapt_reserve(self) -> None:
        """Back to decode_reserve after a preemption; otherwise a step closer to a tenth of it."""
        start = self.config.decode_reserve
        if self._preempted_ids:
            self.reserve_share = start
        else:
            self.reserve_share = max(start / 10, self.reserve_share - 0.9 * start / RESERVE_DECAY_STEPS)

    def _reserved_blocks(self, request: Request) -> float:
        """Blocks kept free for `request`'s output still to come: the reserve share of it."""
        remaining = min(request.max_tokens - request.num_output_tokens, RESERVE_CLIP_TOKENS)
        if self.kv_cache.sliding_window is not None:  # blocks past the window come back as it slides
            remaining = min(remaining, self.kv_cache.sliding_window)
        return self.reserve_share * max(remaining, 0) / self.kv_cache.block_size

    def _preempt(self, request: Request) -> None:
        self.num_recomputed_tokens += request.num_computed_tokens
        self.kv_cache.free(request)
        request.draft_token_ids = []  # proposals for a token stream that will be recomputed
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_ids.append(request.request_id)
        self._finished_ids.add(request.request_id)  # the runner drops its state; it starts anew
        self.waiting.appendleft(request)

    def _admit_waiting(
        self, budget: int, scheduled: list[ScheduledRequest], copy_blocks: list[tuple[int, int]],
        sampling: list[tuple[Request, int]],
    ) -> int:
        # Blocks kept for the outputs of the requests running before this call (summed only once a
        # request is checked) and of those it admits after a check.
        running_before, reserved = len(self.running), None
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_in_flight:
                break  # preempted with a token in flight: it resumes once the token is known
            hit = self.kv_cache.match_prefix(request)
            if self.running and self.reserve_share:
                if reserved is None:
                    reserved = sum(self._reserved_blocks(r) for r in self.running[:running_before])
                # Its whole prompt (this step's chunk and the rest), then the reserve, must fit.
                prompt_blocks = -(-request.num_tokens // self.kv_cache.block_size) - len(hit.blocks)
                own = self._reserved_blocks(request)
                if self.kv_cache.pool.num_free_blocks - prompt_blocks < reserved + own:
                    break  # first come, first served: nobody overtakes the head of the queue
                reserved += own
            num_new = request.num_tokens - hit.num_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break  # a prompt is prefilled whole: it waits for a step with room for all of it
            num_new = min(num_new, budget)
            new_blocks = self.kv_cache.allocate_slots(request, num_new, hit)
            if new_blocks is None:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = hit.num_tokens
            new_blocks += self._lookahead(request, num_new)
            if request.num_preemptions == 0:
                request.num_cached_tokens = hit.num_tokens
                self.kv_cache.record_prefix_query(request, hit)
            if hit.copy_last_from is not None:
                copy_blocks.append((hit.copy_last_from, new_blocks[0]))
            self.running.append(request)
            self._finished_ids.discard(request.request_id)
            scheduled.append(self._scheduled(request, num_new, new_blocks, sampling, new=True))
            budget -= num_new
        return budget

    def _scheduled(
        self, request: Request, num_new: int, new_blocks: list[int], sampling: list[tuple[Request, int]],
        new: bool = False, drafts: list[int] = (),
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        token_ids: list[int | None] = request.all_token_ids[start:end]
        if len(token_ids) < num_new:
            token_ids += [None] * (num_new - len(token_ids))  # in flight
        sample = end == request.num_known_and_in_flight
        if drafts:
            token_ids += drafts
        item = ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            start_pos=start,
            new_block_ids=self.kv_cache.block_ids(request.request_id) if new else new_blocks,
            num_dropped_blocks=0 if new else self.kv_cache.take_dropped(request.request_id),
            sample=sample,
            prompt_logprobs=request.sampling_params.prompt_logprobs is not None
            and start < request.num_prompt_tokens,
            num_draft_tokens=len(drafts),
        )
        if new:
            item.new = True
            item.sampling_params = request.sampling_params
            item.prompt_token_ids = request.prompt_token_ids
            item.output_token_ids = request.output_token_ids
            item.eos_token_ids = request.eos_token_ids
        # Counted as computed now: the runner computes them before the next schedule() can look.
        # (Rejected proposals are taken back in update_from_output.)
        request.num_computed_tokens = end + len(drafts)
        if sample:
            request.num_in_flight += 1
            sampling.append((request, len(drafts)))
        return item

    def _take_finished_ids(self) -> set[str]:
        ids, self._finished_ids = self._finished_ids, set()
        return ids

    # ---- results of a step ----

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Append sampled tokens, roll back rejected proposals, apply token-level stops, free
        finished requests' blocks."""
        updates, self._pending_updates = self._pending_updates, []
        logprobs = runner_output.logprobs
        sampled = self._sampling.pop(scheduler_output.step_id, [])
        for i, (request, num_drafts) in enumerate(sampled):
            if request.is_finished:
                continue  # it finished while this step ran; a new request may have its id
            request.num_in_flight -= 1
            token_ids = runner_output.sampled_token_ids[i]
            if num_drafts:
                self.spec_stats.observe(num_drafts, len(token_ids) - 1)
            if num_drafts and request.status is RequestStatus.RUNNING:
                request.num_computed_tokens -= num_drafts + 1 - len(token_ids)  # the rejected ones
                # Their slots are free again; blocks that only they and the lookahead used go back.
                self.kv_cache.trim(request, request.num_computed_tokens + 1 + self.lookahead_slots)
            # A request preempted while its token was in flight keeps the token: it is as good as
            # any other, and the recompute will include it.
            reason = None
            for n, token_id in enumerate(token_ids, 1):
                request.append_output_token(token_id)
                reason = request.check_stop()
                if reason is not None:
                    token_ids = token_ids[:n]  # the tokens of an accepted run past its stop are dropped
                    break
            if reason is not None:
                (self.running if request.status is RequestStatus.RUNNING else self.waiting).remove(request)
                self._finish(request, reason)
            request_id = request.request_id
            draft = runner_output.draft_token_ids.get(request_id) if runner_output.draft_token_ids else None
            if draft and reason is None:
                request.draft_token_ids = draft
            request_logprobs = logprobs[i] if logprobs is not None else None
            updates.append(RequestUpdate(
                request_id, token_ids, reason, request.stop_reason,
                request_logprobs[:len(token_ids)] if request_logprobs is not None else None,
                runner_output.prompt_logprobs.get(request_id),
                request.num_cached_tokens,
            ))
        # Chunks that sampled nothing can still carry prompt logprobs.
        for request_id, prompt_logprobs in runner_output.prompt_logprobs.items():
            if request_id not in runner_output.sampled_request_ids and request_id in self.requests:
                updates.append(RequestUpdate(request_id, [], prompt_logprobs=prompt_logprobs))
        return updates

    def abandon(self, scheduler_output: SchedulerOutput) -> None:
        """Forget a step whose output will never come (it failed): its requests are being failed."""
        for request, _ in self._sampling.pop(scheduler_output.step_id, []):
            request.num_in_flight = 0
