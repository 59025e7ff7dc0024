"""The router (launcher/routing.py): each policy picks among the live ranks only, a pin to a
rank the group shrank away from goes to a live one, and a lost rank's requests move."""

from __future__ import annotations

import pytest

from launcher.routing import Router


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_only_live_ranks_are_picked_and_a_pin_to_a_lost_rank_goes_to_a_live_one(policy):
    router = Router(4, policy)
    router.set_live([0, 1, 3])
    picked = [router.assign(f"r{i}", cost=10) for i in range(6)]
    assert set(picked) == {0, 1, 3}
    assert router.assign("pinned-live", 10, dp_rank=3) == 3
    assert router.assign("pinned-lost", 10, dp_rank=2) in {0, 1, 3}
    assert router.load[2] == 0


def test_round_robin_takes_the_live_ranks_in_turn():
    router = Router(4, "round_robin")
    assert [router.assign(f"a{i}", 1) for i in range(3)] == [0, 1, 2]
    router.set_live([0, 1, 3])
    assert [router.assign(f"b{i}", 1) for i in range(4)] == [3, 0, 1, 3]


def test_a_lost_ranks_requests_move_to_the_least_loaded_live_rank_with_their_cost():
    router = Router(3, "least_loaded")
    for name, rank, cost in [("a", 0, 50), ("b", 1, 10), ("c", 2, 30)]:
        router.assign(name, cost, dp_rank=rank)
    router.set_live([0, 1])
    assert router.reassign("a") == 0  # its rank is live: it stays
    assert router.reassign("c") == 1 and router.rank_of("c") == 1
    assert router.load == [50, 40, 0]
    router.finished("c")
    assert router.load == [50, 10, 0]


def test_live_ranks_must_be_some_of_the_groups():
    router = Router(2)
    for bad in ([], [0, 2]):
        with pytest.raises(ValueError, match="live ranks"):
            router.set_live(bad)
