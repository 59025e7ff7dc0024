"""Expert placement: which physical expert slot on which rank holds which logical expert.

Shape legend: T = tokens, E = logical experts, P = physical slots, K = top-k,
R_max = most replicas of any one logical expert.

Physical slots are numbered rank-major: rank r hosts slots [r * S, (r + 1) * S) with
S = P // num_ranks, so the rank of slot p is p // S and its local index is p % S. The maps are
named as in DeepSeek's EPLB (`phy2log`, `log2phy`, `logcnt`) so a balancer's output plugs in as is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class ExpertPlacement:
    """Logical ↔ physical expert maps for one EP group.

    phy2log: [P] int64 — logical expert held by each physical slot.
    log2phy: [E, R_max] int64 — physical slots of each logical expert, ascending, padded with -1.
    logcnt:  [E] int64 — number of replicas of each logical expert (>= 1).
    num_ranks: ranks in the EP group; must divide P.
    Build with `even()` or `from_phy2log()`; the maps live on CPU.
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor
    num_ranks: int

    def __post_init__(self) -> None:
        num_physical = self.phy2log.numel()
        if self.num_ranks < 1 or num_physical % self.num_ranks != 0:
            raise ValueError(
                f"num_ranks={self.num_ranks} must be >= 1 and divide the number of physical "
                f"slots P={num_physical}"
            )
        assert self.phy2log.dim() == 1 and self.logcnt.dim() == 1, "maps must be 1-D"
        assert self.log2phy.shape[0] == self.logcnt.shape[0], (self.log2phy.shape, self.logcnt)
        assert int(self.logcnt.sum()) == num_physical, (self.logcnt, num_physical)

    @property
    def num_experts(self) -> int:
        return self.logcnt.numel()

    @property
    def num_physical(self) -> int:
        return self.phy2log.numel()

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    @classmethod
    def even(cls, num_experts: int, num_ranks: int) -> ExpertPlacement:
        """One slot per logical expert, contiguous blocks of E / num_ranks per rank."""
        if num_experts < 1 or num_ranks < 1 or num_experts % num_ranks != 0:
            raise ValueError(
                f"even placement needs num_experts={num_experts} to be a positive multiple of "
                f"num_ranks={num_ranks}"
            )
        return cls.from_phy2log(torch.arange(num_experts), num_experts, num_ranks)

    @classmethod
    def with_redundancy(
        cls, num_experts: int, num_ranks: int, num_redundant: int
    ) -> ExpertPlacement:
        """E + `num_redundant` slots in contiguous blocks per rank: the experts in order, then
        the redundant slots holding experts 0, 1, ... again (a start for EPLB, which moves
        them where the load is). num_redundant = 0 is `even`."""
        num_physical = num_experts + num_redundant
        if num_experts < 1 or num_redundant < 0 or num_ranks < 1 or num_physical % num_ranks:
            raise ValueError(
                f"num_experts={num_experts} plus num_redundant={num_redundant} slots must be a "
                f"positive multiple of num_ranks={num_ranks}"
            )
        return cls.from_phy2log(torch.arange(num_physical) % num_experts, num_experts, num_ranks)

    @classmethod
    def from_phy2log(
        cls, phy2log: torch.Tensor | list[int], num_experts: int, num_ranks: int
    ) -> ExpertPlacement:
        """Build the maps from `phy2log: [P]`; replicas allowed, every expert at least once."""
        phy2log = torch.as_tensor(phy2log, dtype=torch.int64).cpu()
        if phy2log.dim() != 1 or phy2log.numel() == 0:
            raise ValueError(f"phy2log must be a non-empty 1-D list, got shape {phy2log.shape}")
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        bad = phy2log[(phy2log < 0) | (phy2log >= num_experts)]
        if bad.numel() > 0:
            raise ValueError(
                f"phy2log has ids outside [0, num_experts={num_experts}): {bad.tolist()}"
            )
        logcnt = torch.bincount(phy2log, minlength=num_experts)
        missing = (logcnt == 0).nonzero().flatten().tolist()
        if missing:
            raise ValueError(
                f"logical experts {missing} have no physical slot in phy2log={phy2log.tolist()}"
            )
        max_replicas = int(logcnt.max())
        log2phy = torch.full((num_experts, max_replicas), -1, dtype=torch.int64)
        filled = [0] * num_experts
        for physical, logical in enumerate(phy2log.tolist()):
            log2phy[logical, filled[logical]] = physical
            filled[logical] += 1
        return cls(phy2log=phy2log, log2phy=log2phy, logcnt=logcnt, num_ranks=num_ranks)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank={rank} outside [0, num_ranks={self.num_ranks})")

    def hosted_slots(self, rank: int) -> list[int]:
        """Global physical slot ids hosted by `rank`, in local-slot order."""
        self._check_rank(rank)
        first = rank * self.slots_per_rank
        return list(range(first, first + self.slots_per_rank))

    def hosted_logical(self, rank: int) -> list[int]:
        """Sorted logical expert ids whose weights `rank` must load."""
        return sorted(set(self.phy2log[self.hosted_slots(rank)].tolist()))

    def local_phy2log(self, rank: int) -> list[int]:
        """The logical expert in each of `rank`'s local slots, in local-slot order."""
        self._check_rank(rank)
        first = rank * self.slots_per_rank
        return self.phy2log[first : first + self.slots_per_rank].tolist()


