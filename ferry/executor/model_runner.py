"""Tensors in, token ids out: runs one scheduled step on the model.

The runner owns the model, the KV cache tensors and the sampler. Per request it remembers only what
the scheduler sends once (block table, sampling params, tokens so far); each step's `SchedulerOutput`
carries the changes. A step in which every request decodes one token may run through the decode
graphs (cuda_graph.py): the same forward, padded to a captured batch size.

A step is launched, then collected. `launch` queues the forward and the sampling on the device and
starts copying the sampled ids to the host; `collect` waits for that copy. In between, the host is
free: with asynchronous scheduling the engine schedules and launches the next step there, and a
token the host does not know yet (None in the step's token ids) is taken from the last step's sampled ids on
the device. A step whose outputs need the host anyway (logprobs) is complete when launched. The
launched step remembers whose tokens it brings and where they go (a request's state and the index
of its placeholder), so a state dropped meanwhile simply never sees them.

Multi-token rows: a request may bring proposed tokens after its last one (`num_draft_tokens`). The
step samples after every one of those positions, with the same sampling as single steps (the
output position, hence a seeded request's random number, is that of the token sampled), and keeps
the proposals up to the first one that differs from the token sampled there, plus that token
(core/outputs.py has a picture). The counting happens on the device, so a verify step is launched
and collected like any other, and its outputs equal those of single steps, token for token. An
optional `Proposer` (spec/proposer.py) proposes each request's next tokens once a step's tokens
are known.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ferry.attention.backend import AttentionBackend, ForwardContext
from ferry.attention.kv_cache import written_halves
from ferry.config import EngineConfig
from ferry.core.outputs import Logprobs, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from ferry.executor.inputs import ModelInputs, flat_batch
from ferry.sample import SamplerOutput, SamplingRow, request_generator
from ferry.sample.logprobs import score_tokens
from ferry.sample.metadata import position_seed
from ferry.sample.rejection import DraftRows
from ferry.sampling_params import SamplingParams
from ferry.spec.proposer import SpecRequest
from ferry.structured.bitmask import HostBitmasks
from ferry.transfer import to_device

if TYPE_CHECKING:
    from ferry.executor.cuda_graph import DecodeGraphRunner
    from ferry.executor.prefill_graphs import PrefillGraphRunner
    from ferry.spec.proposer import Proposer
    from ferry.structured.grammar import Grammars

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int | None]  # None: sampled by a step not collected yet
    block_ids: list[int]
    # A seeded request's generators: one per row it samples in a step (a verify step samples
    # several), each seeded for the output position of its row.
    generators: list[torch.Generator] | None
    eos_token_ids: tuple[int, ...]
    # Structured output: the llguidance matcher of the request's grammar, advanced by every token
    # it gets (structured/grammar.py), or a Future of it until it is built; None without one.
    matcher: Any = None
    # Tokens the matcher has not taken yet: it takes them before its next mask, in the mask's thread.
    grammar_pending: list[int] = dataclass_field(default_factory=list)
    # What the proposer sees of the request (speculative decoding); None without a proposer.
    spec: SpecRequest | None = None


@dataclass
class LaunchedStep:
    """A step queued on the device. `ModelRunner.collect` turns it into its ModelRunnerOutput."""

    request_ids: list[str]  # the requests that sample, in row order
    states: list[_RequestState] = dataclass_field(default_factory=list)  # their states, in that order
    slots: list[int] = dataclass_field(default_factory=list)  # each one's placeholder in output_token_ids
    # (R,) sampled ids on the host, being filled by a copy in flight; in a verify step followed by
    # the number of proposals each request accepted (first_rows: where its rows start).
    token_ids: torch.Tensor | None = None
    first_rows: list[int] | None = None
    ready: torch.cuda.Event | None = None  # recorded after that copy; None: nothing to wait for
    output: ModelRunnerOutput | None = None  # set when the step was completed at launch
    # With a proposer: the requests whose prompt chunk it computed without sampling, and the end of
    # that chunk (a draft model computes the same, see spec/proposer.py).
    prefilled: list[tuple[_RequestState, int]] = dataclass_field(default_factory=list)
    grammars_advanced: bool = False  # its tokens already went to its requests' grammar matchers


@dataclass
class _Masks:
    bitmask: torch.Tensor  # (rows, words) on the host, being filled
    work: Future  # the filling (Grammars.start_masks)


@dataclass
class _WaitingSample:
    """A launched step's sampling, not queued yet."""

    step: LaunchedStep
    logits: torch.Tensor  # (rows, vocab) on the device
    rows: list[SamplingRow]
    drafts: list[list[int]]  # each request's proposals
    masks: _Masks | None
    draft: DraftRows | None  # the rows that verify guesses a draft model sampled


