"""Which DP rank serves a request: round robin, or the rank with the fewest outstanding tokens.

Outstanding tokens of a request = prompt length + max_tokens until it ends; the router is told
when a request ends so the load it counts stays the load the ranks actually carry.
"""

from __future__ import annotations

import itertools

from scheduler.registry import Registry


class RoundRobin:
    """Each rank in turn."""

    def __init__(self, num_ranks: int) -> None:
        self._cycle = itertools.cycle(range(num_ranks))

    def pick(self, load: list[int]) -> int:
        return next(self._cycle)


class LeastLoaded:
    """The rank with the fewest outstanding tokens (the lowest rank among equals)."""

    def __init__(self, num_ranks: int) -> None:
        pass

    def pick(self, load: list[int]) -> int:
        return min(range(len(load)), key=lambda rank: (load[rank], rank))


ROUTING_POLICIES: Registry[type] = Registry(
    "routing", {"round_robin": RoundRobin, "least_loaded": LeastLoaded}
)


class Router:
    def __init__(self, num_ranks: int, policy: str = "round_robin") -> None:
        ROUTING_POLICIES.check("routing", policy)
        self.num_ranks = num_ranks
        self.policy = policy
        self._policy = ROUTING_POLICIES.get(policy)(num_ranks)
        self.load = [0] * num_ranks
        self._assigned: dict[str, tuple[int, int]] = {}

    def assign(self, request_id: str, cost: int, dp_rank: int | None = None) -> int:
        """Pick a rank for a request (or honour ``dp_rank``) and count its cost there."""
        if dp_rank is not None:
            if not isinstance(dp_rank, int) or not 0 <= dp_rank < self.num_ranks:
                raise ValueError(f"dp_rank must be in [0, {self.num_ranks}), got {dp_rank!r}")
            rank = dp_rank
        else:
            rank = self._policy.pick(self.load)
        self.load[rank] += cost
        self._assigned[request_id] = (rank, cost)
        return rank

    def finished(self, request_id: str) -> None:
        rank, cost = self._assigned.pop(request_id, (None, 0))
        if rank is not None:
            self.load[rank] -= cost

    def rank_of(self, request_id: str) -> int | None:
        assigned = self._assigned.get(request_id)
        return assigned[0] if assigned else None
