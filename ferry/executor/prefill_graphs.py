"""Steps with prefill chunks replayed from CUDA graphs, by token count and request count.

A step that brings a prompt (alone, or beside other requests' decodes) is launched eagerly, kernel
by kernel from Python, and for a short prompt the host is the slow side: a 512-token prompt of a
28-layer model launches about 300 kernels, which cost the host 10 to 30 ms, while the GPU's work is
about 2 ms (docs/doctor.md). This runner records such steps once per token count and replays them,
as cuda_graph.py does decode steps. A graph freezes every launch's grid and every tensor's address,
and a step's token count is its shape, so steps are padded to the smallest captured count
(`EngineConfig.prefill_graph_sizes`) at or above theirs; a step with more tokens runs eagerly.

What makes any mix of requests fit one graph is the varlen attention kernel
(attention/kernels/prefill_attention.py), whose grid depends only on the token count and the
number of requests. So a graph has a request count too: the step's n requests first, then one
request that owns the padding tokens, then requests of no tokens, up to the smallest of
`request_counts` (2, 8, 32, ... and max_reqs = max_num_seqs + 1) that holds n + 1:

    tokens   [ request 0 | request 1 | ... | request n-1 | padding (request n) ]   T tokens, padded
    qsl      [ 0, q_0, q_0 + q_1, ..., N, T, T, ..., T ]                          R + 1 entries
    seq_lens [ s_0 ... s_n-1 | T - N | 0 ... 0 ]
    slots    [ each real token's slot ......... | -1 ... -1 ]

The padding request sees its own T - N keys from block 0 (its table row is zeros: some request's
keys, or the zeros the cache starts with, finite either way), stores nothing (slot -1), and its
rows' outputs are dropped before the logits; the empty requests' tiles exit at once, but each
still costs its launch and a search for its request (docs/benchmarks.md measures what a graph of
257 requests costs one prompt), hence graphs by request count as well as by token count. Rows mix only
in attention, where each sees its own request's keys, so padding cannot change a real row. The
step's real tokens keep the rows the eager path gives them, so everything that indexes rows (the
logits' rows, the in-flight tokens the device fills in) is the same on both paths.

The inputs live in static buffers that each step overwrites, copied from one of two pinned host
buffers used in turn (cuda_graph.HostBuffersInTurn). The LM head and sampling run after the graph, on the
rows they need. Without captured graphs (on a CPU) `forward` runs the model eagerly on the same
padded buffers, so the padding is tested where no graph can be captured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from ferry.attention.backend import AttentionBackend, AttentionMetadata, ForwardContext
from ferry.executor.cuda_graph import HostBuffersInTurn
from ferry.executor.inputs import fill_block_table

logger = logging.getLogger(__name__)


class _StepBuffers:
    """The inputs of a step of up to max_tokens tokens and max_reqs requests, packed in two tensors."""

    def __init__(
        self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device, pin_memory: bool = False
    ) -> None:
        self.max_tokens, self.max_reqs, self.max_blocks = max_tokens, max_reqs, max_blocks
        self.int64 = torch.zeros(3, max_tokens, dtype=torch.int64, device=device, pin_memory=pin_memory)
        self.int32 = torch.zeros(2 * max_reqs + 1 + max_reqs * max_blocks, dtype=torch.int32, device=device,
                                 pin_memory=pin_memory)
        self.input_ids, self.positions, self.slot_mapping = self.int64  # each (max_tokens,), a view
        self.query_start_loc = self.int32[:max_reqs + 1]
        self.seq_lens = self.int32[max_reqs + 1:2 * max_reqs + 1]
        self.block_tables = self.int32[2 * max_reqs + 1:].view(max_reqs, max_blocks)

    def copy_used_(self, src: _StepBuffers, num_tokens: int, num_table_rows: int) -> None:
        """Copy what a step of num_tokens tokens reads from `src` (asynchronously when it is pinned):
        its tokens, every request's start and length, and the first table rows."""
        self.int64[:, :num_tokens].copy_(src.int64[:, :num_tokens], non_blocking=True)
        used = 2 * self.max_reqs + 1 + num_table_rows * self.max_blocks
        self.int32[:used].copy_(src.int32[:used], non_blocking=True)


