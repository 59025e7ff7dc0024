"""A reference-counted pool of fixed-size units: KV blocks, or per-sequence state slots.

Invariants (``check_integrity`` verifies them):
- index 0 is reserved and never handed out; the model runtime uses it as a padding target;
- every other index is in exactly one place: the free list (count 0, holds nothing), the
  evictable LRU (count 0, still holds a cached prefix block), or in use (count > 0);
- ``num_free`` counts both free and evictable units: an evictable unit is reclaimed on demand.

Allocation pops from the free list first and only then evicts the least recently released cached
unit, so cached prefixes survive as long as there is any truly free memory.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable


class AllocStatus(enum.Enum):
    OK = "ok"  # can allocate now
    LATER = "later"  # not now; may fit once others release
    NEVER = "never"  # larger than the whole pool: waiting cannot help


class BlockPool:
    def __init__(self, num_blocks: int, *, name: str = "block") -> None:
        if num_blocks < 2:
            raise ValueError(
                f"a {name} pool needs at least 2 {name}s ({name} 0 is reserved), got {num_blocks}"
            )
        self.name = name
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Popping from the end hands out low indices first, which keeps traces readable.
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached = bytearray(num_blocks)  # 1 while a unit holds a registered cached prefix
        self.on_evict: Callable[[int], None] | None = None

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def usage(self, num_planned: int = 0) -> float:
        """Fraction of usable units in use, counting ``num_planned`` more as if allocated."""
        return (self.num_used + num_planned) / self.num_usable

    def can_allocate(self, count: int) -> AllocStatus:
        if count > self.num_usable:
            return AllocStatus.NEVER
        return AllocStatus.OK if count <= self.num_free else AllocStatus.LATER

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    # -- mutation ---------------------------------------------------------------------------
    def allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
        else:
            raise RuntimeError(f"{self.name} pool exhausted ({self.num_usable} usable)")
        self.ref_counts[block] = 1
        return block

    def allocate_many(self, count: int) -> list[int]:
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} {self.name}s but only {self.num_free} are free")
        return [self.allocate() for _ in range(count)]

    def pin(self, block: int) -> None:
        """Take one more reference to a unit (shared prefix, or a cached unit revived)."""
        if block <= 0 or block >= self.num_blocks:
            raise ValueError(f"{self.name} {block} is outside 1..{self.num_blocks - 1}")
        if self.ref_counts[block] == 0:
            if block not in self._evictable:
                raise RuntimeError(f"cannot pin free {self.name} {block}")
            del self._evictable[block]
        self.ref_counts[block] += 1

    def free(self, block: int) -> None:
        count = self.ref_counts[block] - 1
        assert count >= 0 and block != 0, f"double free of {self.name} {block}"
        self.ref_counts[block] = count
        if count == 0:
            if self._cached[block]:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def free_many(self, blocks: list[int]) -> None:
        # Release in reverse so a sequence's tail blocks become the oldest evictable entries:
        # its prefix (the part other requests can share) is evicted last.
        for block in reversed(blocks):
            self.free(block)

    def mark_cached(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"only a held {self.name} can become cached"
        self._cached[block] = 1

    def _uncache(self, block: int) -> None:
        self._cached[block] = 0
        if self.on_evict is not None:
            self.on_evict(block)

    # -- checks -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant."""
        free = set(self._free)
        assert len(free) == len(self._free), f"duplicate {self.name}s in the free list"
        assert 0 not in free and 0 not in self._evictable, f"{self.name} 0 was handed out"
        assert not free & set(self._evictable), f"{self.name} both free and evictable"
        for block in range(1, self.num_blocks):
            count = self.ref_counts[block]
            assert count >= 0, f"{self.name} {block} has count {count}"
            placed = (block in free) + (block in self._evictable) + (count > 0)
            assert placed == 1, f"{self.name} {block} (count {count}) is in {placed} places"
            if block in self._evictable:
                assert self._cached[block], f"evictable {self.name} {block} is not cached"
            if block in free:
                assert not self._cached[block], f"free {self.name} {block} is still cached"
