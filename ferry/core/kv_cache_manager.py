"""Block tables: which KV blocks each request owns.

Request r's token t lives in block `block_ids(r)[t // block_size]` at offset `t % block_size`.
A request gets blocks as its computed tokens grow and gives them all back when it finishes or is
preempted.
"""

from __future__ import annotations

from ferry.core.block_pool import BlockPool
from ferry.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` more computed tokens. Returns the newly added block ids
        (often none: the last block still has room), or None when the pool is too short; then
        nothing was allocated."""
        blocks = self._blocks.setdefault(request.request_id, [])
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(blocks)
        if needed <= 0:
            return []
        if needed > self.pool.num_free_blocks:
            return None
        new_blocks = self.pool.allocate(needed)
        blocks.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free(blocks[::-1])