class ModelRunner:
    """The in-process, one-device `Executor` (executor.py)."""

    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        sampler,
        decode_graphs: DecodeGraphRunner | None = None,
        proposer: Proposer | None = None,
        grammars: Grammars | None = None,
        prefill_graphs: PrefillGraphRunner | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.sampler = sampler
        self.decode_graphs = decode_graphs
        self.prefill_graphs = prefill_graphs
        self.proposer = proposer
        spec = config.speculative_config
        self.disable_by_batch_size = spec.disable_by_batch_size if spec is not None else None
        self.grammars = grammars  # makes the matchers of requests with structured output
        self._states: dict[str, _RequestState] = {}
        # The last launched step's sampled ids on the device, and each sampling request's row in
        # them: where the next step finds the tokens the host does not know yet.
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        # The last launched step while it is not collected: a grammar's mask for the next step
        # follows its tokens (see _advance_grammars).
        self._uncollected: LaunchedStep | None = None
        # The launched step whose sampling waits for its grammars' masks, being filled meanwhile.
        self._waiting: _WaitingSample | None = None
        self._bitmasks: HostBitmasks | None = None

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_caches[0].shape[1]

    @property
    def proposes_tokens(self) -> bool:
        return self.proposer is not None and not self._speculation_off()

    def _speculation_off(self) -> bool:
        """No proposals while more requests run than speculative_config's disable_by_batch_size."""
        return self.disable_by_batch_size is not None and len(self._states) > self.disable_by_batch_size

    @property
    def num_lookahead_slots(self) -> int:
        return self.proposer.lookahead_slots if self.proposer is not None else 0

    def shutdown(self) -> None:
        """Drop the model, the KV cache and the graphs, so that their device memory can be freed."""
        self._drop_waiting()
        self.decode_graphs = self.prefill_graphs = None
        self.kv_caches = []
        self.proposer = None
        self.model = None
        self._states.clear()
        self._last_sampled = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- the step ----

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step to its end."""
        return self.collect(self.launch(scheduler_output))

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Queue one step's forward and sampling on the device; no wait for the device. (A step whose
        requests have grammars queues its sampling later, when its masks are ready: see sample. The
        step before it, if it still waits for its masks, is sampled once this step's inputs are
        prepared, which gives the masks that time.)"""
        scheduled = scheduler_output.scheduled
        try:
            self.update_states(scheduler_output)
            if scheduler_output.copy_blocks:
                self.copy_blocks(scheduler_output.copy_blocks)
            if not scheduled:
                self._sample_waiting()
                return LaunchedStep([], output=ModelRunnerOutput([], []))
            positions = self._in_flight_positions(scheduled)
            graph_inputs = self.prepare_decode_graph(scheduled, positions)
            inputs = graph_inputs if graph_inputs is not None else self.prepare_inputs(scheduled, positions)
        except Exception:
            self._drop_waiting()  # (the engine fails the steps it had not applied, that one with this one)
            raise
        self._sample_waiting()
        self._fill_in_flight(scheduled, positions, inputs.input_ids)
        if graph_inputs is not None:
            hidden = self.decode_graphs.forward(inputs)
        elif inputs.padded:
            hidden = self.prefill_graphs.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        else:
            ctx = ForwardContext(inputs.attn_metadata, self.kv_caches, self.backend)
            hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        step = self.sample(scheduled, inputs, logits)
        self._uncollected = step if step.output is None else None
        return step

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's tokens and return its output."""
        if self._waiting is not None and self._waiting.step is step:
            with torch.inference_mode():  # (as in launch, where the sampling would otherwise be queued)
                self._sample_waiting()
        if self._uncollected is step:
            self._uncollected = None
        if step.output is not None:
            return step.output
        new_tokens = self._tokens_of(step)
        for state, slot, tokens in zip(step.states, step.slots, new_tokens):
            # Its placeholder; a state dropped while this step ran is no one's any more.
            state.output_token_ids[slot:slot + 1] = tokens
            if state.matcher is not None and not step.grammars_advanced:
                state.grammar_pending += tokens
        return self._with_proposals(ModelRunnerOutput(step.request_ids, new_tokens), step.states, step.prefilled)

    @staticmethod
    def _tokens_of(step: LaunchedStep) -> list[list[int]]:
        """Each sampling request's new tokens, once the step's copy to the host is done."""
        if step.ready is not None:
            step.ready.synchronize()
        values = step.token_ids.tolist()
        if step.first_rows is None:
            return [[token_id] for token_id in values]
        # A verify step: each request's accepted proposals, then the token sampled after them.
        counts = values[len(values) - len(step.first_rows):]
        return [values[row:row + count + 1] for row, count in zip(step.first_rows, counts)]

    def _advance_grammars(self, states: list[_RequestState]) -> None:
        """Before the masks of a step whose requests have grammars: the tokens of the step before it,
        if it is still uncollected (asynchronous scheduling), go to their matchers now. This step's
        forward is already queued, so the device runs it while the host waits for those tokens."""
        step = self._uncollected
        if step is None or step.grammars_advanced:
            return
        wanted = {id(state) for state in states if state.matcher is not None}
        if not any(id(state) in wanted for state in step.states):
            return
        for state, tokens in zip(step.states, self._tokens_of(step)):
            if state.matcher is not None:
                state.grammar_pending += tokens
        step.grammars_advanced = True

    def _with_proposals(
        self, output: ModelRunnerOutput, states: list[_RequestState], prefilled: list[tuple[_RequestState, int]],
    ) -> ModelRunnerOutput:
        """The output, with the proposer's next tokens for the requests that still run (none in a
        batch larger than speculative_config's disable_by_batch_size)."""
        if self.proposer is None:
            return output
        # (A request with a later step in flight, launched while proposals were off, gets none.)
        live = [s for r, s in zip(output.sampled_request_ids, states)
                if self._states.get(r) is s and s.output_token_ids[-1] is not None]
        if self._speculation_off():
            for state in live:
                state.spec.draft_probs = None
            return output
        prefilled = [(state.spec, end) for state, end in prefilled if self._states.get(state.spec.request_id) is state]
        if live or prefilled:
            proposals = self.proposer.propose([state.spec for state in live], prefilled)
            output.draft_token_ids = {s.spec.request_id: p for s, p in zip(live, proposals) if p}
        return output

    @staticmethod
    def _in_flight_positions(scheduled: list[ScheduledRequest]) -> list[int]:
        """Where this step's tokens in flight go: positions in its flat input ids (each is the last
        token of its request's chunk)."""
        positions, end = [], 0
        for item in scheduled:
            end += len(item.token_ids)
            if item.token_ids[-1] is None:
                positions.append(end - 1)
        return positions

    def _fill_in_flight(self, scheduled: list[ScheduledRequest], positions: list[int], input_ids: torch.Tensor) -> None:
        """Write the tokens in flight into this step's input ids, on the device, from the rows of
        the last step's sampled ids (once that step's sampling is queued)."""
        if positions:
            rows = [self._last_rows[item.request_id] for item in scheduled if item.token_ids[-1] is None]
            tokens = self._last_sampled[to_device(rows, torch.int64, self.device)]
            input_ids[to_device(positions, torch.int64, self.device)] = tokens

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids:
            self._drop_state(request_id)
        for item in scheduler_output.scheduled:
            if item.new:
                # (A request the scheduler resumed, or a new one that took a finished one's id.)
                self._drop_state(item.request_id)
                params = item.sampling_params
                state = self._states[item.request_id] = _RequestState(
                    params, item.prompt_token_ids, list(item.output_token_ids), list(item.new_block_ids),
                    None if params.seed is None else [], item.eos_token_ids, self._matcher(item),
                )
                if self.proposer is not None:
                    state.spec = SpecRequest(item.request_id, params, state.prompt_token_ids, state.output_token_ids,
                                             state.block_ids, num_cached_tokens=item.start_pos)
            else:
                block_ids = self._states[item.request_id].block_ids
                if item.num_dropped_blocks:
                    del block_ids[len(block_ids) - item.num_dropped_blocks:]
                block_ids.extend(item.new_block_ids)

    def _matcher(self, item: ScheduledRequest) -> Future | None:
        """A request's grammar matcher, advanced past the tokens it generated before a preemption:
        a Future, built in the grammars' threads while this step's forward is queued (the masks'
        work waits for it there)."""
        wanted = item.sampling_params.structured_outputs
        if wanted is None:
            return None
        if self.grammars is None:
            raise ValueError("structured output needs the model's tokenizer (tokenizer.json)")
        return self.grammars.matcher_later(wanted, item.output_token_ids)

    def _drop_state(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = to_device([s for s, _ in pairs], torch.int64, self.device)
        dst = to_device([d for _, d in pairs], torch.int64, self.device)
        draft_caches = self.proposer.kv_caches if self.proposer is not None else ()
        for kv_cache in [*self.kv_caches, *draft_caches]:  # (2, num_blocks, block_size, num_kv_heads, head_dim)
            kv_cache = written_halves(kv_cache)
            kv_cache[:, dst] = kv_cache[:, src]

    def prepare_inputs(self, scheduled: list[ScheduledRequest], in_flight: Sequence[int] = ()) -> ModelInputs:
        """The flat batch of a step; `in_flight`: positions of tokens whose ids the device fills in.
        Padded into the prefill graphs' buffers where they take it (prefill_graphs.py), its rows the same."""
        num_reqs = len(scheduled)
        query_lens = np.fromiter((len(s.token_ids) for s in scheduled), np.int64, num_reqs)
        starts = np.fromiter((s.start_pos for s in scheduled), np.int64, num_reqs)
        tables = [self._states[item.request_id].block_ids for item in scheduled]
        input_ids = _without_in_flight([t for s in scheduled for t in s.token_ids], in_flight)
        padded = None
        if self.prefill_graphs is not None:
            padded = self.prefill_graphs.prepare(input_ids, query_lens, starts, tables)
        if padded is not None:
            input_ids, positions, metadata = padded
            query_start_loc = metadata.query_start_loc_cpu
        else:
            positions, metadata, query_start_loc = flat_batch(query_lens, starts, tables, self.block_size, self.device)
            input_ids = to_device(input_ids, torch.int64, self.device)
        sample_rows = [i for i, s in enumerate(scheduled) if s.sample]
        # The last token of each request that samples, and before it the proposals it verifies.
        logits_indices = [
            j for i in sample_rows
            for j in range(int(query_start_loc[i + 1]) - 1 - scheduled[i].num_draft_tokens, int(query_start_loc[i + 1]))
        ]
        prompt_logprob_rows = []
        for i, s in enumerate(scheduled):
            if s.prompt_logprobs:
                prompt_logprob_rows.append((i, len(logits_indices), int(query_lens[i])))
                logits_indices.extend(range(int(query_start_loc[i]), int(query_start_loc[i + 1])))
        return ModelInputs(
            input_ids=input_ids,
            positions=positions,
            attn_metadata=metadata,
            logits_indices=to_device(logits_indices, torch.int64, self.device),
            sample_rows=sample_rows,
            prompt_logprob_rows=prompt_logprob_rows,
            padded=padded is not None,
        )

    def prepare_decode_graph(
        self, scheduled: list[ScheduledRequest], in_flight: Sequence[int] = ()
    ) -> ModelInputs | None:
        """The padded inputs of a step the decode graphs run, or None when it runs eagerly: no
        graphs, a request that brings a prefill chunk or asks for prompt logprobs, more tokens a
        request than any graph takes, or more requests than the largest graph. Requests that bring
        fewer tokens than others (no proposals, or fewer) are padded with rows that store nothing."""
        graphs = self.decode_graphs
        if graphs is None:
            return None
        lens = [len(s.token_ids) for s in scheduled]
        for s in scheduled:
            if s.num_draft_tokens != len(s.token_ids) - 1 or not s.sample or s.prompt_logprobs:
                return None
        query_len = next((q for q in graphs.query_lens if q >= max(lens)), None)
        uniform = min(lens) == query_len
        if query_len is None or (in_flight and not uniform):
            return None
        token_ids = _without_in_flight([t for s in scheduled for t in s.token_ids], in_flight)
        return graphs.prepare(token_ids, [s.start_pos for s in scheduled],
                              [self._states[s.request_id].block_ids for s in scheduled], query_len,
                              None if uniform else lens)

    # ---- sampling ----

    def sample(self, scheduled: list[ScheduledRequest], inputs: ModelInputs, logits: torch.Tensor) -> LaunchedStep:
        """Queue the sampling of every row of `logits` (one per request that samples, or 1 + its
        proposals), and of a verify step the count of accepted proposals.

        When some of the requests have grammars, their matchers take their new tokens here, and
        their masks are then filled in a thread (structured/grammar.py); the sampling is queued when
        they are done, at the next call into the runner (the next launch, or this step's collect).
        Meanwhile the engine collects the step before, turns its tokens into outputs and schedules
        the next: with asynchronous scheduling the masks cost the step only the host time that
        nothing else could use."""
        items = [scheduled[i] for i in inputs.sample_rows]
        states = [self._states[item.request_id] for item in items]
        prefilled = [] if self.proposer is None else [
            (self._states[s.request_id], s.start_pos + len(s.token_ids)) for s in scheduled if not s.sample]
        request_ids = [item.request_id for item in items]
        drafts = [item.token_ids[len(item.token_ids) - item.num_draft_tokens:] for item in items]
        rows = [row for state, proposed in zip(states, drafts) for row in self._sampling_rows(state, proposed)]
        masks = self._start_masks(states, drafts, len(rows))
        draft = self._draft_rows(states, drafts)
        if inputs.prompt_logprob_rows or any(row.params.logprobs is not None for row in rows):
            bitmask = None if masks is None else self._bitmask_on_device(masks)
            output = self._sample_on_host(scheduled, inputs, logits, rows, request_ids, states, drafts, bitmask, draft)
            return LaunchedStep(request_ids, output=self._with_proposals(output, states, prefilled))
        first_rows = None
        if len(rows) > len(items):
            first_rows = np.cumsum([0] + [len(d) + 1 for d in drafts[:-1]]).tolist()
        step = LaunchedStep(request_ids, states, first_rows=first_rows, prefilled=prefilled)
        waiting = _WaitingSample(step, logits[:len(rows)], rows, drafts, masks, draft)
        if masks is None:
            self._queue_sampling(waiting, None)
        else:
            self._waiting = waiting
        return step

    def _drop_waiting(self) -> None:
        """Forget the step that waits for its masks, once their work is done (it writes into the
        matchers and a host buffer)."""
        if self._waiting is not None and self._waiting.masks is not None:
            wait_for([self._waiting.masks.work])
        self._waiting = None

    def _sample_waiting(self) -> None:
        """Queue the sampling of the step that waits for its masks, once they are done."""
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            self._queue_sampling(waiting, self._bitmask_on_device(waiting.masks))

    def _queue_sampling(self, waiting: _WaitingSample, bitmask: torch.Tensor | None) -> None:
        step = waiting.step
        token_ids = self.sampler.choose(waiting.logits, waiting.rows, bitmask, waiting.draft)  # (num_rows,), on the device
        if step.first_rows is not None:
            token_ids = torch.cat([token_ids, _num_accepted(token_ids, step.first_rows, waiting.drafts)])
            self._last_sampled = None  # a verify step's last tokens are not at fixed rows (and nothing overlaps it)
        else:
            self._remember(step.request_ids, token_ids)
        for state in step.states:
            step.slots.append(len(state.output_token_ids))
            state.output_token_ids.append(None)  # collect() puts the step's tokens there
        step.token_ids = token_ids
        if token_ids.device.type == "cuda":
            host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            host.copy_(token_ids, non_blocking=True)
            step.token_ids, step.ready = host, torch.cuda.Event()
            step.ready.record()

    def _sample_on_host(
        self, scheduled: list[ScheduledRequest], inputs: ModelInputs, logits: torch.Tensor, rows: list[SamplingRow],
        request_ids: list[str], states: list[_RequestState], drafts: list[list[int]],
        bitmask: torch.Tensor | None = None, draft: DraftRows | None = None,
    ) -> ModelRunnerOutput:
        """Sample and bring everything to the host now: the step's logprobs are host lists."""
        result: SamplerOutput = self.sampler(logits[:len(rows)], rows, bitmask, draft)
        logprobs = _logprobs_of(result)
        new_tokens, new_logprobs, row = [], [], 0
        for state, proposed in zip(states, drafts):
            sampled = result.token_ids[row:row + len(proposed) + 1]
            accepted = next((j for j, (d, t) in enumerate(zip(proposed, sampled)) if d != t), len(proposed))
            new_tokens.append(sampled[:accepted + 1])
            if logprobs is not None:
                new_logprobs.append(None if logprobs[row] is None else logprobs[row:row + accepted + 1])
            state.output_token_ids.extend(new_tokens[-1])
            if state.matcher is not None:
                state.grammar_pending += new_tokens[-1]
            row += len(proposed) + 1
        if len(rows) == len(states):
            self._remember(request_ids, to_device([t for t, in new_tokens], torch.int64, self.device))
        else:
            self._last_sampled = None
        output = ModelRunnerOutput(request_ids, new_tokens, new_logprobs if logprobs is not None else None)
        for i, first, count in inputs.prompt_logprob_rows:
            output.prompt_logprobs[scheduled[i].request_id] = self._prompt_logprobs(
                scheduled[i], logits[first:first + count]
            )
        return output

    def _start_masks(self, states: list[_RequestState], drafts: list[list[int]], num_rows: int) -> _Masks | None:
        """Start filling the allowed tokens of each sampled row (structured/bitmask.py), or None when
        no request of the step has a grammar. The matchers take their new tokens first, in the
        work's thread. A row after proposals is masked as the grammar stands once the proposals
        before it are taken."""
        if not any(state.matcher is not None for state in states):
            return None
        from ferry.structured.grammar import MaskRow

        self._advance_grammars(states)
        if self._bitmasks is None:
            self._bitmasks = HostBitmasks(self.grammars.vocab_size, self.device)
        bitmask = self._bitmasks.take(num_rows)
        work, row = [], 0
        for state, proposed in zip(states, drafts):
            if state.matcher is None:  # every token allowed
                bitmask[row:row + 1 + len(proposed)] = -1
            else:
                if isinstance(state.matcher, Future) and state.matcher.done():
                    state.matcher = state.matcher.result()  # (built meanwhile: see _matcher)
                work.append(MaskRow(state.matcher, row, state.grammar_pending, proposed))
                state.grammar_pending = []
            row += len(proposed) + 1
        return _Masks(bitmask, self.grammars.start_masks(work, bitmask))

    def _bitmask_on_device(self, masks: _Masks) -> torch.Tensor:
        masks.work.result()
        return self._bitmasks.to_device(masks.bitmask)

    def _draft_rows(self, states: list[_RequestState], drafts: list[list[int]]) -> DraftRows | None:
        """The rows that verify guesses a draft model sampled (with the distributions it drew them
        from), or None when the step has none. Each request's proposals are a prefix of what was
        proposed (the scheduler may cut them), and its distributions serve this step only."""
        rows, token_ids, probs, row = [], [], [], 0
        for state, proposed in zip(states, drafts):
            q = state.spec.draft_probs if state.spec is not None else None
            if q is not None and proposed:
                rows += range(row, row + len(proposed))
                token_ids += proposed
                probs.append(q[:len(proposed)])
                state.spec.draft_probs = None
            row += len(proposed) + 1
        if not rows:
            return None
        return DraftRows(rows, to_device(token_ids, torch.int64, self.device), torch.cat(probs))

    def _remember(self, request_ids: list[str], token_ids: torch.Tensor) -> None:
        self._last_sampled = token_ids
        self._last_rows = {request_id: i for i, request_id in enumerate(request_ids)}

    def _sampling_rows(self, state: _RequestState, proposed: list[int]) -> list[SamplingRow]:
        """One row per token the request samples this step: after its last token, and after each
        proposal, as though the proposals before it had been sampled (as single steps would)."""
        params = state.params
        outputs = state.output_token_ids
        rows = []
        for j in range(len(proposed) + 1):
            num_output = len(outputs) + j
            generator = None
            if state.generators is not None:
                while len(state.generators) <= j:
                    state.generators.append(request_generator(params.seed, self.device))
                generator = state.generators[j]
                generator.manual_seed(position_seed(params.seed, num_output))
            suppress: tuple[int, ...] = ()
            if num_output < params.min_tokens:
                suppress = (*state.eos_token_ids, *params.stop_token_ids)
            history = outputs if j == 0 else [*outputs, *proposed[:j]]
            rows.append(SamplingRow(params, state.prompt_token_ids, history, generator, suppress))
        return rows

    def _prompt_logprobs(self, item: ScheduledRequest, logits: torch.Tensor) -> tuple[int, list[Logprobs]]:
        """Logprobs of the prompt tokens that follow each position of this chunk."""
        state = self._states[item.request_id]
        prompt = state.prompt_token_ids
        # Position p scores token p + 1; the chunk's last position may be the prompt's last, which
        # scores nothing (the sampled token is scored by the sampler).
        count = min(len(item.token_ids), len(prompt) - 1 - item.start_pos)
        if count <= 0:
            return item.start_pos, []
        targets = prompt[item.start_pos + 1:item.start_pos + 1 + count]
        chosen, ranks, top = score_tokens(
            logits[:count], torch.tensor(targets, device=logits.device), state.params.prompt_logprobs or 0
        )
        return item.start_pos, [Logprobs(*row) for row in zip(targets, chosen, ranks, top)]


def _without_in_flight(token_ids: list[int | None], in_flight: Sequence[int]) -> list[int]:
    """Placeholders (0) at the positions of tokens in flight, whose ids _fill_in_flight writes."""
    for position in in_flight:
        token_ids[position] = 0
    return token_ids


def _num_accepted(token_ids: torch.Tensor, first_rows: list[int], drafts: list[list[int]]) -> torch.Tensor:
    """(n,) how many proposals each request keeps: the run of its proposals equal to the tokens
    sampled before them (row first_rows[i] + j samples the token that proposal j guessed). On the
    device, so that the step needs no sync."""
    width = max(map(len, drafts))
    index = np.zeros((len(drafts), width), np.int64)  # rows of the sampled ids to compare with
    proposed = np.full((len(drafts), width), -1, np.int64)  # -1 matches no token: the run ends
    for i, (row, draft) in enumerate(zip(first_rows, drafts)):
        index[i, :len(draft)] = range(row, row + len(draft))
        proposed[i, :len(draft)] = draft
    device = token_ids.device
    equal = token_ids[to_device(index, torch.int64, device)] == to_device(proposed, torch.int64, device)
    return equal.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _logprobs_of(result: SamplerOutput) -> list[Logprobs | None] | None:
    """The sampler's logprobs per row (None for rows that did not ask), as the scheduler takes them."""
    if result.logprobs is None:
        return None
    return [
        None if logprob is None else Logprobs(token_id, logprob, rank, top or [])
        for token_id, logprob, rank, top in zip(result.token_ids, result.logprobs, result.ranks, result.top_logprobs)
    ]


def build_model_runner(
    config: EngineConfig, proposer: Proposer | None = None, grammars: Grammars | None = None,
) -> ModelRunner:
    """Load the model, size and allocate the KV cache, and pick the attention backend. With a
    proposer (given, or the one config.speculative_config asks for), the decode graphs are also
    captured for rows of 1 + its num_speculative_tokens, and a draft model's own KV cache takes its
    share of the memory; with grammars, requests may ask for structured output."""
    from ferry.attention.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block
    from ferry.attention.selector import get_attention_backend
    from ferry.layers.linear import tune_small_batch
    from ferry.loader.loader import load_model
    from ferry.sample import Sampler
    from ferry.spec.selector import get_proposer

    device = torch.device(config.device)
    torch.manual_seed(config.seed)
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from ferry.kernels.pdl import enable_pdl

        enable_pdl(config.pdl)  # before any kernel launches: the GEMV's tuning, the graphs' capture
    start = time.perf_counter()
    model = load_model(config.model, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    spec = config.model.quantization_spec
    layout = "" if spec is None else f", linear layers in FP8 ({spec.describe()})"
    logger.info("model loaded in %.1f s: %.2f GB of weights on %s%s", time.perf_counter() - start, weight_bytes / 1e9,
                device, layout)
    tune_small_batch(model, getattr(torch, config.model.dtype))  # before the KV cache takes the memory and graphs capture
    if proposer is None:
        proposer = get_proposer(config)  # (a draft model is loaded here)
    _check_fp8_kv(config, device)
    bytes_per_block = kv_cache_bytes_per_block(config.model, config.cache)
    if proposer is not None:  # a draft model's own cache has the target's blocks
        bytes_per_block += proposer.kv_bytes_per_block(config.cache)
    num_blocks = _num_kv_blocks(config, bytes_per_block)
    kv_caches = allocate_kv_caches(config.model, config.cache, num_blocks, device)
    logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GB, %s)", num_blocks, config.cache.block_size,
                num_blocks * config.cache.block_size, num_blocks * bytes_per_block / 1e9,
                "FP8 e4m3" if config.cache.fp8_kv else config.model.dtype)
    backend = get_attention_backend(device, config.attention_backend, config.model.head_dim)
    query_lens = (1,) if proposer is None else (1, 1 + proposer.num_speculative_tokens)
    decode_graphs = _decode_graphs(config, model, kv_caches, backend, query_lens)
    prefill_graphs = _prefill_graphs(config, model, kv_caches, backend)
    if proposer is not None:
        draft_head_dim = getattr(proposer, "model_config", config.model).head_dim
        proposer.allocate(config, num_blocks, get_attention_backend(device, config.attention_backend, draft_head_dim))
    return ModelRunner(config, model, kv_caches, backend, Sampler(seed=config.seed, device=device), decode_graphs,
                       proposer, grammars, prefill_graphs)


