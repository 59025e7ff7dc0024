"""Which DP rank serves a request: round robin, or the rank with the fewest outstanding tokens.

Outstanding tokens of a request = prompt length + max_tokens until it ends; the router is told
when a request ends so the load it counts stays the load the ranks actually carry.

Only live ranks are picked: after a group shrank onto its survivors (launcher/ray_launcher.py)
the lost ranks take nothing until it grows back (`set_live`), a request pinned to one goes to
a live rank instead, and the requests a lost rank held move to live ones (`reassign`).
"""

from __future__ import annotations

from scheduler.registry import Registry


class RoundRobin:
    """Each live rank in turn."""

    def __init__(self, num_ranks: int) -> None:
        self._next = 0

    def pick(self, load: list[int], live: list[int]) -> int:
        rank = next((r for r in live if r >= self._next), live[0])
        self._next = rank + 1
        return rank


class LeastLoaded:
    """The live rank with the fewest outstanding tokens (the lowest rank among equals)."""

    def __init__(self, num_ranks: int) -> None:
        pass

    def pick(self, load: list[int], live: list[int]) -> int:
        return min(live, key=lambda rank: (load[rank], rank))


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
        self.live = list(range(num_ranks))
        self._assigned: dict[str, tuple[int, int]] = {}

    def set_live(self, ranks: list[int]) -> None:
        """The ranks of the group now running (every rank, unless it shrank)."""
        if not ranks or not set(ranks) <= set(range(self.num_ranks)):
            raise ValueError(f"live ranks must be a non-empty subset of 0..{self.num_ranks - 1}")
        self.live = sorted(ranks)

    def assign(self, request_id: str, cost: int, dp_rank: int | None = None) -> int:
        """Pick a rank for a request (or honour ``dp_rank`` while that rank is live) and count
        its cost there."""
        if dp_rank is not None and (
            not isinstance(dp_rank, int) or not 0 <= dp_rank < self.num_ranks
        ):
            raise ValueError(f"dp_rank must be in [0, {self.num_ranks}), got {dp_rank!r}")
        rank = dp_rank if dp_rank in self.live else self._policy.pick(self.load, self.live)
        self.load[rank] += cost
        self._assigned[request_id] = (rank, cost)
        return rank

    def reassign(self, request_id: str) -> int:
        """Move an assigned request to a live rank (its own, if that is live); returns it."""
        rank, cost = self._assigned[request_id]
        if rank in self.live:
            return rank
        self.finished(request_id)
        return self.assign(request_id, cost)

    def finished(self, request_id: str) -> None:
        rank, cost = self._assigned.pop(request_id, (None, 0))
        if rank is not None:
            self.load[rank] -= cost

    def rank_of(self, request_id: str) -> int | None:
        assigned = self._assigned.get(request_id)
        return assigned[0] if assigned else None