def keep_hosted_slots(current: ExpertPlacement, proposed: ExpertPlacement) -> ExpertPlacement:
    """`proposed` with each rank's slots reordered so that every expert a rank keeps stays in
    the local slot it has now; the experts new to a rank fill the freed slots in `proposed`'s
    order. Which rank holds what (so every rank's load) is `proposed`'s; only the order within
    a rank changes, which dispatch does not care about. A move then writes only the slots
    whose expert changes (`slot_moves`). Deterministic: every rank computes the same maps.
    """
    if (current.num_experts, current.num_physical, current.num_ranks) != (
        proposed.num_experts,
        proposed.num_physical,
        proposed.num_ranks,
    ):
        raise ValueError(
            f"placements differ in shape: current has E={current.num_experts}, "
            f"P={current.num_physical}, N={current.num_ranks}; proposed has "
            f"E={proposed.num_experts}, P={proposed.num_physical}, N={proposed.num_ranks}"
        )
    aligned: list[int] = []
    for rank in range(current.num_ranks):
        wanted = proposed.local_phy2log(rank)
        remaining = Counter(wanted)
        slots: list[int | None] = []
        for expert in current.local_phy2log(rank):
            keep = remaining[expert] > 0
            remaining[expert] -= keep
            slots.append(expert if keep else None)
        newcomers = []
        for expert in wanted:
            if remaining[expert] > 0:
                remaining[expert] -= 1
                newcomers.append(expert)
        fill = iter(newcomers)
        aligned.extend(expert if expert is not None else next(fill) for expert in slots)
    return ExpertPlacement.from_phy2log(aligned, proposed.num_experts, proposed.num_ranks)


@dataclass(frozen=True)
class SlotMoves:
    """What one rank writes into its local slots to go from one placement to another.

    load: (local slot, logical expert) pairs for experts the rank does not hold now (read from
        the checkpoint), each expert once.
    copy: (local slot, source local slot) pairs: another replica of an expert the rank keeps
        (the source is a slot that does not change) or loads in this move (the source is its
        `load` slot, so loads are written first).
    Slots in neither keep their expert.
    """

    load: tuple[tuple[int, int], ...]
    copy: tuple[tuple[int, int], ...]

    @property
    def num_slots(self) -> int:
        """Slots whose weights are rewritten."""
        return len(self.load) + len(self.copy)


def slot_moves(current: ExpertPlacement, new: ExpertPlacement, rank: int) -> SlotMoves:
    """The writes that turn `rank`'s slots under `current` into those under `new` (normally
    `keep_hosted_slots(current, proposed)`, so that kept experts do not move)."""
    before, after = current.local_phy2log(rank), new.local_phy2log(rank)
    if len(before) != len(after):
        raise ValueError(
            f"slots per rank differ: {len(before)} now, {len(after)} in the new placement"
        )
    source = {}  # logical expert -> a local slot holding it once the loads are written
    for slot, (old, new_expert) in enumerate(zip(before, after, strict=True)):
        if old == new_expert:
            source.setdefault(old, slot)
    load, copy = [], []
    for slot, (old, new_expert) in enumerate(zip(before, after, strict=True)):
        if old == new_expert:
            continue
        if new_expert in source:
            copy.append((slot, source[new_expert]))
        else:
            load.append((slot, new_expert))
            source[new_expert] = slot
    return SlotMoves(tuple(load), tuple(copy))


@dataclass(frozen=True)
class ExpertTransfer:
    """One expert a rank takes from a rank that holds it, as EPLB stages a new placement.

    dst, row: the receiving rank and the row of its staging buffers (its
        `slot_moves(current, new, dst).load` in order); expert: the logical expert.
    src, src_slot: the rank that sends it and the local slot that holds it there under the
        current placement. src == dst: the rank held it already, in a slot the move rewrites
        (a copy within the rank, nothing sent).
    """

    dst: int
    row: int
    expert: int
    src: int
    src_slot: int


def plan_transfers(current: ExpertPlacement, new: ExpertPlacement) -> tuple[ExpertTransfer, ...]:
    """Every rank's `load` of `slot_moves(current, new, rank)`, each with the rank it comes
    from, in one order (by receiving rank, then row) that every rank computes alike. A rank
    that holds the expert itself is its own source; otherwise the expert comes from the holder
    that sends the fewest so far (the lowest rank on ties), which spreads the sending over
    the replicas of a hot expert."""
    if (current.num_physical, current.num_ranks) != (new.num_physical, new.num_ranks):
        raise ValueError(
            f"placements differ in shape: P={current.num_physical} over N={current.num_ranks} "
            f"now, P={new.num_physical} over N={new.num_ranks} proposed"
        )
    holders: dict[int, list[tuple[int, int]]] = {}
    for rank in range(current.num_ranks):
        seen = set()
        for slot, expert in enumerate(current.local_phy2log(rank)):
            if expert not in seen:  # one slot per rank and expert: the first
                seen.add(expert)
                holders.setdefault(expert, []).append((rank, slot))
    sent = [0] * current.num_ranks
    transfers = []
    for dst in range(new.num_ranks):
        for row, (_, expert) in enumerate(slot_moves(current, new, dst).load):
            own = [holder for holder in holders[expert] if holder[0] == dst]
            if own:
                src, src_slot = own[0]
            else:
                src, src_slot = min(holders[expert], key=lambda h: (sent[h[0]], h[0]))
                sent[src] += 1
            transfers.append(ExpertTransfer(dst, row, expert, src, src_slot))
    return tuple(transfers)


