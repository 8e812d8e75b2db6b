"""A draft model: a small model of the target's vocabulary guesses each request's next k tokens, one
forward each, and the target verifies them all in one step.

The draft keeps its own paged KV cache, laid out as the target's and indexed by the same blocks: a
request's token t has its draft K/V in block `block_ids[t // block_size]` of the draft's caches. So
the draft needs no block manager of its own (nothing to leak: its blocks are the target's, freed
with them), and the scheduler only allocates k slots of lookahead past a sampling request's tokens,
where the draft stores the K/V of the guesses it feeds itself.

After a step, with L tokens known (the last one just sampled), a request's draft K/V hold its
tokens up to `computed` (see _Memo). One forward catches up (the tokens computed .. L-1: usually one
or two, a whole prompt the first time) and samples guess d0 after token L-1; then k-1 forwards of
one token each feed d0 .. d(k-2) at positions L .. L+k-2 and sample d1 .. d(k-1):

    positions        ... L-2  L-1 |  L    L+1  ...  L+k-2
    draft input          t    t   |  d0   d1   ...  d(k-2)        (catch-up | guesses fed back)
    sampled after                d0 |  d1   d2   ...  d(k-1)

The K/V of a guess stay valid when the target keeps it, since the K/V at a position depend only on
the tokens up to it; the next step finds how many it kept by comparing its tokens with the guesses.

With speculative_config's draft_confidence_threshold, a request's guesses end after one that had
less than that probability under the distribution it came from (the softmax of the draft's logits
for an argmax), and the forwards end once no request goes on; the target's verification is the same
whatever the length.

Greedy requests get the draft's argmax (plain guesses). Sampled requests get guesses drawn from the
draft's distribution q under their own temperature, top-k, top-p and min-p (and penalties, counted
over the tokens known when proposing), and q goes with them to the verification, whose rejection
rule keeps the target's distribution exact whatever q is (sample/rejection.py).

A stale draft cache costs acceptance, never correctness: positions the target took from the prefix
cache are taken to hold the draft K/V of the request that computed them, which holds unless that
request ended before its draft caught up. On CUDA the forwards replay the draft's own decode graphs
(catch-up of one or two tokens a request, then one token), padded like the target's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ferry.attention.backend import AttentionBackend, ForwardContext
from ferry.config import CacheConfig, EngineConfig, ModelConfig
from ferry.executor.inputs import flat_batch
from ferry.sample import Sampler, SamplingRow
from ferry.sample.metadata import position_seed, request_generator
from ferry.sample.sampler import inverse_cdf
from ferry.spec.proposer import Proposer, SpecRequest
from ferry.transfer import to_device

logger = logging.getLogger(__name__)

_DRAFT_STREAM = 1  # a seeded request's draft draws from a random stream of its own (metadata.position_seed)


@dataclass
class _Memo:
    """What the draft's cache holds of one request: its K/V up to `computed` (exclusive), and, from
    the last proposal, the guesses fed at positions fed_start.. (valid where the target kept them)."""

    computed: int
    fed_start: int = 0
    fed: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # a seeded request's, for its guesses


class DraftModelProposer(Proposer):
    def __init__(self, config: EngineConfig, model: torch.nn.Module, draft_config: ModelConfig) -> None:
        spec = config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens
        # Guesses d0 .. d(k-2) are stored at L .. L+k-2, and L may be one past the step's tokens.
        self.lookahead_slots = spec.num_speculative_tokens
        self.model = model
        self.model_config = draft_config
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.max_tokens_per_forward = config.scheduler.max_num_batched_tokens
        self.max_model_len = config.model.max_model_len
        # Its own random stream: guesses drawn with the target's uniform numbers would be correlated
        # with the tokens the target draws.
        self.sampler = Sampler(seed=position_seed(config.seed, 0, _DRAFT_STREAM), device=self.device)
        self.kv_caches: list[torch.Tensor] = []
        self.backend: AttentionBackend | None = None
        self.graphs = None  # a DecodeGraphRunner of the draft, for one- and two-token rows
        self.confidence_threshold = spec.draft_confidence_threshold

    @classmethod
    def load(cls, config: EngineConfig) -> DraftModelProposer:
        """The draft of config.speculative_config, on the device, its GEMVs tuned (before the KV
        cache takes the memory)."""
        from ferry.layers.linear import tune_small_batch
        from ferry.loader.loader import load_model

        draft = config.speculative_config.draft
        model = load_model(draft, config.device)
        tune_small_batch(model, getattr(torch, draft.dtype))
        logger.info("draft model %s: %.3f GB of weights, up to %d tokens proposed a step", draft.path,
                    sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9,
                    config.speculative_config.num_speculative_tokens)
        return cls(config, model, draft)

    def kv_bytes_per_block(self, cache: CacheConfig) -> int:
        from ferry.attention.kv_cache import kv_cache_bytes_per_block

        return kv_cache_bytes_per_block(self.model_config, cache)

    def allocate(self, config: EngineConfig, num_blocks: int, backend: AttentionBackend) -> None:
        """The draft's KV caches (num_blocks, as the target's) and, unless enforce_eager, its graphs."""
        from ferry.attention.kv_cache import allocate_kv_caches

        self.kv_caches = allocate_kv_caches(self.model_config, config.cache, num_blocks, self.device)
        self.backend = backend
        cuda = self.device.type == "cuda"
        if cuda and backend.for_decode_graph(1, self.model_config.num_kv_heads, config.model.max_model_len,
                                             self.device) is None:
            logger.warning("the draft's %s attention backend cannot run in a CUDA graph: its steps run eagerly",
                           type(backend).__name__)
        elif not config.enforce_eager:
            from ferry.executor.cuda_graph import DecodeGraphRunner

            self.graphs = DecodeGraphRunner(self.model, self.kv_caches, backend, config.decode_graph_sizes,
                                            config.model.max_model_len, query_lens=(1, 2))
            if self.device.type == "cuda":
                self.graphs.capture()

    # ---- proposing ----

    @torch.inference_mode()
    def propose(
        self, requests: list[SpecRequest], prefilled: Sequence[tuple[SpecRequest, int]] = (),
    ) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in requests]
        # (A request whose newest token has no slot yet, where the scheduler gave it no lookahead,
        # gets no guesses: the draft could not store that token's K/V.)
        able = [i for i, r in enumerate(requests) if r.num_tokens <= len(r.block_ids) * self.block_size]
        for request in requests:
            request.draft_probs = None
        # Prompt chunks the target computed this step, so that the draft's cache keeps level with
        # the target's: a later request that finds these blocks in the prefix cache finds both.
        chunks = [(r, self._computed(r, end, newest_known=False), end) for r, end in prefilled]
        chunks = [(r, start, end) for r, start, end in chunks if start < end]
        if able or chunks:
            for i, proposal in zip(able, self._propose([requests[i] for i in able], chunks)):
                proposals[i] = proposal
        return proposals

    def _propose(self, requests: list[SpecRequest], chunks: list[tuple[SpecRequest, int, int]]) -> list[list[int]]:
        k = self.num_speculative_tokens
        lengths = [request.num_tokens for request in requests]
        starts = [self._computed(request, length) for request, length in zip(requests, lengths)]
        hidden = self._catch_up([*requests, *(r for r, _, _ in chunks)], [*starts, *(s for _, s, _ in chunks)],
                                [*lengths, *(e for _, _, e in chunks)])
        for request, length in zip(requests, lengths):
            request.memo.computed = length
        for request, _, end in chunks:
            request.memo.computed = end
        if not requests:
            return []
        # Guesses past the slots a request holds (or past the context) could not store their K/V: it
        # gets fewer.
        counts = [min(k, len(r.block_ids) * self.block_size - length + 1, self.max_model_len - length + 1)
                  for r, length in zip(requests, lengths)]
        rows = [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.memo.generator) for r in requests]
        sampled = [i for i, row in enumerate(rows) if not row.greedy]
        guesses, probs = [], []
        hidden = hidden[:len(requests)]
        for j in range(k):
            if j:
                # A row whose slots are used up stores nothing, at a position it holds; its guess is dropped.
                positions = [length + j - 1 if count > j else length - 1 for length, count in zip(lengths, counts)]
                hidden = self._feed(requests, guesses[-1], positions, [count > j for count in counts])
            logits = self.model.compute_logits(hidden)
            tokens, q = self._choose(logits, rows, sampled, lengths, j)
            guesses.append(tokens)
            probs.append(q)
            if self.confidence_threshold and j + 1 < k and not self._go_on(logits, tokens, q, sampled, counts, j):
                break
        # (n, k' <= k): the one wait for the device, unless the threshold waited for each guess's confidence
        proposals = torch.stack(guesses, dim=1).tolist()
        for i, request in enumerate(requests):
            proposals[i] = proposals[i][:counts[i]]
            request.memo.fed_start, request.memo.fed = lengths[i], proposals[i][:-1]
        if sampled:
            q_all = torch.stack(probs, dim=1)  # (len(sampled), k, vocab)
            for s, i in enumerate(sampled):
                requests[i].draft_probs = q_all[s, :len(proposals[i])]
        return proposals

    def _go_on(self, logits: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor | None, sampled: list[int],
               counts: list[int], j: int) -> bool:
        """After guess j: a request whose guess had less than confidence_threshold of the draft's
        probability gets no more (counts[i] lowered to j + 1, in place); whether any goes on."""
        confidence = logits.softmax(dim=-1).gather(1, tokens[:, None])[:, 0]
        if sampled:
            index = to_device(sampled, torch.int64, self.device)
            confidence[index] = q.gather(1, tokens[index][:, None])[:, 0]
        for i, sure in enumerate((confidence >= self.confidence_threshold).tolist()):
            if not sure:
                counts[i] = min(counts[i], j + 1)
        return any(count > j + 1 for count in counts)

    def _computed(self, request: SpecRequest, length: int, newest_known: bool = True) -> int:
        """How many of the request's first `length` tokens the draft's cache holds, the guesses it
        kept included; short of the last one where that one was just sampled (newest_known): the
        draft's catch-up forward computes it, and the first guess comes from its logits."""
        memo = request.memo
        if memo is None:
            memo = request.memo = _Memo(request.num_cached_tokens)
            if request.params.seed is not None:
                memo.generator = request_generator(request.params.seed, self.device)
        if memo.fed:
            kept = request.token_ids(memo.fed_start, min(memo.fed_start + len(memo.fed), length))
            matched = next((j for j, (a, b) in enumerate(zip(kept, memo.fed)) if a != b), len(kept))
            memo.computed = max(memo.computed, memo.fed_start + matched)
            memo.fed = []
        memo.computed = min(memo.computed, length - 1 if newest_known else length)
        return memo.computed

    def _catch_up(self, requests: list[SpecRequest], starts: list[int], lengths: list[int]) -> torch.Tensor:
        """Forwards over each request's tokens starts[i] .. lengths[i] - 1; (n, hidden) of the last.
        Where every request brings one or two tokens, all bring the same number (a token the cache
        holds already is stored again, the same), so that the draft's graphs can run it; a long
        catch-up (a prompt) goes in chunks of the step's token budget."""
        q = max(length - start for start, length in zip(starts, lengths))
        if self.graphs is not None and q <= 2 and min(lengths) >= q:
            starts = [length - q for length in lengths]
            tokens = [t for r, s, length in zip(requests, starts, lengths) for t in r.token_ids(s, length)]
            inputs = self.graphs.prepare(tokens, starts, [r.block_ids for r in requests], q)
            if inputs is not None:
                return self.graphs.forward(inputs)[q - 1:len(requests) * q:q]
        starts, budget = list(starts), self.max_tokens_per_forward
        while sum(lengths) - sum(starts) > budget:  # chunks that leave each request its last token
            news = []
            for start, length in zip(starts, lengths):
                news.append(max(min(length - start - 1, budget - sum(news)), 0))
            some = [i for i, new in enumerate(news) if new]
            if not some:
                break
            self._forward_chunks([requests[i] for i in some], [starts[i] for i in some], [news[i] for i in some])
            starts = [start + new for start, new in zip(starts, news)]
        hidden, last_rows = self._forward_chunks(requests, starts, [length - start for start, length in
                                                                    zip(starts, lengths)])
        return hidden[to_device(last_rows, torch.int64, self.device)]

    def _forward_chunks(self, requests: list[SpecRequest], starts: list[int], news: list[int]):
        """One eager forward of news[i] tokens of request i from starts[i]; the hidden states and the
        row of each request's last token."""
        tokens = [t for r, s, new in zip(requests, starts, news) for t in r.token_ids(s, s + new)]
        positions, metadata, query_start_loc = flat_batch(
            np.asarray(news, np.int64), np.asarray(starts, np.int64), [r.block_ids for r in requests],
            self.block_size, self.device)
        hidden = self._forward(to_device(tokens, torch.int64, self.device), positions, metadata)
        return hidden, (query_start_loc[1:] - 1).tolist()

    def _feed(self, requests: list[SpecRequest], tokens: torch.Tensor, positions: list[int],
              store: list[bool]) -> torch.Tensor:
        """One token a request (on the device) at `positions`; (n, hidden). A request with store False
        stores nothing (its slot is -1)."""
        n = len(requests)
        tables = [r.block_ids for r in requests]
        if self.graphs is not None:
            inputs = self.graphs.prepare([0] * n, positions, tables, 1)
            if inputs is not None:
                inputs.input_ids[:n].copy_(tokens)
                if not all(store):
                    inputs.attn_metadata.slot_mapping[:n].masked_fill_(_mask(store, self.device), -1)
                return self.graphs.forward(inputs)[:n]
        positions_t, metadata, _ = flat_batch(
            np.ones(n, np.int64), np.asarray(positions, np.int64), tables, self.block_size, self.device)
        if not all(store):
            metadata.slot_mapping.masked_fill_(_mask(store, self.device), -1)
        return self._forward(tokens, positions_t, metadata)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor:
        ctx = ForwardContext(metadata, self.kv_caches, self.backend)
        return self.model(input_ids, positions, ctx)

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow], sampled: list[int], lengths: list[int],
                j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(n, vocab) -> each request's guess (n,), and q of the sampled ones (len(sampled), vocab)."""
        tokens = logits.argmax(dim=-1)
        if not sampled:
            return tokens, None
        some = [rows[i] for i in sampled]
        for i, row in zip(sampled, some):
            if row.generator is not None:
                row.generator.manual_seed(position_seed(row.params.seed, lengths[i] + j, _DRAFT_STREAM))
        index = to_device(sampled, torch.int64, self.device)
        q = self.sampler.distribution(logits[index], some)
        tokens[index] = inverse_cdf(q, self.sampler.uniforms(some, self.device), logits[index])
        return tokens, q


def _mask(store: list[bool], device: torch.device) -> torch.Tensor:
    return to_device([not s for s in store], torch.bool, device)
