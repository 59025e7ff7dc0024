"""Expert placement: which physical expert slot on which rank holds which logical expert.

Shape legend: T = tokens, E = logical experts, P = physical slots, K = top-k,
R_max = most replicas of any one logical expert.

Physical slots are numbered rank-major: rank r hosts slots [r * S, (r + 1) * S) with
S = P // num_ranks, so the rank of slot p is p // S and its local index is p % S. The maps are
named as in DeepSeek's EPLB (`phy2log`, `log2phy`, `logcnt`) so a balancer's output plugs in as is.
"""

from __future__ import annotations

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
    topk_ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, token_offset: int
) -> torch.Tensor:
    """`choose_replicas` on maps already on topk_ids' device (no host copy per call).

    topk_ids: [T, K]; log2phy: [E, R_max]; logcnt: [E]. Returns [T, K] physical slot ids.
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
