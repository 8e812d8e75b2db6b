"""Block tables: which KV blocks each request owns, and which of them it found in the prefix cache.

Request r's token t lives in block `block_ids(r)[t // block_size]` at offset `t % block_size`.
A request gets blocks as its computed tokens grow and gives them all back when it finishes or is
preempted. With prefix caching, each block is registered under its chained hash as soon as it is
scheduled full (its K/V are stored early in the very step that computes it, before any attention
reads them, so a request admitted later in the same step may already share it), and a new request
starts from the longest run of cached blocks that begins its tokens.

With a sliding window W (every layer's), the query at position p reads only keys p - W + 1 .. p, so
once a request's next token is at position c, every block wholly before c - W + 1 is dead to it:
it is given back to the pool at once (and stays findable in the prefix cache until reused). Its
table keeps the dead entries, so that token t still lives in entry t // block_size; no kernel reads
them. A long generation then holds at most ceil(W / block_size) + 1 blocks, plus the one it grows
into.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferry.core.block_pool import BlockPool
from ferry.core.prefix_cache import PrefixCache
from ferry.core.request import Request


@dataclass
class PrefixHit:
    """What a new request can reuse: blocks to share, how many tokens they cover, and, when the
    whole prompt is cached, the block holding its last token, to be copied instead of shared (the
    last token is recomputed for its logits, and its K/V slot must not be written in a shared block)."""

    blocks: list[int]
    num_tokens: int
    copy_last_from: int | None = None


NO_HIT = PrefixHit([], 0)


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self.prefix_cache)
        self._blocks: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # blocks of each request already in the cache
        self._fresh: set[int] = set()  # blocks registered during the current schedule() call
        self._dropped: dict[str, int] = {}  # blocks trimmed off each request's table, not yet told
        self._released: dict[str, int] = {}  # leading blocks of each table given back: out of the window

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        """The request's table: entry t // block_size holds token t (with a window, the leading
        entries may be given back already: `held_block_ids`)."""
        return self._blocks.get(request_id, [])

    def held_block_ids(self, request_id: str) -> list[int]:
        """The blocks the request holds: its table but the entries the window let go."""
        return self._blocks.get(request_id, [])[self._released.get(request_id, 0):]

    def begin_step(self) -> None:
        self._fresh.clear()

    # ---- prefix cache ----

    def match_prefix(self, request: Request) -> PrefixHit:
        """The longest run of cached blocks that starts `request`'s tokens (not yet taken)."""
        cache = self.prefix_cache
        # Prompt logprobs need the logits of every prompt position, which cached tokens lack.
        if cache is None or request.sampling_params.prompt_logprobs is not None:
            return NO_HIT
        cache.hash_blocks(request.all_token_ids, self.block_size, request.block_hashes, request.cache_salt)
        blocks = []
        for block_hash in request.block_hashes:
            block = cache.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        hit = PrefixHit(blocks, len(blocks) * self.block_size)
        if hit.num_tokens == request.num_tokens:
            return self._recompute_last_token(hit)
        return self._match_partial_block(request, hit)

    def record_prefix_query(self, request: Request, hit: PrefixHit) -> None:
        """Count an admitted request's prompt in the prefix cache's hit rate (once per request, not
        once per step it waited at the head of the queue)."""
        if self.prefix_cache is not None:
            self.prefix_cache.queries += request.num_tokens
            self.prefix_cache.hits += hit.num_tokens

    def _match_partial_block(self, request: Request, hit: PrefixHit) -> PrefixHit:
        """Extend a hit by the longest partial block a finished request left behind (to be copied)."""
        start = hit.num_tokens
        parent = request.block_hashes[len(hit.blocks) - 1] if hit.blocks else None
        # At most block_size - 1 tokens, and never the prompt's last token (its logits are needed).
        longest = min(self.block_size - 1, request.num_tokens - 1 - start)
        for k in range(longest, 0, -1):
            key = self.prefix_cache.hash_block(parent, request.all_token_ids[start:start + k], request.cache_salt)
            block = self.prefix_cache.lookup_partial(key)
            if block is not None:
                return PrefixHit(hit.blocks, start + k, copy_last_from=block)
        return hit

    def _recompute_last_token(self, hit: PrefixHit) -> PrefixHit:
        last = hit.blocks[-1]
        if last in self._fresh:
            # Computed in this very step: nothing to copy yet. Recompute the whole last block.
            return PrefixHit(hit.blocks[:-1], hit.num_tokens - self.block_size)
        return PrefixHit(hit.blocks[:-1], hit.num_tokens - 1, copy_last_from=last)

    # ---- allocation ----

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> list[int] | None:
        """Make room for `num_new_tokens` more computed tokens (after the `hit` tokens, for a request
        being admitted). Returns the newly allocated block ids (often none: the last block still has
        room), or None when the pool is too short; then nothing changed."""
        blocks = self._blocks.get(request.request_id)
        if blocks is None:
            blocks = self._blocks[request.request_id] = []
        num_computed = max(request.num_computed_tokens, hit.num_tokens)
        num_tokens = num_computed + num_new_tokens
        needed = -(-num_tokens // self.block_size) - len(blocks) - len(hit.blocks)
        if needed <= 0 and not hit.blocks:  # the common decode step: the last block has room
            # A block boundary crossed (by one token, or by a token and its proposals).
            if self.prefix_cache is not None and num_tokens // self.block_size > num_computed // self.block_size:
                self._register_full_blocks(request, blocks, num_tokens)
            self._release_out_of_window(request.request_id, blocks, num_computed)
            return []
        # Shared cached blocks that sit in the free queue stop being free once taken.
        if max(needed, 0) + self.pool.num_free_among(hit.blocks) > self.pool.num_free_blocks:
            return None
        if hit.blocks:
            self.pool.share(hit.blocks)
            blocks.extend(hit.blocks)
        new_blocks = self.pool.allocate(needed) if needed > 0 else []
        blocks.extend(new_blocks)
        if self.prefix_cache is not None:
            self._register_full_blocks(request, blocks, num_tokens)
        self._release_out_of_window(request.request_id, blocks, num_computed)
        return new_blocks

    def _release_out_of_window(self, request_id: str, blocks: list[int], next_position: int) -> None:
        """Give back the leading blocks that no query from next_position on can see. (A step still
        running may read them; whoever takes them next writes them in a later step, and a device
        runs its steps in order.)"""
        if self.sliding_window is None:
            return
        dead = max(0, next_position - self.sliding_window + 1) // self.block_size
        released = self._released.get(request_id, 0)
        if dead > released:
            self.pool.free(blocks[released:dead][::-1])
            self._released[request_id] = dead

    def _register_full_blocks(self, request: Request, blocks: list[int], num_tokens: int) -> None:
        cache = self.prefix_cache
        # A token still in flight (asynchronous scheduling) has no id to hash yet: its block is
        # registered by a later step, once the id is known.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        cache.hash_blocks(request.all_token_ids[: num_full * self.block_size], self.block_size,
                          request.block_hashes, request.cache_salt)
        # (Blocks the window gave back may belong to another request by now: never registered here.)
        for i in range(max(start, self._released.get(request.request_id, 0)), num_full):
            if not cache.is_cached(blocks[i]):
                cache.insert(request.block_hashes[i], blocks[i])
                self._fresh.add(blocks[i])
        self._num_registered[request.request_id] = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks at the end of the request's table that none of its first num_tokens
        slots lie in (what rejected proposals had filled). They hold no registered block: only full
        blocks of known, computed tokens are in the prefix cache."""
        blocks = self._blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        dropped = blocks[keep:]
        del blocks[keep:]
        self.pool.free(dropped[::-1])
        self._dropped[request.request_id] = self._dropped.get(request.request_id, 0) + len(dropped)

    def take_dropped(self, request_id: str) -> int:
        """How many blocks `trim` took off the request's table since this was last asked."""
        return self._dropped.pop(request_id, 0)

    def free(self, request: Request) -> None:
        self._dropped.pop(request.request_id, None)
        blocks = self._blocks.pop(request.request_id, None)
        if blocks and self.prefix_cache is not None:
            # Blocks filled by a token that was in flight at their allocation are registered now.
            self._register_full_blocks(request, blocks, request.num_computed_tokens)
            self._register_partial_block(request, blocks)
        self._num_registered.pop(request.request_id, None)
        released = self._released.pop(request.request_id, 0)
        if len(blocks or ()) <= released:
            return
        self.pool.free(blocks[released:][::-1])

    def _register_partial_block(self, request: Request, blocks: list[int]) -> None:
        num_full, k = divmod(min(request.num_computed_tokens, request.num_tokens), self.block_size)
        if k == 0 or num_full >= len(blocks):
            return
        parent = request.block_hashes[num_full - 1] if num_full else None
        start = num_full * self.block_size
        key = self.prefix_cache.hash_block(parent, request.all_token_ids[start:start + k], request.cache_salt)
        self.prefix_cache.insert_partial(key, blocks[num_full])
