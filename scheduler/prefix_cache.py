"""Prefix caching: full KV blocks shared by every sequence whose prompt starts the same way.

A block is keyed by ``(parent_hash, its tokens)``, where ``parent_hash`` chains the keys of every
block before it, so a key names a whole prefix, not one block's contents. The dictionary compares
the token tuple exactly; only the parent link relies on a 64-bit hash.

Lifecycle: a sequence registers each block once it is full (its KV computed). The block stays in
the index while any sequence holds it and, after its count drops to zero, while it sits in the
pool's evictable LRU; the pool calls ``on_evict`` when it reuses the block for something else.
"""

from __future__ import annotations

import hashlib

from scheduler.block_pool import BlockPool
from scheduler.sequence import Sequence

ROOT_HASH = 0


def salted_root(salt: str) -> int:
    """Where the chains of requests with this `cache_salt` start: their blocks match only
    each other's (a 63-bit digest of the salt; never ROOT_HASH)."""
    digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8, person=b"salt")
    return int.from_bytes(digest.digest(), "little") >> 1 | 1


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._block_by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        self._key_by_block: dict[int, tuple[int, tuple[int, ...]]] = {}
        pool.on_evict = self._forget
        self.num_hit_tokens = 0  # prompt tokens admitted with their KV already cached

    def __len__(self) -> int:
        return len(self._block_by_key)

    def match(self, token_ids: list[int], root: int = ROOT_HASH) -> tuple[list[int], list[int]]:
        """Longest cached chain of full blocks for ``token_ids``, starting from ``root`` (a
        chain of its own: scheduler/samples.py roots each sample group's).

        At least one token is always left to compute, since the step must produce the logits of
        the last prompt token. Returns ``(blocks, hashes)``; nothing is pinned yet.
        """
        size = self.block_size
        max_blocks = (len(token_ids) - 1) // size
        blocks: list[int] = []
        hashes: list[int] = []
        parent = root
        for index in range(max_blocks):
            key = (parent, tuple(token_ids[index * size : (index + 1) * size]))
            block = self._block_by_key.get(key)
            if block is None:
                break
            blocks.append(block)
            parent = hash(key)
            hashes.append(parent)
        return blocks, hashes

    def count_evictable(self, blocks: list[int]) -> int:
        """How many of ``blocks`` would leave the free count when pinned."""
        return sum(1 for block in blocks if self.pool.is_evictable(block))

    def register_full_blocks(self, seq: Sequence, root: int = ROOT_HASH) -> None:
        """Index every block of ``seq`` whose KV is now complete and not yet indexed, on the
        chain from ``root``."""
        size = self.block_size
        num_full = min(seq.num_tokens, len(seq.token_ids)) // size
        hashes = seq.block_hashes
        parent = hashes[-1] if hashes else root
        for index in range(len(hashes), num_full):
            key = (parent, tuple(seq.token_ids[index * size : (index + 1) * size]))
            block = seq.block_table[index]
            if key not in self._block_by_key and block not in self._key_by_block:
                self._block_by_key[key] = block
                self._key_by_block[block] = key
                self.pool.mark_cached(block)
            parent = hash(key)
            hashes.append(parent)

    def _forget(self, block: int) -> None:
        key = self._key_by_block.pop(block)
        del self._block_by_key[key]

    def check_integrity(self) -> None:
        assert len(self._block_by_key) == len(self._key_by_block), "prefix index out of step"
        for key, block in self._block_by_key.items():
            assert self._key_by_block.get(block) == key, f"block {block} indexed twice"