def shrink_placement(current: ExpertPlacement, survivors: list[int]) -> ExpertPlacement:
    """The placement of a group shrunk onto `survivors` (ranks of `current`, ascending; they
    become ranks 0, 1, ... in that order) after the other ranks were lost.

    Every survivor keeps its slots as they are, in their local order (nothing it holds is
    read again). The experts that no survivor holds (orphans) are handed out in order, one
    per survivor in turn, as new slots after the kept ones; every rank then gets as many
    slots, S' = S + ceil(orphans / survivors), a rank with fewer orphans filling the rest
    with replicas of its own experts (copies, nothing read). Deterministic: every rank
    computes the same maps."""
    num_ranks = len(survivors)
    if num_ranks < 1 or sorted(set(survivors)) != list(survivors):
        raise ValueError(f"survivors must be ascending distinct ranks, got {survivors}")
    for rank in survivors:
        current._check_rank(rank)
    kept = [current.local_phy2log(rank) for rank in survivors]
    held = {expert for slots in kept for expert in slots}
    orphans = [expert for expert in range(current.num_experts) if expert not in held]
    new_slots = -(-len(orphans) // num_ranks)
    phy2log: list[int] = []
    for index, slots in enumerate(kept):
        mine = orphans[index::num_ranks]
        padding = [slots[i % len(slots)] for i in range(new_slots - len(mine))]
        phy2log.extend(slots + mine + padding)
    return ExpertPlacement.from_phy2log(phy2log, current.num_experts, num_ranks)


@dataclass(frozen=True)
class ReshardMoves:
    """How one rank fills the local slots of a placement with another slot count (a group
    that shrank or grew) from the slots it has.

    kept: (new slot, old slot) pairs: an expert the rank holds, copied from its weights.
    load: (new slot, logical expert) pairs: an expert it does not hold, each expert once.
    copy: (new slot, new slot) pairs: another replica of a loaded expert, copied from its
        `load` slot once the loads are written.
    """

    kept: tuple[tuple[int, int], ...]
    load: tuple[tuple[int, int], ...]
    copy: tuple[tuple[int, int], ...]


def reshard_moves(before: list[int], after: list[int]) -> ReshardMoves:
    """The `ReshardMoves` that turn local slots holding `before` (the logical expert of each)
    into slots holding `after`, of any lengths."""
    held: dict[int, int] = {}
    for slot, expert in enumerate(before):
        held.setdefault(expert, slot)
    kept, load, copy = [], [], []
    loaded: dict[int, int] = {}
    for slot, expert in enumerate(after):
        if expert in held:
            kept.append((slot, held[expert]))
        elif expert in loaded:
            copy.append((slot, loaded[expert]))
        else:
            loaded[expert] = slot
            load.append((slot, expert))
    return ReshardMoves(tuple(kept), tuple(load), tuple(copy))


def choose_replicas(
    topk_ids: torch.Tensor, placement: ExpertPlacement, token_offset: int
) -> torch.Tensor:
    """Pick a physical slot for every (token, k) choice of a logical expert.

    topk_ids: [T, K] int64 logical ids. Returns [T, K] int64 physical slot ids.
    Replica index = (token_offset + t + k) % logcnt[e]: a pure function of the global token
    index, so every rank (and every rerun) makes the same choice, and consecutive tokens spread
    over the replicas. Ids are assumed in range (the router produced them).
    """
    device = topk_ids.device
    return choose_replicas_from_maps(
        topk_ids, placement.log2phy.to(device), placement.logcnt.to(device), token_offset
    )


def choose_replicas_from_maps(
    topk_ids: torch.Tensor,
    log2phy: torch.Tensor,
    logcnt: torch.Tensor,
    token_offset: int | torch.Tensor,
) -> torch.Tensor:
    """`choose_replicas` on maps already on topk_ids' device (no host copy per call).

    topk_ids: [T, K]; log2phy: [E, R_max]; logcnt: [E]; token_offset: an int or a 0-dim int64
    tensor on the same device. Returns [T, K] physical slot ids.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
    if log2phy.shape[1] == 1:  # no replicas: skip the modular arithmetic
        return log2phy[topk_ids, 0]
    num_tokens, top_k = topk_ids.shape
    device = topk_ids.device
    position = (
        torch.arange(num_tokens, device=device).unsqueeze(1)
        + torch.arange(top_k, device=device).unsqueeze(0)
        + token_offset
    )
    replica = position % logcnt[topk_ids]
    return log2phy[topk_ids, replica]