def _check_fp8_kv(config: EngineConfig, device: torch.device) -> None:
    """An FP8 KV cache on a GPU needs e4m3 in its kernels: compute capability 8.9 (Ada, Hopper) on."""
    if config.cache.fp8_kv and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"kv_cache_dtype {config.cache.kv_cache_dtype}: the KV cache kernels need float8 e4m3, "
                         f"which this GPU (compute capability {major}.{minor}) lacks; 8.9 or later has it")


def _decode_graphs(
    config: EngineConfig, model, kv_caches: list[torch.Tensor], backend, query_lens: tuple[int, ...],
) -> DecodeGraphRunner | None:
    """Unless enforce_eager: decode graphs, captured on a CUDA device (after the KV cache, whose
    addresses they record); on a CPU they run the same padded batches eagerly."""
    if config.enforce_eager:
        return None
    from ferry.executor.cuda_graph import DecodeGraphRunner

    cache = kv_caches[0]
    if cache.device.type == "cuda" and backend.for_decode_graph(1, cache.shape[3], config.model.max_model_len,
                                                                cache.device) is None:
        # (sdpa, which wide latent heads get by default: attention/selector.py)
        logger.warning("the %s attention backend cannot run in a CUDA graph: decode steps run eagerly",
                       type(backend).__name__)
        return None
    graphs = DecodeGraphRunner(model, kv_caches, backend, config.decode_graph_sizes, config.model.max_model_len,
                               query_lens)
    if cache.device.type == "cuda":
        graphs.capture()
    return graphs