def request_counts(max_reqs: int) -> tuple[int, ...]:
    """The request counts graphs are captured for: 2 (one request and the padding), then four times
    as many each while that is at most half of max_reqs, then max_reqs."""
    counts = [2]
    while counts[-1] * 8 <= max_reqs:
        counts.append(counts[-1] * 4)
    return tuple(sorted({*counts, max_reqs}))


class PrefillGraphRunner:
    """Runs steps of up to the largest of `token_counts` tokens, any mix of prefill chunks and
    decodes, padded to a captured token count and request count.

    `prepare` pads a step into the static buffers and returns its inputs as views of them (None when
    it fits no graph); `forward` replays the graph of that token count (or, without one, runs the
    model eagerly on them) and returns the hidden states of all padded rows, the step's first.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        token_counts: Sequence[int],
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.token_counts = tuple(sorted(set(token_counts)))
        _, _, self.block_size, _, _ = kv_caches[0].shape
        self.device = kv_caches[0].device
        self.max_model_len = max_model_len
        self.max_reqs = max_num_seqs + 1  # the step's requests and the one that owns the padding
        self.request_counts = request_counts(self.max_reqs)
        max_tokens, max_blocks = self.token_counts[-1], -(-max_model_len // self.block_size)
        pin = self.device.type == "cuda"
        self._hosts = HostBuffersInTurn(
            lambda: _StepBuffers(max_tokens, self.max_reqs, max_blocks, torch.device("cpu"), pin), self.device)
        self._static = _StepBuffers(max_tokens, self.max_reqs, max_blocks, self.device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by (token count, request count)
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}  # a graph's hidden states, (tokens, hidden_size)

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def padded_tokens(self, num_tokens: int) -> int | None:
        """The smallest token count with a graph that holds num_tokens; None when none does."""
        return next((t for t in self.token_counts if t >= num_tokens), None)

    def padded_requests(self, num_reqs: int) -> int | None:
        """The smallest request count that holds num_reqs requests (the padding's included)."""
        return next((r for r in self.request_counts if r >= num_reqs), None)

    def _captured_request_counts(self, num_tokens: int) -> tuple[int, ...]:
        """The request counts a step of num_tokens tokens can need: each real request brings a token."""
        return tuple(r for r in self.request_counts if r <= self.padded_requests(min(num_tokens + 1, self.max_reqs)))

    # ---- the step ----

    def prepare(
        self, token_ids: Sequence[int], query_lens: np.ndarray, starts: np.ndarray, block_tables: list[list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata] | None:
        """(input_ids, positions, metadata) of a step padded into the static buffers, in which request
        i brings query_lens[i] tokens (token_ids holds them one request after another) from position
        starts[i] on, its KV blocks in block_tables[i]. None when it fits no graph: more tokens than
        the largest count, more requests than max_num_seqs, or a table wider than max_model_len needs."""
        n, num_tokens = len(query_lens), int(query_lens.sum())
        padded, reqs = self.padded_tokens(num_tokens), self.padded_requests(n + 1)
        lengths = np.fromiter(map(len, block_tables), np.int64, n)
        if padded is None or reqs is None or lengths.max() > self._static.max_blocks:
            return None
        h = self._hosts.take()
        ids, pos, slots = h.int64.numpy()
        qsl, seq_lens, tables = h.query_start_loc.numpy(), h.seq_lens.numpy(), h.block_tables.numpy()
        np.cumsum(query_lens, out=qsl[1:n + 1])
        qsl[n + 1:] = padded  # the padding request owns tokens num_tokens .. padded - 1; the rest own none
        seq_lens[:n] = starts + query_lens
        seq_lens[n], seq_lens[n + 1:] = padded - num_tokens, 0
        fill_block_table(tables[:n, :int(lengths.max())], block_tables, lengths)
        tables[n, :-(-(padded - num_tokens) // self.block_size)] = 0
        ids[:num_tokens] = token_ids
        ids[num_tokens:padded] = 0
        req_of_token = np.repeat(np.arange(n), query_lens)
        at = np.arange(num_tokens) - np.repeat(qsl[:n] - starts, query_lens)  # each token's position
        pos[:num_tokens] = at
        pos[num_tokens:padded] = np.arange(padded - num_tokens)
        bs = self.block_size
        slots[:num_tokens] = tables[req_of_token, at // bs].astype(np.int64) * bs + at % bs
        slots[num_tokens:padded] = -1
        self._static.copy_used_(h, padded, n + 1)
        self._hosts.copies_queued()
        s = self._static
        metadata = self._metadata(padded, reqs, qsl[:reqs + 1].tolist(), seq_lens[:reqs].tolist())
        return s.input_ids[:padded], s.positions[:padded], metadata

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """(padded tokens, hidden_size) hidden states of a step that `prepare` padded. A graph's replay
        reads the static buffers and writes the same output tensor each time: use it before the next
        step."""
        key = input_ids.shape[0], metadata.seq_lens.shape[0]
        graph = self._graphs.get(key)
        if graph is None:
            return self.model(input_ids, positions, ForwardContext(metadata, self.kv_caches, self.backend))
        graph.replay()
        return self._outputs[key]

    def _metadata(self, padded: int, reqs: int, query_start_loc_cpu: list[int], seq_lens_cpu: list[int]) -> AttentionMetadata:
        """The static buffers as a step of `padded` tokens over `reqs` requests. Its host values
        are the same for every step of those counts, as a graph needs (max_query_len = the token count
        makes the attention backend take its varlen kernel, whose grid needs only the token and
        request counts); the per-request lists are the step's own, for backends that loop in Python."""
        s = self._static
        return AttentionMetadata(
            slot_mapping=s.slot_mapping[:padded], query_start_loc=s.query_start_loc[:reqs + 1],
            seq_lens=s.seq_lens[:reqs], block_tables=s.block_tables[:reqs], max_query_len=padded,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu,
        )

    # ---- startup ----

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per token count and request count that a step of those tokens can need,
        largest first, each after an eager warm-up run that compiles its kernels. Every token is
        padding meanwhile (one request owning them all, slot -1), so no run writes the KV cache."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        start = time.perf_counter()
        s = self._static
        s.int64.zero_()
        s.slot_mapping.fill_(-1)
        s.block_tables.zero_()
        pool = torch.cuda.graph_pool_handle()
        s.query_start_loc.fill_(0)
        s.seq_lens.zero_()
        for padded in reversed(self.token_counts):
            s.positions[:padded].copy_(torch.arange(padded, device=self.device))
            s.query_start_loc[1:].fill_(padded)
            s.seq_lens[0] = padded
            for reqs in reversed(self._captured_request_counts(padded)):
                qsl, lens = [0] + [padded] * reqs, [padded] + [0] * (reqs - 1)
                inputs = (s.input_ids[:padded], s.positions[:padded], self._metadata(padded, reqs, qsl, lens))
                stream = torch.cuda.Stream(self.device)  # warm up off the captured stream (cuda_graph.py)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self.forward(*inputs)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[padded, reqs] = self.model(
                        inputs[0], inputs[1], ForwardContext(inputs[2], self.kv_caches, self.backend))
                self._graphs[padded, reqs] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d prefill graphs (token counts %s, request counts %s) in %.1f s", len(self._graphs),
                    self.token_counts, self.request_counts, time.perf_counter() - start)
