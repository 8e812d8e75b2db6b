"""The pool of fixed-size KV cache blocks, with reference counts.

A block is `block_size` token slots of K and V in every layer. Blocks are handed out and given back
as requests grow and finish; a block may be shared (prefix caching), so it is free only when its
reference count falls to zero. Free blocks wait in a queue ordered by when they were freed: the
block freed longest ago is reused first, which keeps recently freed (and possibly still useful)
contents alive longest.
"""

from __future__ import annotations

from collections import OrderedDict

from ferry.core.prefix_cache import PrefixCache


class BlockPool:
    """Free blocks may still hold cached K/V (prefix caching): such a block stays findable in the
    prefix cache until `allocate` hands it out for other tokens, which evicts it; `share` takes it
    back into use instead."""

    def __init__(self, num_blocks: int, prefix_cache: PrefixCache | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self.ref_counts = [0] * num_blocks
        # An OrderedDict rather than a deque: reusing a cached block must take it out of the
        # middle of the queue in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (the caller checks `num_free_blocks` first)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, only {len(self._free)} free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(n)]
        for block in blocks:
            self.ref_counts[block] = 1
            if self.prefix_cache is not None:
                self.prefix_cache.forget(block)  # evicted: its old contents are about to go
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Take one more reference to each (cached) block, taking free ones out of the free queue."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def num_free_among(self, blocks: list[int]) -> int:
        return sum(1 for block in blocks if self.ref_counts[block] == 0)

    def is_free(self, block: int) -> bool:
        return block in self._free

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks that nobody uses any more join the free queue.
        Callers pass a request's blocks in reverse order, so that its tail blocks, the least
        likely to be shared, are reused first."""
        for block in blocks:
            count = self.ref_counts[block] - 1
            if count < 0:
                raise RuntimeError(f"KV block {block} freed more often than allocated")
            self.ref_counts[block] = count
            if count == 0:
                self._free[block] = None
