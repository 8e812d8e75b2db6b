"""Prefix caching: KV blocks keyed by the tokens that produced them, so a prompt never prefills the
same tokens twice.

A full block's key is a chained hash: the hash of its parent block's key, its own token ids, and the
request's cache salt (first block only):

    key(block 0) = H(salt,     tokens[0 : bs])
    key(block i) = H(key(i-1), tokens[i*bs : (i+1)*bs])

so two blocks share a key only when the whole prefix up to and including them is equal: a block's
K/V depend on every token before it, not only on its own. H is keyed BLAKE2b with a random key drawn
per process. Keys are thus unpredictable to clients: a crafted prompt cannot be made to collide with
another tenant's blocks and read their KV, and a different salt never matches.

Why hashes and not a radix tree: blocks are the unit of allocation anyway, a dict lookup per block is
O(1), and a block's key is computed once when it fills. What a radix tree adds, matching at token
granularity, matters at one place: a conversation's next turn resends the previous turn's tokens,
whose last block was only partly filled. So a finished request also registers its partial last
block, keyed by the same chained hash over the tokens it holds; a later request that starts with
those tokens copies the block (it is not shared: the new request goes on writing into it).
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence

BlockHash = bytes


class PrefixCache:
    """Maps block keys to the blocks that hold their K/V. The block pool tells it when a cached
    block is taken for other tokens (`forget`)."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key is not None else os.urandom(32)
        self._blocks: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._partial: dict[BlockHash, int] = {}  # key of a partial block's tokens -> block
        self._partial_hash_of: dict[int, BlockHash] = {}
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of which found in the cache

    def hash_block(self, parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None) -> BlockHash:
        h = hashlib.blake2b(key=self._key, digest_size=16)
        if parent is not None:
            h.update(parent)
        elif salt is not None:
            h.update(b"salt:" + salt.encode())
        h.update(array("q", token_ids).tobytes())
        return h.digest()

    def hash_blocks(
        self, token_ids: Sequence[int], block_size: int, hashes: list[BlockHash], salt: str | None = None
    ) -> None:
        """Extend `hashes` with the keys of every full block of `token_ids` not yet hashed."""
        for i in range(len(hashes), len(token_ids) // block_size):
            parent = hashes[i - 1] if i else None
            hashes.append(self.hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt))

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._blocks.get(block_hash)

    def insert(self, block_hash: BlockHash, block: int) -> None:
        # Two requests may compute the same block at once; the first to be registered stays the
        # cached one and the other block is simply not cached.
        if block_hash not in self._blocks and block not in self._hash_of:
            self._blocks[block_hash] = block
            self._hash_of[block] = block_hash

    def insert_partial(self, block_hash: BlockHash, block: int) -> None:
        if block_hash not in self._partial and block not in self._hash_of:
            self._partial[block_hash] = block
            self._partial_hash_of[block] = block_hash

    def lookup_partial(self, block_hash: BlockHash) -> int | None:
        return self._partial.get(block_hash)

    def forget(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._blocks[block_hash]
        block_hash = self._partial_hash_of.pop(block, None)
        if block_hash is not None:
            del self._partial[block_hash]

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def cached_blocks(self) -> list[int]:
        """The blocks whose contents can be found (full blocks, and partial ones)."""
        return [*self._hash_of, *self._partial_hash_of]

    def __len__(self) -> int:
        return len(self._blocks)
