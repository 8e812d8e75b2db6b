"""Tensors in, token ids out: runs one scheduled step on the model.

The runner owns the model, the KV cache tensors and the sampler. Per request it remembers only what
the scheduler sends once (block table, sampling params, tokens so far); each step's `SchedulerOutput`
carries the changes. A step in which every request decodes one token may run through the decode
graphs (cuda_graph.py): the same forward, padded to a captured batch size.

A step is launched, then collected. `launch` queues the forward and the sampling on the device and
starts copying the sampled ids to the host; `collect` waits for that copy. In between, the host is
free: with asynchronous scheduling the engine schedules and launches the next step there, and a
token the host does not know yet (None in the step's token ids) is taken from the last step's sampled ids on
the device. A step whose outputs need the host anyway (logprobs) is complete when launched.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ferry.attention.backend import AttentionBackend, AttentionMetadata, ForwardContext
from ferry.config import EngineConfig
from ferry.core.outputs import Logprobs, ModelRunnerOutput, OwedTokens, ScheduledRequest, SchedulerOutput
from ferry.executor.inputs import ModelInputs, fill_block_table
from ferry.sample import SamplerOutput, SamplingRow, request_generator
from ferry.sample.logprobs import score_tokens
from ferry.sampling_params import SamplingParams
from ferry.transfer import to_device

if TYPE_CHECKING:
    from ferry.executor.cuda_graph import DecodeGraphRunner

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int | None]  # None: sampled by a step not collected yet
    block_ids: list[int]
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...]


@dataclass
class LaunchedStep:
    """A step queued on the device. `ModelRunner.collect` turns it into its ModelRunnerOutput."""

    request_ids: list[str]  # the requests that sample, in row order
    token_ids: torch.Tensor | None = None  # (n,) on the host, being filled by a copy in flight
    ready: torch.cuda.Event | None = None  # recorded after that copy; None: nothing to wait for
    output: ModelRunnerOutput | None = None  # set when the step was completed at launch


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
    ) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.sampler = sampler
        self.decode_graphs = decode_graphs
        self._states: dict[str, _RequestState] = {}
        # The last launched step's sampled ids on the device, and each sampling request's row in
        # them: where the next step finds the tokens the host does not know yet.
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        # Tokens still in flight for requests whose state was dropped (finished or preempted): a new
        # request may take the id before they arrive, and must not get them.
        self._owed = OwedTokens()

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_caches[0].shape[1]

    def shutdown(self) -> None:
        """Drop the model, the KV cache and the graphs, so that their device memory can be freed."""
        self.decode_graphs = None
        self.kv_caches = []
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
        """Queue one step's forward and sampling on the device; no wait for the device."""
        self.update_states(scheduler_output)
        if scheduler_output.copy_blocks:
            self.copy_blocks(scheduler_output.copy_blocks)
        if scheduler_output.is_empty:
            return LaunchedStep([], output=ModelRunnerOutput([], []))
        scheduled = scheduler_output.scheduled
        in_flight = self._in_flight(scheduled)
        graph_inputs = self.prepare_decode_graph(scheduled, in_flight[0])
        inputs = graph_inputs if graph_inputs is not None else self.prepare_inputs(scheduled, in_flight[0])
        self._fill_in_flight(*in_flight, inputs.input_ids)
        if graph_inputs is not None:
            hidden = self.decode_graphs.forward(inputs)
        else:
            ctx = ForwardContext(inputs.attn_metadata, self.kv_caches, self.backend)
            hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return self.sample(scheduled, inputs, logits)

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's tokens and return its output."""
        if step.output is not None:
            return step.output
        if step.ready is not None:
            step.ready.synchronize()
        token_ids = step.token_ids.tolist()
        for request_id, token_id in zip(step.request_ids, token_ids):
            if self._owed and self._owed.take(request_id):
                continue  # its state was dropped while this step ran
            out = self._states[request_id].output_token_ids
            # The oldest unknown token is this step's (at most two are outstanding).
            out[out.index(None, max(0, len(out) - 2))] = token_id
        return ModelRunnerOutput(step.request_ids, token_ids)

    def _in_flight(self, scheduled: list[ScheduledRequest]) -> tuple[list[int], list[int]]:
        """Where this step's tokens in flight go (positions in its flat input ids: each is the last
        token of its request's chunk), and where they are (rows of the last step's sampled ids)."""
        positions, rows, end = [], [], 0
        for item in scheduled:
            end += len(item.token_ids)
            if item.token_ids[-1] is None:
                positions.append(end - 1)
                rows.append(self._last_rows[item.request_id])
        return positions, rows

    def _fill_in_flight(self, positions: list[int], rows: list[int], input_ids: torch.Tensor) -> None:
        """Write the tokens in flight into this step's input ids, on the device."""
        if positions:
            tokens = self._last_sampled[to_device(rows, torch.int64, self.device)]
            input_ids[to_device(positions, torch.int64, self.device)] = tokens

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids:
            self._drop_state(request_id)
        for item in scheduler_output.scheduled:
            if item.new:
                # (A request the scheduler resumed, or a new one that took a finished one's id.)
                self._drop_state(item.request_id)
                self._states[item.request_id] = _RequestState(
                    item.sampling_params, item.prompt_token_ids, list(item.output_token_ids),
                    list(item.new_block_ids), self._generator(item.sampling_params), item.eos_token_ids,
                )
            elif item.new_block_ids:
                self._states[item.request_id].block_ids.extend(item.new_block_ids)

    def _drop_state(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:  # its tokens still in flight must not be credited to a later state
            self._owed.add(request_id, state.output_token_ids[-2:].count(None))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = to_device([s for s, _ in pairs], torch.int64, self.device)
        dst = to_device([d for _, d in pairs], torch.int64, self.device)
        for kv_cache in self.kv_caches:  # (2, num_blocks, block_size, num_kv_heads, head_dim)
            kv_cache[:, dst] = kv_cache[:, src]

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        return None if params.seed is None else request_generator(params.seed, self.device)

    def prepare_inputs(self, scheduled: list[ScheduledRequest], in_flight: Sequence[int] = ()) -> ModelInputs:
        """The flat batch of a step; `in_flight`: positions of tokens whose ids the device fills in."""
        num_reqs = len(scheduled)
        query_lens = np.fromiter((len(s.token_ids) for s in scheduled), np.int64, num_reqs)
        starts = np.fromiter((s.start_pos for s in scheduled), np.int64, num_reqs)
        query_start_loc = np.zeros(num_reqs + 1, np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_lens = starts + query_lens

        # Per token: which request it belongs to and its position in that request.
        req_of_token = np.repeat(np.arange(num_reqs), query_lens)  # (num_tokens,)
        positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1] - starts, query_lens)

        block_table = self._block_table(scheduled)
        bs = self.block_size
        slot_mapping = block_table[req_of_token, positions // bs] * bs + positions % bs

        input_ids = _without_in_flight([t for s in scheduled for t in s.token_ids], in_flight)
        sample_rows = [i for i, s in enumerate(scheduled) if s.sample]
        logits_indices = [int(query_start_loc[i + 1]) - 1 for i in sample_rows]
        prompt_logprob_rows = []
        for i, s in enumerate(scheduled):
            if s.prompt_logprobs:
                prompt_logprob_rows.append((i, len(logits_indices), int(query_lens[i])))
                logits_indices.extend(range(int(query_start_loc[i]), int(query_start_loc[i + 1])))

        to = lambda a, dtype: to_device(a, dtype, self.device)  # noqa: E731
        metadata = AttentionMetadata(
            slot_mapping=to(slot_mapping, torch.int64),
            query_start_loc=to(query_start_loc, torch.int32),
            seq_lens=to(seq_lens, torch.int32),
            block_tables=to(block_table, torch.int32),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return ModelInputs(
            input_ids=to(input_ids, torch.int64),
            positions=to(positions, torch.int64),
            attn_metadata=metadata,
            logits_indices=to(logits_indices, torch.int64),
            sample_rows=sample_rows,
            prompt_logprob_rows=prompt_logprob_rows,
        )

    def prepare_decode_graph(
        self, scheduled: list[ScheduledRequest], in_flight: Sequence[int] = ()
    ) -> ModelInputs | None:
        """The padded inputs of a step the decode graphs run, or None when it runs eagerly: no
        graphs, a request that brings more than one token or asks for prompt logprobs, or more
        requests than the largest graph."""
        graphs = self.decode_graphs
        if graphs is None:
            return None
        if not all(len(s.token_ids) == 1 and s.sample and not s.prompt_logprobs for s in scheduled):
            return None
        return graphs.prepare(
            _without_in_flight([s.token_ids[0] for s in scheduled], in_flight),
            [s.start_pos for s in scheduled],
            [self._states[s.request_id].block_ids for s in scheduled],
        )

    def _block_table(self, scheduled: list[ScheduledRequest]) -> np.ndarray:
        """(num_reqs, max_blocks) block ids, rows padded with 0 (never read: past seq_len)."""
        tables = [self._states[item.request_id].block_ids for item in scheduled]
        lengths = np.fromiter(map(len, tables), np.int64, len(tables))
        table = np.zeros((len(tables), int(lengths.max())), np.int64)
        fill_block_table(table, tables, lengths)
        return table

    # ---- sampling ----

    def sample(self, scheduled: list[ScheduledRequest], inputs: ModelInputs, logits: torch.Tensor) -> LaunchedStep:
        num_sampled = len(inputs.sample_rows)
        rows = [self._sampling_row(scheduled[i]) for i in inputs.sample_rows]
        request_ids = [scheduled[i].request_id for i in inputs.sample_rows]
        if inputs.prompt_logprob_rows or any(row.params.logprobs is not None for row in rows):
            return LaunchedStep(request_ids, output=self._sample_on_host(scheduled, inputs, logits, rows, request_ids))
        token_ids = self.sampler.choose(logits[:num_sampled], rows)  # (num_sampled,), on the device
        self._remember(request_ids, token_ids)
        for request_id in request_ids:
            self._states[request_id].output_token_ids.append(None)  # collect() fills it in
        if token_ids.device.type != "cuda":
            return LaunchedStep(request_ids, token_ids)
        host = torch.empty(num_sampled, dtype=token_ids.dtype, pin_memory=True)
        host.copy_(token_ids, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return LaunchedStep(request_ids, host, ready)

    def _sample_on_host(
        self, scheduled: list[ScheduledRequest], inputs: ModelInputs, logits: torch.Tensor, rows: list[SamplingRow],
        request_ids: list[str],
    ) -> ModelRunnerOutput:
        """Sample and bring everything to the host now: the step's logprobs are host lists."""
        result: SamplerOutput = self.sampler(logits[:len(rows)], rows)
        self._remember(request_ids, to_device(result.token_ids, torch.int64, self.device))
        for request_id, token_id in zip(request_ids, result.token_ids):
            self._states[request_id].output_token_ids.append(token_id)
        output = ModelRunnerOutput(request_ids, result.token_ids, _logprobs_of(result))
        for i, first, count in inputs.prompt_logprob_rows:
            output.prompt_logprobs[scheduled[i].request_id] = self._prompt_logprobs(
                scheduled[i], logits[first:first + count]
            )
        return output

    def _remember(self, request_ids: list[str], token_ids: torch.Tensor) -> None:
        self._last_sampled = token_ids
        self._last_rows = {request_id: i for i, request_id in enumerate(request_ids)}

    def _sampling_row(self, item: ScheduledRequest) -> SamplingRow:
        state = self._states[item.request_id]
        params = state.params
        num_output = len(state.output_token_ids)
        if state.generator is not None:
            # The random stream is a function of (seed, output position) alone, so a seeded
            # request samples the same tokens whatever shares its batch and however often it
            # was preempted and recomputed.
            state.generator.manual_seed((params.seed * 0x9E3779B97F4A7C15 + num_output) & (2**63 - 1))
        suppress: tuple[int, ...] = ()
        if num_output < params.min_tokens:
            suppress = (*state.eos_token_ids, *params.stop_token_ids)
        return SamplingRow(params, state.prompt_token_ids, state.output_token_ids, state.generator, suppress)

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


def _logprobs_of(result: SamplerOutput) -> list[Logprobs | None] | None:
    """The sampler's logprobs per row (None for rows that did not ask), as the scheduler takes them."""
    if result.logprobs is None:
        return None
    return [
        None if logprob is None else Logprobs(token_id, logprob, rank, top or [])
        for token_id, logprob, rank, top in zip(result.token_ids, result.logprobs, result.ranks, result.top_logprobs)
    ]


def build_model_runner(config: EngineConfig) -> ModelRunner:
    """Load the model, size and allocate the KV cache, and pick the attention backend."""
    from ferry.attention.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block
    from ferry.attention.selector import get_attention_backend
    from ferry.layers.linear import tune_small_batch
    from ferry.loader.loader import load_model
    from ferry.sample import Sampler

    device = torch.device(config.device)
    torch.manual_seed(config.seed)
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from ferry.kernels.pdl import enable_pdl

        enable_pdl(config.pdl)  # before any kernel launches: the GEMV's tuning, the graphs' capture
    start = time.perf_counter()
    model = load_model(config.model, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info("model loaded in %.1f s: %.2f GB of weights on %s", time.perf_counter() - start, weight_bytes / 1e9, device)
    tune_small_batch(model)  # before the KV cache takes the memory, and before graphs capture
    bytes_per_block = kv_cache_bytes_per_block(config.model, config.cache.block_size)
    num_blocks = _num_kv_blocks(config, bytes_per_block)
    kv_caches = allocate_kv_caches(config.model, num_blocks, config.cache.block_size, device)
    logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GB)", num_blocks, config.cache.block_size,
                num_blocks * config.cache.block_size, num_blocks * bytes_per_block / 1e9)
    backend = get_attention_backend(device, config.attention_backend)
    decode_graphs = _decode_graphs(config, model, kv_caches, backend)
    return ModelRunner(config, model, kv_caches, backend, Sampler(seed=config.seed, device=device), decode_graphs)


def _decode_graphs(config: EngineConfig, model, kv_caches: list[torch.Tensor], backend) -> DecodeGraphRunner | None:
    """Unless enforce_eager: decode graphs, captured on a CUDA device (after the KV cache, whose
    addresses they record); on a CPU they run the same padded batches eagerly."""
    if config.enforce_eager:
        return None
    from ferry.executor.cuda_graph import DecodeGraphRunner

    graphs = DecodeGraphRunner(model, kv_caches, backend, config.decode_graph_sizes, config.model.max_model_len)
    if kv_caches[0].device.type == "cuda":
        graphs.capture()
    return graphs


def _num_kv_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    # More blocks than every running request at full length could use would be wasted memory.
    useful = config.scheduler.max_num_seqs * -(-config.scheduler.max_model_len // cache.block_size)
    if torch.device(config.device).type == "cuda":
        free, total = torch.cuda.mem_get_info()
        budget = free - total * (1 - cache.gpu_memory_utilization)
    else:
        budget = cache.cpu_kv_cache_bytes
    num_blocks = min(useful, int(budget // bytes_per_block))
    if num_blocks < 1:
        raise ValueError("no memory is left for the KV cache: lower the model size or raise the KV budget")
    return num_blocks
