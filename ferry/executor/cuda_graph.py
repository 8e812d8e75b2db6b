"""Decode steps replayed from CUDA graphs: one launch for a whole forward instead of hundreds.

A decode step of a 28-layer model launches some 400 small kernels. Launched one by one from Python
each costs the host several microseconds, and at small batches the GPU finishes them faster than
the host issues them. A CUDA graph records the launches once and replays them in one call. A graph
freezes every launch's grid and every tensor's address, and that shapes this file:

- Batch sizes come in buckets (`EngineConfig.decode_graph_sizes`). A step whose n requests each
  decode one token runs the graph of the smallest captured size b >= n; rows n .. b-1 are padding.
- Graphs also come per number of query tokens a row brings, q (`query_lens`): 1 for a plain decode,
  1 + k where each request verifies k proposed tokens (speculative decoding). Request i's q tokens
  are consecutive rows i*q .. i*q+q-1, at positions p_i .. p_i+q-1. A request that brings fewer
  tokens (fewer proposals) is padded to q with rows that store nothing (slot -1): causal attention
  keeps its real rows from seeing them, and their outputs are dropped.
- The inputs live in static buffers that each step overwrites, real rows first, then padding:

      int64 (3, max_b * max_q)
                        input_ids     [ t_0 .. t_nq-1 |  0 ..  0 | not read ]
                        positions     [ p_0 .. p_nq-1 |  0 ..  0 | not read ]   (padding: 0 .. q-1)
                        slot_mapping  [ s_0 .. s_nq-1 | -1 .. -1 | not read ]
                                        real rows       padding    rows >= b*q
      int32 (max_b + max_b * max_blocks)
                        [ seq_lens (max_b): p_i + q, padding q | block_tables (max_b, max_blocks) ]

  A padding row stores nothing (slot -1), attends to the first q keys of block 0 (finite: some
  request's keys, or the zeros the cache starts with), and its output is dropped before the
  logits. Rows never mix except in
  attention, where each row sees only its own context, so padding cannot change a real row.
- Block tables are max_blocks = ceil(max_model_len / block_size) wide, so every request the model's
  length admits fits. A step writes only the first b rows, up to its longest table: entries past a
  request's own blocks are stale and never read.
- The attention backend is captured with a fixed decode split count per size, the one chosen for a
  context of max_model_len (TritonAttentionBackend's `decode_num_splits`): every context up to
  max_model_len is then split finely enough, and a short one leaves trailing splits empty.
- The metadata's host values are frozen at capture; a captured backend reads from them only the
  request count and that every request brings q tokens (see triton_backend.py).

Graphs are captured at startup, after the KV cache is allocated, largest size first, into one
shared memory pool: a smaller graph's intermediates fit in memory the larger ones already use.
A step does no host-device synchronization: two copies from pinned memory and one replay. The
pinned buffers come in two sets, used in turn (`HostBuffersInTurn`): with asynchronous scheduling the next step is
prepared while this one's copies may still wait in the device's queue, and the set it rewrites is
the one of the step before, whose copies are done (an event recorded after them says so; a draft
model prepares its forwards one after another without waiting for any).

Without a captured graph (on a CPU), `forward` runs the model eagerly on the same padded static
buffers, so everything but the capture itself is tested on CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from ferry.attention.backend import AttentionBackend, AttentionMetadata, ForwardContext
from ferry.executor.inputs import ModelInputs, fill_block_table
from ferry.transfer import to_device

logger = logging.getLogger(__name__)


class HostBuffersInTurn:
    """Two sets of pinned host buffers that steps fill in turn before copying them to the device:
    with asynchronous scheduling the next step is prepared while this one's copies may still wait in
    the device's queue, so a step rewrites the set of the step before, whose copies are done (an
    event recorded after them says so)."""

    def __init__(self, make, device: torch.device) -> None:
        self._sets = [make(), make()]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._cuda = device.type == "cuda"
        self._taken = 0

    def take(self):
        """The next set, once its last copies have run (long ago, unless the host runs far ahead)."""
        which = self._taken % 2
        self._taken += 1
        if self._copied[which] is not None:
            self._copied[which].synchronize()
        return self._sets[which]

    def copies_queued(self) -> None:
        """The copies from the set last taken are queued: mark when they will have run."""
        if self._cuda:
            which = (self._taken - 1) % 2
            self._copied[which] = torch.cuda.Event()
            self._copied[which].record()


class _DecodeBuffers:
    """The inputs of a decode batch of up to max_b requests of up to max_q tokens each, packed in two
    tensors (picture above)."""

    def __init__(
        self, max_b: int, max_q: int, max_blocks: int, device: torch.device, pin_memory: bool = False
    ) -> None:
        self.max_b, self.max_q, self.max_blocks = max_b, max_q, max_blocks
        self.int64 = torch.zeros(3, max_b * max_q, dtype=torch.int64, device=device, pin_memory=pin_memory)
        self.int32 = torch.zeros(max_b * (1 + max_blocks), dtype=torch.int32, device=device, pin_memory=pin_memory)
        self.input_ids, self.positions, self.slot_mapping = self.int64  # each (max_b * max_q,), a view
        self.seq_lens = self.int32[:max_b]  # (max_b,)
        self.block_tables = self.int32[max_b:].view(max_b, max_blocks)

    def copy_rows_(self, src: _DecodeBuffers, b: int, q: int) -> None:
        """Copy the first b requests' inputs from `src` (asynchronously when it is pinned)."""
        if q == 1:
            self.int64.copy_(src.int64, non_blocking=True)  # 3 * max_b values: cheaper whole than cut
        else:
            self.int64[:, :b * q].copy_(src.int64[:, :b * q], non_blocking=True)
        used = self.max_b + b * self.max_blocks  # the seq_lens, then the first b table rows
        self.int32[:used].copy_(src.int32[:used], non_blocking=True)

    def fill_padding_(self) -> None:
        """Every row padding: the state graphs are captured in (nothing stored, the first max_q keys
        of block 0 read, so that every query token of a row sees at least one key)."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(self.max_q)
        self.block_tables.zero_()


class DecodeGraphRunner:
    """Runs steps in which every request brings the same number q of tokens (one to decode, or one
    and the proposals it verifies), padded to a captured batch size.

    `prepare` pads a step into the static buffers and returns the inputs as views of them;
    `forward` replays the graph of that size (or, without one, runs the model eagerly on them) and
    returns the hidden states of all padded rows, of which the first n*q are the requests'.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        batch_sizes: Sequence[int],
        max_model_len: int,
        query_lens: Sequence[int] = (1,),
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.query_lens = tuple(sorted(set(query_lens)))
        _, _, self.block_size, num_kv_heads, _ = kv_caches[0].shape
        self.device = kv_caches[0].device
        self.max_model_len = max_model_len
        max_b, max_q = self.batch_sizes[-1], self.query_lens[-1]
        max_blocks = -(-max_model_len // self.block_size)
        fixed = {b: backend.for_decode_graph(b, num_kv_heads, max_model_len, self.device) for b in self.batch_sizes}
        self.capturable = all(fixed.values())
        self.backends = {b: fixed[b] or backend for b in self.batch_sizes}
        pin = self.device.type == "cuda"
        self._hosts = HostBuffersInTurn(
            lambda: _DecodeBuffers(max_b, max_q, max_blocks, torch.device("cpu"), pin_memory=pin), self.device)
        self._static = _DecodeBuffers(max_b, max_q, max_blocks, self.device)
        # q tokens a request: request i's rows start at i*q.
        self._query_start_locs = {
            q: torch.arange(0, (max_b + 1) * q, q, dtype=torch.int32, device=self.device) for q in self.query_lens
        }
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by (batch size, query tokens a request)
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}  # a graph's hidden states, (b * q, hidden_size)

    @property
    def max_blocks(self) -> int:
        return self._static.max_blocks

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured size that holds num_reqs rows; None when none does."""
        return next((b for b in self.batch_sizes if b >= num_reqs), None)

    # ---- the step ----

    def prepare(
        self, token_ids: list[int], positions: list[int], block_tables: list[list[int]], query_len: int = 1,
        real_lens: list[int] | None = None,
    ) -> ModelInputs | None:
        """Pad one step into the static buffers: request i brings token_ids[i*q : i*q+q] at positions
        positions[i] .. positions[i]+q-1 (q = query_len), its KV blocks in block_tables[i]; with
        real_lens, request i brings only real_lens[i] <= q tokens (token_ids holds them one request
        after another) and is padded to q. None when it fits no graph: more requests than the
        largest size, a q with no graphs, or a block table wider than max_model_len needs."""
        n, q = len(block_tables), query_len
        b = self.padded_size(n)
        lengths = np.fromiter(map(len, block_tables), np.int64, n)
        if b is None or q not in self.query_lens or lengths.max() > self.max_blocks:
            return None
        real = None
        if real_lens is not None:  # request i's rows i*q .. i*q + real_lens[i] - 1 are real
            real = (np.arange(q)[None, :] < np.asarray(real_lens)[:, None]).reshape(-1)  # (n * q,)
        h = self._hosts.take()
        ids, pos, slots = h.int64.numpy()  # views of the pinned buffers, rows (max_b * max_q,)
        seq_lens, tables = h.seq_lens.numpy(), h.block_tables.numpy()
        starts = np.asarray(positions, np.int64)
        if real is None:
            ids[:n * q] = token_ids
        else:
            ids[:n * q] = 0
            ids[:n * q][real] = token_ids
        ids[n * q:b * q] = 0
        offsets = np.tile(np.arange(q), b)  # each request's tokens at its consecutive positions
        pos[:n * q] = np.repeat(starts, q) + offsets[:n * q]
        pos[n * q:b * q] = offsets[n * q:]
        seq_lens[:n], seq_lens[n:b] = starts + q, q
        width = int(lengths.max())
        # Row i's first lengths[i] entries, in one vectorized assignment into a view of the buffer.
        fill_block_table(tables[:n, :width], block_tables, lengths)
        tables[n:b, 0] = 0
        bs = self.block_size
        if real is None:
            at = pos[:n * q]
            slots[:n * q] = tables[np.repeat(np.arange(n), q), at // bs].astype(np.int64) * bs + at % bs
        else:
            at, owner = pos[:n * q][real], np.repeat(np.arange(n), q)[real]
            slots[:n * q] = -1
            slots[:n * q][real] = tables[owner, at // bs].astype(np.int64) * bs + at % bs
        slots[n * q:b * q] = -1
        self._static.copy_rows_(h, b, q)
        self._hosts.copies_queued()
        inputs = self._inputs(b, n, q, seq_lens[:b].tolist())
        if real is not None:  # the real rows' hidden states, in order
            inputs.logits_indices = to_device(np.flatnonzero(real), torch.int64, self.device)
        return inputs

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """(b * q, hidden_size) hidden states of a batch `prepare` padded to b requests of q tokens.
        A graph's replay reads the static buffers that `inputs` views and writes the same output
        tensor each time: use it before the next step."""
        key = _graph_key(inputs)
        graph = self._graphs.get(key)
        if graph is None:
            return self._eager(inputs)
        graph.replay()
        return self._outputs[key]

    def _inputs(self, b: int, n: int, q: int, seq_lens_cpu: list[int]) -> ModelInputs:
        """The first b requests (b * q rows) of the static buffers as a step's inputs, of which n are real."""
        s = self._static
        metadata = AttentionMetadata(
            slot_mapping=s.slot_mapping[:b * q],
            query_start_loc=self._query_start_locs[q][: b + 1],
            seq_lens=s.seq_lens[:b],
            block_tables=s.block_tables[:b],
            max_query_len=q,
            max_seq_len=max(seq_lens_cpu),
            query_start_loc_cpu=list(range(0, (b + 1) * q, q)),
            seq_lens_cpu=seq_lens_cpu,
        )
        return ModelInputs(
            input_ids=s.input_ids[:b * q], positions=s.positions[:b * q], attn_metadata=metadata,
            logits_indices=slice(0, n * q), sample_rows=list(range(n)), prompt_logprob_rows=[],
        )

    def _eager(self, inputs: ModelInputs) -> torch.Tensor:
        b, _ = _graph_key(inputs)
        ctx = ForwardContext(inputs.attn_metadata, self.kv_caches, self.backends[b])
        return self.model(inputs.input_ids, inputs.positions, ctx)

    # ---- startup ----

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per batch size, largest first, each after an eager warm-up run that
        compiles its kernels. All rows are padding meanwhile, so neither writes the KV cache."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        if not self.capturable:
            name = type(next(iter(self.backends.values()))).__name__
            raise ValueError(f"the {name} attention backend cannot run in a CUDA graph: run with enforce_eager")
        start = time.perf_counter()
        self._static.fill_padding_()
        pool = torch.cuda.graph_pool_handle()
        # Largest first (most tokens), so that the smaller graphs' intermediates fit in the pool.
        for q, b in sorted(((q, b) for q in self.query_lens for b in self.batch_sizes),
                           key=lambda qb: qb[0] * qb[1], reverse=True):
            # Host values as the graph will meet them: any context up to max_model_len.
            inputs = self._inputs(b, 0, q, [self.max_model_len] * b)
            self._warm_up(inputs)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[b, q] = self._eager(inputs)
            self._graphs[b, q] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode graphs (batch sizes %s, query tokens a request %s) in %.1f s",
                    len(self._graphs), self.batch_sizes, self.query_lens, time.perf_counter() - start)

    def _warm_up(self, inputs: ModelInputs) -> None:
        # On a side stream, as torch's capture examples do: lazy initializations (cuBLAS workspaces,
        # Triton's compilation) then happen outside the capture and off the stream it captures from.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._eager(inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)


def _graph_key(inputs: ModelInputs) -> tuple[int, int]:
    """(padded batch size, query tokens a request) of inputs that `prepare` made."""
    metadata = inputs.attn_metadata
    return metadata.num_reqs, metadata.max_query_len
