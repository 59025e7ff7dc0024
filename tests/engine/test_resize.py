"""A group that changes size as it re-forms (dist_engine/engine/resize.py), the pure parts:
who the members were, the placement every rank computes, and the memory check. The engine and
launcher paths run with real processes in tests/launcher/test_shrink.py."""

from __future__ import annotations

import pytest

from dist_engine.engine.config import MoEConfig
from dist_engine.engine.resize import (
    USABLE_FRACTION,
    Member,
    check_fit,
    is_resize,
    pad_placement,
    resize_bytes,
    target_placements,
)
from moe import ExpertPlacement


def _members(ranks: list[int], size: int, maps=None, kept=True) -> list[Member]:
    return [Member(dp, rank, size, kept, maps) for dp, rank in zip(ranks, ranks, strict=True)]


def test_a_group_of_the_same_shape_is_no_resize_and_a_shrink_or_grow_is() -> None:
    assert not is_resize(_members([0, 1, 2, 3], 4), 4)
    # DP ranks 0, 1, 3 survive: DP rank 3 becomes group rank 2 of 3.
    assert is_resize(_members([0, 1, 3], 4), 3)
    # Growing back: the survivors come from a group of 3, the replacement was built for 4.
    grown = [Member(0, 0, 3, True), Member(1, 1, 3, True), Member(2, 2, 4, False)]
    assert is_resize(grown, 3) and is_resize([*grown, Member(3, 3, 4, False)], 4)


def test_a_shrink_keeps_each_survivors_experts_and_spreads_the_lost_ranks_over_them() -> None:
    even = ExpertPlacement.even(8, 4)  # [0 1 | 2 3 | 4 5 | 6 7]
    maps = [even.phy2log.tolist()] * 2  # two MoE layers
    members = [Member(0, 0, 4, True, maps), Member(1, 1, 4, True, maps), Member(3, 3, 4, True)]
    targets = target_placements(members, MoEConfig(), 8, full_size=4, num_layers=2)
    assert len(targets) == 2
    # Rank 2 was lost: its experts 4 and 5 go to the first two survivors; DP rank 3 (group
    # rank 2 now) keeps 6 and 7 and pads with a replica of its own.
    assert targets[0].phy2log.tolist() == [0, 1, 4, 2, 3, 5, 6, 7, 6]
    assert targets[0].num_ranks == 3


def test_a_grow_goes_back_to_the_initial_placement_of_the_full_size() -> None:
    members = [Member(r, r, 3, r < 3) for r in range(4)]
    settings = MoEConfig(enable_eplb=True, eplb_num_redundant_experts=4)
    targets = target_placements(members, settings, 8, full_size=4, num_layers=3)
    assert [t.phy2log.tolist() for t in targets] == [
        ExpertPlacement.with_redundancy(8, 4, 4).phy2log.tolist()
    ] * 3


def test_every_layer_gets_as_many_slots_when_replicas_leave_fewer_orphans_in_some() -> None:
    # Layer 0 has no replica of rank 2's experts elsewhere; layer 1 has both (4 on rank 0,
    # 5 on rank 1), so losing rank 2 orphans none of its experts.
    layer0 = [0, 1, 0, 2, 3, 2, 4, 5, 4, 6, 7, 6]
    layer1 = [0, 1, 4, 2, 3, 5, 4, 5, 4, 6, 7, 6]
    maps = [layer0, layer1]
    members = [Member(r, r, 4, True, maps if r == 0 else None) for r in (0, 1, 3)]
    layers = target_placements(members, MoEConfig(), 8, full_size=4, num_layers=2)
    assert {t.slots_per_rank for t in layers} == {4}
    for placement in layers:  # every expert hosted somewhere
        assert set(placement.phy2log.tolist()) == set(range(8))
    # Layer 0 needs a fourth slot for its orphans; layer 1 is padded to match with copies.
    assert layers[0].local_phy2log(0) == [0, 1, 0, 4]
    assert layers[1].local_phy2log(0) == [0, 1, 4, 0]


def test_pad_placement_adds_replicas_of_each_ranks_own_experts() -> None:
    padded = pad_placement(ExpertPlacement.even(6, 2), 5)
    assert padded.phy2log.tolist() == [0, 1, 2, 0, 1, 3, 4, 5, 3, 4]
    assert padded.logcnt.tolist() == [2, 2, 1, 2, 2, 1]


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([Member(0, 0, 4, True, [[0, 1, 2, 3]]), Member(2, 2, 3, True)], "one group"),
        ([Member(1, 1, 4, True, [[0, 1, 2, 3]]), Member(0, 0, 4, True)], "old order"),
        ([Member(0, 0, 4, True, [[0, 1, 2, 3]]), Member(3, 3, 4, False)], "replacements"),
    ],
)
def test_a_shrink_of_another_shape_is_refused_naming_it(members, message) -> None:
    with pytest.raises(ValueError, match=message):
        target_placements(members, MoEConfig(), 4, full_size=4, num_layers=1)


def test_a_group_beyond_the_full_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"exceeds parallel\.dp_size=2"):
        target_placements(_members([0, 1, 2], 3), MoEConfig(), 6, full_size=2, num_layers=1)


def test_resize_bytes_counts_every_layers_growth_and_the_last_moves_peak() -> None:
    # 4 -> 6 slots of 10 bytes over 3 layers: 3 x 2 x 10 grown, plus a layer's old 4 x 10
    # alive beside its new tensor while it moves.
    assert resize_bytes(4, 6, 10, 3) == 60 + 40
    assert resize_bytes(6, 4, 10, 3) == 40  # growing back frees memory; the peak remains


def test_check_fit_names_every_rank_that_cannot_fit() -> None:
    check_fit([100, 200], [1000, 1000], [0, 3])
    free = 1000
    with pytest.raises(ValueError) as error:
        check_fit([100, int(USABLE_FRACTION * free) + 1], [free, free], [0, 3])
    assert "DP rank 3 needs" in str(error.value) and "DP rank 0" not in str(error.value)
