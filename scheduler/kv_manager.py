"""Joint admission of KV blocks and state slots, on top of the pools and the prefix cache.

Admission is split in two so the prefill loop can run every check before any side effect:
``plan_admission`` is read-only and says OK / LATER / NEVER; ``admit`` performs the plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.block_pool import AllocStatus, BlockPool
from scheduler.config import SchedulerConfig
from scheduler.prefix_cache import ROOT_HASH, PrefixCache, salted_root
from scheduler.samples import blocks_after_step, group_root
from scheduler.sequence import Sequence


@dataclass(frozen=True)
class AdmissionPlan:
    status: AllocStatus
    cached_blocks: list[int]
    cached_hashes: list[int]
    num_new_blocks: int


class KvManager:
    def __init__(self, config: SchedulerConfig) -> None:
        self.block_size = config.block_size
        self.blocks = BlockPool(config.num_blocks, name="block")
        self.slots = (
            BlockPool(config.num_state_slots, name="state slot") if config.num_state_slots else None
        )
        self.prefix_cache = (
            PrefixCache(self.blocks, config.block_size) if config.enable_prefix_caching else None
        )
        # The samples of one request share their prompt's blocks whether or not prefix caching
        # is on: without it, through a cache of their own that only siblings find (samples.py).
        self.sample_cache = (
            self.prefix_cache
            if self.prefix_cache is not None
            else PrefixCache(self.blocks, config.block_size)
        )
        self.num_shared_tokens = 0  # prompt tokens a sample found in the samples' own cache

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def usage(self) -> float:
        return self.blocks.usage()

    def plan_admission(
        self, seq: Sequence, reserve: int = 0, batch: Iterable[Sequence] = ()
    ) -> AdmissionPlan:
        """What admitting a sequence with no blocks yet would take; changes nothing.

        ``reserve``: blocks others will take first (a mixed step's decode tokens), so the
        sequence is admissible only beside them (LATER otherwise, never NEVER). ``batch``: the
        sequences already in the prefill batch being assembled; a sample whose sibling there
        computes blocks it could take waits a step for them (LATER; samples.py)."""
        total = self.num_blocks_for(len(seq.token_ids))
        cached: list[int] = []
        hashes: list[int] = []
        root = self._root(seq)
        # A request that wants its prompt's logprobs computes every prompt token: a cached
        # prefix would have none to score.
        reuse = root is not None and seq.sampling_params.prompt_logprobs is None
        if reuse:
            cached, hashes = self.sample_cache.match(seq.token_ids, root)
        num_new = total - len(cached)
        if total > self.blocks.num_usable:
            return AdmissionPlan(AllocStatus.NEVER, [], [], num_new)
        if (
            reuse
            and seq.sample_group is not None
            and blocks_after_step(seq, batch, self.block_size) > len(cached)
        ):
            return AdmissionPlan(AllocStatus.LATER, [], [], num_new)
        # A cached block with no holder counts as free; reviving it takes it out of the free count.
        revived = self.sample_cache.count_evictable(cached) if cached else 0
        status = self.blocks.can_allocate(num_new + revived)
        if status is AllocStatus.OK and num_new + revived + reserve > self.blocks.num_free:
            status = AllocStatus.LATER
        # Blocks without a slot is LATER, never NEVER: slots come back as sequences finish.
        if (
            status is AllocStatus.OK
            and self.slots is not None
            and self.slots.can_allocate(1) is not AllocStatus.OK
        ):
            status = AllocStatus.LATER
        return AdmissionPlan(status, cached, hashes, num_new)

    def admit(self, seq: Sequence, plan: AdmissionPlan) -> None:
        assert plan.status is AllocStatus.OK and not seq.block_table
        for block in plan.cached_blocks:  # pin before allocating, so none of them is evicted
            self.blocks.pin(block)
        seq.block_table = plan.cached_blocks + self.blocks.allocate_many(plan.num_new_blocks)
        seq.block_hashes = list(plan.cached_hashes)
        seq.num_tokens = seq.num_cached_prefix_tokens = len(plan.cached_blocks) * self.block_size
        # Counted at admission, not at lookup: a head that stays LATER is looked up again
        # every step and would inflate the figure.
        if self.prefix_cache is not None:
            self.prefix_cache.num_hit_tokens += seq.num_cached_prefix_tokens
        else:
            self.num_shared_tokens += seq.num_cached_prefix_tokens
        if self.slots is not None:
            seq.state_slot = self.slots.allocate()

    def release(self, seq: Sequence) -> None:
        """Return a sequence's blocks and slot; cached blocks stay reusable until evicted."""
        if seq.block_table:
            self.blocks.free_many(seq.block_table)
            seq.block_table = []
        if seq.state_slot is not None:
            assert self.slots is not None
            self.slots.free(seq.state_slot)
            seq.state_slot = None

    def register_full_blocks(self, seq: Sequence) -> None:
        root = self._root(seq)
        if root is not None:
            self.sample_cache.register_full_blocks(seq, root)

    def _root(self, seq: Sequence) -> int | None:
        """Where ``seq``'s chains start in ``sample_cache``; None: it caches nothing."""
        if self.prefix_cache is not None:
            salt = seq.sampling_params.cache_salt
            return ROOT_HASH if salt is None else salted_root(salt)
        return group_root(seq.sample_group) if seq.sample_group is not None else None

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        if self.slots is not None:
            self.slots.check_integrity()
        self.sample_cache.check_integrity()
