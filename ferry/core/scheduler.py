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

Asynchronous scheduling (the engine's `async_scheduling`) calls schedule() for step N+1 before
update_from_output() of step N. A request that step N samples from then has one token in flight: it
is scheduled to decode that unknown token (None in its token_ids), unless the token is sure to be its
last (max_tokens or the context length). A stop that only the token can tell (EOS, stop tokens,
stop strings) is found one step late, and the extra step's token is dropped.
"""

from __future__ import annotations

from collections import deque

from ferry.config import SchedulerConfig
from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.outputs import ModelRunnerOutput, OwedTokens, RequestUpdate, ScheduledRequest, SchedulerOutput
from ferry.core.request import FinishReason, Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the runner must forget at the next step, and updates the engine has not yet
        # collected for requests that finished outside update_from_output (KV cache too small).
        self._finished_ids: set[str] = set()
        self._pending_updates: list[RequestUpdate] = []
        self.num_preemptions = 0
        self._preempted_ids: list[str] = []  # in this schedule()
        # Tokens still in flight for requests that finished (asynchronous scheduling): their ids may
        # be taken by new requests before those tokens arrive, and must not be credited to them.
        self._owed = OwedTokens()

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
        self._owed.add(request.request_id, request.num_in_flight)
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
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        copy_blocks: list[tuple[int, int]] = []
        self.kv_cache.begin_step()
        self._preempted_ids = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_in_flight and len(request.output_token_ids) + request.num_in_flight >= request.max_tokens:
                i += 1  # its token in flight is its last: nothing more to compute
                continue
            num_new = min(request.num_known_and_in_flight - request.num_computed_tokens, budget)
            new_blocks = self._allocate_or_preempt(request, num_new)
            if new_blocks is None:
                # It gave way itself (it was the last running request), so the loop is over; or it
                # waits for its token in flight, which may end it.
                i += request.status is RequestStatus.RUNNING
                continue
            scheduled.append(self._scheduled(request, num_new, new_blocks))
            budget -= num_new
            i += 1
        # Admitting new work right after a preemption would only thrash the pool.
        if not self._preempted_ids:
            budget = self._admit_waiting(budget, scheduled, copy_blocks)
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_request_ids=self._take_finished_ids(),
            copy_blocks=copy_blocks,
            preempted_request_ids=self._preempted_ids,
        )

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

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_ids.append(request.request_id)
        self._finished_ids.add(request.request_id)  # the runner drops its state; it starts anew
        self.waiting.appendleft(request)

    def _admit_waiting(
        self, budget: int, scheduled: list[ScheduledRequest], copy_blocks: list[tuple[int, int]]
    ) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit = self.kv_cache.match_prefix(request)
            num_new = min(request.num_tokens - hit.num_tokens, budget)
            new_blocks = self.kv_cache.allocate_slots(request, num_new, hit)
            if new_blocks is None:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = hit.num_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens = hit.num_tokens
                self.kv_cache.record_prefix_query(request, hit)
            if hit.copy_last_from is not None:
                copy_blocks.append((hit.copy_last_from, new_blocks[0]))
            self.running.append(request)
            self._finished_ids.discard(request.request_id)
            scheduled.append(self._scheduled(request, num_new, new_blocks, new=True))
            budget -= num_new
        return budget

    def _scheduled(
        self, request: Request, num_new: int, new_blocks: list[int], new: bool = False
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        token_ids: list[int | None] = request.all_token_ids[start:end]
        if len(token_ids) < num_new:
            token_ids += [None] * (num_new - len(token_ids))  # in flight
        sample = end == request.num_known_and_in_flight
        item = ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            start_pos=start,
            new_block_ids=self.kv_cache.block_ids(request.request_id) if new else new_blocks,
            sample=sample,
            prompt_logprobs=request.sampling_params.prompt_logprobs is not None
            and start < request.num_prompt_tokens,
        )
        if new:
            item.new = True
            item.sampling_params = request.sampling_params
            item.prompt_token_ids = request.prompt_token_ids
            item.output_token_ids = list(request.output_token_ids)
            item.eos_token_ids = request.eos_token_ids
        # Counted as computed now: the runner computes them before the next schedule() can look.
        request.num_computed_tokens = end
        if sample:
            request.num_in_flight += 1
        return item

    def _take_finished_ids(self) -> set[str]:
        ids, self._finished_ids = self._finished_ids, set()
        return ids

    # ---- results of a step ----

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Append sampled tokens, apply token-level stops, free finished requests' blocks."""
        updates, self._pending_updates = self._pending_updates, []
        logprobs = runner_output.logprobs
        for i, request_id in enumerate(runner_output.sampled_request_ids):
            if self._owed and self._owed.take(request_id):
                continue  # its request finished while this step ran; a new one may have its id
            request = self.requests.get(request_id)
            if request is None:
                continue
            request.num_in_flight -= 1
            # A request preempted while its token was in flight keeps the token: it is as good as
            # any other, and the recompute will include it.
            token_id = runner_output.sampled_token_ids[i]
            request.append_output_token(token_id)
            reason = request.check_stop()
            if reason is not None:
                (self.running if request.status is RequestStatus.RUNNING else self.waiting).remove(request)
                self._finish(request, reason)
            updates.append(RequestUpdate(
                request_id, [token_id], reason, request.stop_reason,
                logprobs[i] if logprobs is not None else None,
                runner_output.prompt_logprobs.get(request_id),
                request.num_cached_tokens,
            ))
        # Chunks that sampled nothing can still carry prompt logprobs.
        for request_id, prompt_logprobs in runner_output.prompt_logprobs.items():
            if request_id not in runner_output.sampled_request_ids and request_id in self.requests:
                updates.append(RequestUpdate(request_id, [], prompt_logprobs=prompt_logprobs))
        return updates

