"""ExpertPlacement maps and validation; deterministic, spread-out replica choice; moving from
one placement to another (EPLB) with the fewest slot writes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe import (
    ExpertPlacement,
    choose_replicas,
    keep_hosted_slots,
    plan_transfers,
    slot_moves,
)


def test_even_placement_is_contiguous_blocks() -> None:
    placement = ExpertPlacement.even(8, 4)
    assert placement.slots_per_rank == 2
    assert placement.phy2log.tolist() == list(range(8))
    assert placement.log2phy.tolist() == [[e] for e in range(8)]
    assert placement.logcnt.tolist() == [1] * 8
    assert placement.hosted_slots(2) == [4, 5]
    assert placement.hosted_logical(3) == [6, 7]


def test_from_phy2log_with_replicas() -> None:
    # 2 ranks x 3 slots; expert 0 has three replicas, expert 2 two.
    placement = ExpertPlacement.from_phy2log([0, 1, 0, 2, 0, 2], num_experts=3, num_ranks=2)
    assert placement.logcnt.tolist() == [3, 1, 2]
    assert placement.log2phy.tolist() == [[0, 2, 4], [1, -1, -1], [3, 5, -1]]
    assert placement.hosted_slots(1) == [3, 4, 5]
    assert placement.hosted_logical(0) == [0, 1]
    assert placement.hosted_logical(1) == [0, 2]


def test_placement_validation_names_values() -> None:
    with pytest.raises(ValueError, match=r"num_experts=6 .* num_ranks=4"):
        ExpertPlacement.even(6, 4)
    with pytest.raises(ValueError, match=r"logical experts \[1, 3\] have no physical slot"):
        ExpertPlacement.from_phy2log([0, 2, 0, 2], num_experts=4, num_ranks=2)
    with pytest.raises(ValueError, match=r"outside \[0, num_experts=3\): \[3, -1\]"):
        ExpertPlacement.from_phy2log([0, 1, 2, 3, -1, 0], num_experts=3, num_ranks=2)
    with pytest.raises(ValueError, match=r"num_ranks=4 must be >= 1 and divide .* P=6"):
        ExpertPlacement.from_phy2log([0, 1, 2, 0, 1, 2], num_experts=3, num_ranks=4)
    with pytest.raises(ValueError, match=r"non-empty 1-D"):
        ExpertPlacement.from_phy2log([], num_experts=3, num_ranks=1)
    with pytest.raises(ValueError, match=r"rank=2 outside \[0, num_ranks=2\)"):
        ExpertPlacement.even(4, 2).hosted_slots(2)


def test_choose_replicas_without_replicas_is_identity_map() -> None:
    placement = ExpertPlacement.from_phy2log([3, 1, 0, 2], num_experts=4, num_ranks=2)
    ids = torch.tensor([[0, 3], [2, 1]])
    assert choose_replicas(ids, placement, token_offset=17).tolist() == [[2, 0], [3, 1]]


def test_choose_replicas_spreads_evenly_over_replicas() -> None:
    placement = ExpertPlacement.from_phy2log([0, 1, 0, 2, 0, 2], num_experts=3, num_ranks=2)
    ids = torch.zeros(300, 1, dtype=torch.int64)  # every token wants expert 0 (3 replicas)
    physical = choose_replicas(ids, placement, token_offset=5)
    assert torch.bincount(physical.flatten(), minlength=6).tolist() == [100, 0, 100, 0, 100, 0]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    num_tokens=st.integers(0, 20),
    top_k=st.integers(1, 4),
    token_offset=st.integers(0, 10_000),
)
def test_choose_replicas_is_a_function_of_global_token_index(
    seed: int, num_tokens: int, top_k: int, token_offset: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_experts, num_ranks = 6, 3
    extra = torch.randint(num_experts, (9 - num_experts,), generator=gen)
    phy2log = torch.cat([torch.arange(num_experts), extra])[torch.randperm(9, generator=gen)]
    placement = ExpertPlacement.from_phy2log(phy2log, num_experts, num_ranks)
    ids = torch.rand(num_tokens + 1, num_experts, generator=gen).argsort(dim=1)[:, :top_k]

    physical = choose_replicas(ids, placement, token_offset)
    # Always a replica of the requested logical expert.
    assert torch.equal(placement.phy2log[physical], ids)
    # Reproducible, and the same choice for a token whichever batch split carries it.
    assert torch.equal(physical, choose_replicas(ids, placement, token_offset))
    shifted = choose_replicas(ids[1:], placement, token_offset + 1)
    assert torch.equal(shifted, physical[1:])


def test_choose_replicas_rejects_1d_ids() -> None:
    with pytest.raises(ValueError, match=r"topk_ids must be \[T, K\], got shape \(3,\)"):
        choose_replicas(torch.tensor([0, 1, 2]), ExpertPlacement.even(4, 1), 0)


def test_redundant_slots_start_as_replicas_of_the_first_experts() -> None:
    placement = ExpertPlacement.with_redundancy(8, num_ranks=4, num_redundant=4)
    assert placement.phy2log.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert placement.slots_per_rank == 3 and placement.logcnt.tolist() == [2] * 4 + [1] * 4
    assert ExpertPlacement.with_redundancy(8, 2, 0).phy2log.tolist() == list(range(8))
    with pytest.raises(ValueError, match=r"num_experts=8 plus num_redundant=1 .* num_ranks=2"):
        ExpertPlacement.with_redundancy(8, 2, 1)


def test_decode_sized_batches_spread_over_replicas_with_per_rank_offsets() -> None:
    """One token per rank per step for the same expert: offsets that start at the rank and
    advance with the tokens (MoELayer's default) use every replica alike; a fixed offset
    sends every rank's token to the first replica (the issue EPLB's engine side fixed)."""
    placement = ExpertPlacement.from_phy2log([0, 1, 0, 2, 0, 2], num_experts=3, num_ranks=2)
    ids = torch.zeros(1, 1, dtype=torch.int64)
    num_ranks, num_steps = 2, 6
    spread = Counter(
        int(choose_replicas(ids, placement, rank + step)) for rank in range(2) for step in range(6)
    )
    assert spread == {0: 4, 2: 4, 4: 4}, spread
    fixed = Counter(int(choose_replicas(ids, placement, 0)) for _ in range(num_ranks * num_steps))
    assert fixed == {0: num_ranks * num_steps}


def _random_placement(gen: torch.Generator, num_experts: int, num_slots: int, num_ranks: int):
    extra = torch.randint(num_experts, (num_slots - num_experts,), generator=gen)
    phy2log = torch.cat([torch.arange(num_experts), extra])
    return ExpertPlacement.from_phy2log(
        phy2log[torch.randperm(num_slots, generator=gen)], num_experts, num_ranks
    )


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), num_ranks=st.sampled_from([1, 2, 3, 4]), spare=st.integers(0, 3))
def test_keeping_hosted_slots_changes_only_the_order_within_a_rank(
    seed: int, num_ranks: int, spare: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_experts = 6
    num_slots = num_ranks * (-(-num_experts // num_ranks) + spare)
    current = _random_placement(gen, num_experts, num_slots, num_ranks)
    proposed = _random_placement(gen, num_experts, num_slots, num_ranks)
    aligned = keep_hosted_slots(current, proposed)
    assert torch.equal(aligned.phy2log, keep_hosted_slots(current, proposed).phy2log)
    for rank in range(num_ranks):
        before, wanted = current.local_phy2log(rank), proposed.local_phy2log(rank)
        after = aligned.local_phy2log(rank)
        assert Counter(after) == Counter(wanted)  # what the rank holds: the proposal's
        # As many slots as possible keep their expert: every expert the rank keeps, as often.
        kept = sum((Counter(before) & Counter(wanted)).values())
        assert sum(b == a for b, a in zip(before, after, strict=True)) == kept
        # Replaying the moves on the old slots gives the new ones; new experts are read once.
        moves = slot_moves(current, aligned, rank)
        slots = list(before)
        for slot, expert in moves.load:
            assert expert not in before
            slots[slot] = expert
        for slot, source in moves.copy:
            slots[slot] = slots[source]
        assert slots == after
        loaded = [expert for _, expert in moves.load]
        assert len(loaded) == len(set(loaded))
        assert moves.num_slots == sum(b != a for b, a in zip(before, after, strict=True))


def test_moves_between_placements_hand_worked() -> None:
    # Rank 0 holds [0, 1, 2] and is to hold {2, 3, 3}; rank 1 holds [3, 0, 1] → {0, 1, 1}.
    current = ExpertPlacement.from_phy2log([0, 1, 2, 3, 0, 1], num_experts=4, num_ranks=2)
    proposed = ExpertPlacement.from_phy2log([3, 2, 3, 1, 0, 1], num_experts=4, num_ranks=2)
    aligned = keep_hosted_slots(current, proposed)
    assert aligned.phy2log.tolist() == [3, 3, 2, 1, 0, 1]
    assert slot_moves(current, aligned, 0).load == ((0, 3),)
    assert slot_moves(current, aligned, 0).copy == ((1, 0),)  # the second 3 from the first
    assert slot_moves(current, aligned, 1).load == ()
    assert slot_moves(current, aligned, 1).copy == ((0, 2),)  # 1 again, from its kept slot
    with pytest.raises(ValueError, match=r"placements differ in shape"):
        keep_hosted_slots(current, ExpertPlacement.even(4, 2))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    num_ranks=st.sampled_from([1, 2, 3, 4]),
    spare=st.integers(0, 3),
    aligned=st.booleans(),
)
def test_transfer_plan_takes_every_load_from_a_rank_that_holds_it(
    seed: int, num_ranks: int, spare: int, aligned: bool
) -> None:
    generator = torch.Generator().manual_seed(seed)
    num_experts = 2 * num_ranks
    num_physical = num_experts + spare * num_ranks

    def random_placement() -> ExpertPlacement:
        extra = torch.randint(0, num_experts, (num_physical - num_experts,), generator=generator)
        order = torch.randperm(num_physical, generator=generator)
        phy2log = torch.cat([torch.arange(num_experts), extra])[order]
        return ExpertPlacement.from_phy2log(phy2log.tolist(), num_experts, num_ranks)

    current, new = random_placement(), random_placement()
    if aligned:
        new = keep_hosted_slots(current, new)
    plan = plan_transfers(current, new)
    assert plan == plan_transfers(current, new)  # every rank computes the same plan
    for dst in range(num_ranks):
        mine = [t for t in plan if t.dst == dst]
        loads = slot_moves(current, new, dst).load
        assert [(t.row, t.expert) for t in mine] == [(row, e) for row, (_, e) in enumerate(loads)]
        for transfer in mine:
            # The source holds the expert in that slot under the current placement; a rank
            # that holds it itself copies it, and only then.
            assert current.local_phy2log(transfer.src)[transfer.src_slot] == transfer.expert
            assert (transfer.src == dst) == (transfer.expert in current.local_phy2log(dst))
    if aligned:  # kept experts keep their slots: nothing a rank holds is loaded
        assert all(t.src != t.dst for t in plan)


def test_transfer_plan_spreads_a_hot_expert_over_its_replicas() -> None:
    # Expert 0 is on ranks 0 and 1; ranks 2 and 3 each take a replica of it, rank 3 also
    # expert 4, which only rank 2 holds.
    current = ExpertPlacement.from_phy2log([0, 1, 0, 2, 3, 4, 1, 2], num_experts=5, num_ranks=4)
    new = ExpertPlacement.from_phy2log([0, 1, 0, 2, 3, 0, 4, 0], num_experts=5, num_ranks=4)
    plan = plan_transfers(current, new)
    assert [(t.dst, t.row, t.expert, t.src, t.src_slot) for t in plan] == [
        (2, 0, 0, 0, 0),  # rank 2's new 0 from rank 0 ...
        (3, 0, 4, 2, 1),
        (3, 1, 0, 1, 0),  # ... rank 3's from rank 1, which had sent none
    ]
    with pytest.raises(ValueError, match=r"placements differ in shape"):
        plan_transfers(current, ExpertPlacement.even(4, 2))