def _prefill_graphs(config: EngineConfig, model, kv_caches: list[torch.Tensor], backend) -> PrefillGraphRunner | None:
    """With max_prefill_graph_tokens (and not enforce_eager): graphs of steps with prefill chunks,
    captured on a CUDA device after the decode graphs, into a pool of their own; on a CPU they run the
    same padded steps eagerly."""
    sizes = config.prefill_graph_sizes
    if config.enforce_eager or not sizes:
        return None
    if kv_caches[0].device.type == "cuda" and not backend.prefill_graph_safe:
        logger.warning("the %s attention backend cannot run a step with prefill chunks in a CUDA graph: "
                       "max_prefill_graph_tokens is ignored", type(backend).__name__)
        return None
    from ferry.executor.prefill_graphs import PrefillGraphRunner

    graphs = PrefillGraphRunner(model, kv_caches, backend, sizes, config.scheduler.max_num_seqs,
                                config.model.max_model_len)
    if kv_caches[0].device.type == "cuda":
        graphs.capture()
    return graphs


def _num_kv_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    from ferry.attention.kv_cache import max_useful_blocks

    useful = max_useful_blocks(config.scheduler, cache.block_size)
    if torch.device(config.device).type == "cuda":
        free, total = torch.cuda.mem_get_info()
        budget = free - total * (1 - cache.gpu_memory_utilization)
    else:
        budget = cache.cpu_kv_cache_bytes
    num_blocks = min(useful, int(budget // bytes_per_block))
    if num_blocks < 1:
        raise ValueError("no memory is left for the KV cache: lower the model size or raise the KV budget")
    return num_blocks
