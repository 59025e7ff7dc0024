"""EPLB (moe/eplb.py): the greedy stages against brute force where they are provably optimal,
hand-worked placements for both policies, map invariants and determinism as properties, the
quality on Zipf-like loads against the best any placement with the given slots can do, the
adoption rule and the load window."""

from __future__ import annotations

import itertools
from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe import (
    ExpertLoadWindow,
    ExpertPlacement,
    balancedness,
    choose_replicas,
    rank_loads,
    rebalance,
    rebalance_gain,
    worth_adopting,
)
from moe.eplb import GLOBAL, HIERARCHICAL, balanced_packing, replicate_experts


def zipf_load(num_layers: int, num_experts: int, exponent: float, seed: int) -> torch.Tensor:
    """[L, E] integer token counts: expert of popularity rank r gets ~ 1 / r**exponent, the
    ranks shuffled independently per layer."""
    gen = torch.Generator().manual_seed(seed)
    weight = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** exponent
    tokens = (100_000 * weight / weight.sum()).round()
    return torch.stack(
        [tokens[torch.randperm(num_experts, generator=gen)] for _ in range(num_layers)]
    )


# --- the two greedy stages against brute force --------------------------------------------


def brute_force_min_max_per_replica(weight: list[int], num_slots: int) -> float:
    """min over replica counts (each >= 1, summing to num_slots) of max weight / count."""
    best = float("inf")
    for counts in itertools.product(range(1, num_slots + 1), repeat=len(weight)):
        if sum(counts) == num_slots:
            best = min(best, max(w / c for w, c in zip(weight, counts, strict=True)))
    return best


@settings(max_examples=60, deadline=None)
@given(
    weight=st.lists(st.integers(0, 100), min_size=1, max_size=4),
    num_redundant=st.integers(0, 4),
)
def test_replication_minimises_the_largest_replica_load(weight: list[int], num_redundant: int):
    num_slots = len(weight) + num_redundant
    phy2log, logcnt = replicate_experts(torch.tensor([weight], dtype=torch.float64), num_slots)
    assert phy2log[0, : len(weight)].tolist() == list(range(len(weight)))
    assert torch.equal(torch.bincount(phy2log[0], minlength=len(weight)), logcnt[0])
    got = max(w / c for w, c in zip(weight, logcnt[0].tolist(), strict=True))
    assert got == brute_force_min_max_per_replica(weight, num_slots)


def brute_force_min_max_pack(weight: list[int], num_packs: int) -> int:
    capacity = len(weight) // num_packs
    labels = [pack for pack in range(num_packs) for _ in range(capacity)]
    best = None
    for assignment in set(itertools.permutations(labels)):
        loads = [0] * num_packs
        for item, pack in enumerate(assignment):
            loads[pack] += weight[item]
        best = max(loads) if best is None else min(best, max(loads))
    return best


@settings(max_examples=60, deadline=None)
@given(data=st.data(), num_packs=st.integers(1, 4), capacity=st.integers(1, 2))
def test_packing_is_optimal_with_one_or_two_items_per_pack(data, num_packs: int, capacity: int):
    num_items = num_packs * capacity
    weight = data.draw(st.lists(st.integers(0, 50), min_size=num_items, max_size=num_items))
    pack, position = balanced_packing(torch.tensor([weight], dtype=torch.float64), num_packs)
    # Every (pack, position) seat taken exactly once.
    seats = sorted(zip(pack[0].tolist(), position[0].tolist(), strict=True))
    assert seats == [(p, i) for p in range(num_packs) for i in range(capacity)]
    loads = [0] * num_packs
    for item, chosen in enumerate(pack[0].tolist()):
        loads[chosen] += weight[item]
    assert max(loads) == brute_force_min_max_pack(weight, num_packs)


def test_packing_deals_heaviest_first_to_the_lightest_pack_with_room() -> None:
    # Worked by hand: 9 7 6 5 4 3 into 2 packs of 3. 9→A, 7→B, 6→B (13), 5→A (14),
    # 4→B (17, now full), 3→A (17): both packs 17, the optimum.
    pack, position = balanced_packing(torch.tensor([[5.0, 9.0, 3.0, 7.0, 6.0, 4.0]]), 2)
    assert pack.tolist() == [[0, 0, 0, 1, 1, 1]]
    assert position.tolist() == [[1, 0, 2, 0, 1, 2]]


# --- hand-worked placements ---------------------------------------------------------------


def test_global_policy_hand_worked() -> None:
    # E=4, P=6, N=2. Replication: 90 → 2 replicas (45 each), then 45 is still the largest →
    # 3 replicas (30 each). Slots [0 1 2 3 0 0] carry [30 30 20 10 30 30]; heaviest first to
    # the lightest rank with room: s0→r0, s1→r1, s4→r0, s5→r1, s2→r0 (80), s3→r1 (70).
    # (The optimum is 75: two replicas of expert 0 and a spare replica elsewhere: a greedy.)
    result = rebalance(torch.tensor([[90, 30, 20, 10]]), 6, num_groups=1, num_nodes=1, num_ranks=2)
    assert result.policy == GLOBAL
    assert result.phy2log.tolist() == [[0, 0, 2, 1, 0, 3]]
    assert result.logcnt.tolist() == [[3, 1, 1, 1]]
    assert result.log2phy.tolist() == [[[0, 1, 4], [3, -1, -1], [2, -1, -1], [5, -1, -1]]]
    placement = result.placement(0)
    assert rank_loads(torch.tensor([90, 30, 20, 10]), placement).tolist() == [80.0, 70.0]
    assert balancedness(torch.tensor([90, 30, 20, 10]), placement) == 75 / 80


def test_hierarchical_policy_hand_worked() -> None:
    # E=8 in G=4 groups of 2, 2 nodes of 2 ranks, P=12 (3 slots per rank).
    # Group loads 60 10 40 10 → nodes: g0→n0, g2→n1, g1→n1 (50, full), g3→n0 (70).
    # Node 0 holds experts 0 1 6 7 (40 20 6 4) in 6 slots: +1 replica of 0 (40 → 20 each),
    # then 20 ties 20: expert 1 has fewer replicas, so it gets the second (10 each).
    # Slot loads 20 10 6 4 20 10 → r0 = {0, 1, 6} (36), r1 = {0, 1, 7} (34).
    # Node 1 holds 4 5 2 3 (30 10 5 5): expert 4 gets both extra slots (15, then 10 each) →
    # r2 = {4, 4, 2} (25), r3 = {5, 4, 3} (25).
    load = torch.tensor([[40, 20, 5, 5, 30, 10, 6, 4]])
    result = rebalance(load, 12, num_groups=4, num_nodes=2, num_ranks=4)
    assert result.policy == HIERARCHICAL
    assert result.phy2log.tolist() == [[0, 1, 6, 0, 1, 7, 4, 4, 2, 5, 4, 3]]
    assert result.logcnt.tolist() == [[2, 2, 1, 1, 3, 1, 1, 1]]
    assert rank_loads(load[0], result.placement(0)).tolist() == [36.0, 34.0, 25.0, 25.0]
    # The same load under the global policy (one node): no node boundary to respect.
    flat = rebalance(load, 12, num_groups=4, num_nodes=1, num_ranks=4)
    assert flat.policy == GLOBAL
    assert balancedness(load[0], flat.placement(0)) > balancedness(load[0], result.placement(0))


def test_no_redundancy_one_slot_per_rank_is_the_even_placement() -> None:
    result = rebalance(zipf_load(2, 8, 1.0, seed=0), 8, num_groups=1, num_nodes=1, num_ranks=8)
    for layer in range(2):
        assert torch.equal(result.placement(layer).phy2log, ExpertPlacement.even(8, 8).phy2log)


def test_layer_without_tokens_spreads_redundant_slots() -> None:
    result = rebalance(torch.zeros(1, 4), 8, num_groups=1, num_nodes=1, num_ranks=2)
    assert result.logcnt.tolist() == [[2, 2, 2, 2]]
    assert balancedness(torch.zeros(4), result.placement(0)) == 1.0


# --- invariants and determinism ----------------------------------------------------------


@st.composite
def rebalance_inputs(draw):
    num_nodes = draw(st.sampled_from([1, 2, 4]))
    num_ranks = num_nodes * draw(st.integers(1, 3))
    num_groups = draw(st.sampled_from([1, 2, 4, 8]))
    group_size = draw(st.integers(1, 4))
    num_experts = num_groups * group_size
    fewest_slots = -(-num_experts // num_ranks)  # each expert needs one slot
    slots_per_rank = draw(st.integers(fewest_slots, fewest_slots + 3))
    num_layers = draw(st.integers(1, 3))
    skew = draw(st.sampled_from(["uniform", "zipf", "sparse"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    load = torch.randint(0, 1000, (num_layers, num_experts), generator=gen)
    if skew == "zipf":
        load = zipf_load(num_layers, num_experts, 1.2, draw(st.integers(0, 99))).long()
    elif skew == "sparse":  # most experts cold, ties everywhere
        load = load * (torch.rand(num_layers, num_experts, generator=gen) < 0.2)
    return load, num_ranks * slots_per_rank, num_groups, num_nodes, num_ranks


@settings(max_examples=50, deadline=None)
@given(inputs=rebalance_inputs())
def test_rebalance_maps_are_consistent_and_deterministic(inputs) -> None:
    load, num_physical, num_groups, num_nodes, num_ranks = inputs
    result = rebalance(load, num_physical, num_groups, num_nodes, num_ranks)
    num_layers, num_experts = load.shape
    assert result.phy2log.shape == (num_layers, num_physical)
    for layer in range(num_layers):
        phy2log = result.phy2log[layer]
        logcnt = torch.bincount(phy2log, minlength=num_experts)
        assert logcnt.min() >= 1 and logcnt.numel() == num_experts
        assert torch.equal(result.logcnt[layer], logcnt)
        for expert in range(num_experts):
            slots = result.log2phy[layer, expert]
            count = int(logcnt[expert])
            assert slots[:count].tolist() == (phy2log == expert).nonzero().flatten().tolist()
            assert (slots[count:] == -1).all()
        placement = result.placement(layer)  # every rank gets P / N slots, maps agree
        assert placement.slots_per_rank * num_ranks == num_physical
        width = placement.log2phy.shape[1]
        assert torch.equal(placement.log2phy, result.log2phy[layer, :, :width])
        per_rank = rank_loads(load[layer], placement)
        assert per_rank.sum().item() == pytest.approx(float(load[layer].sum()), rel=1e-12)
        if result.policy == HIERARCHICAL:  # a group and all its replicas on one node
            node_of_slot = torch.arange(num_physical) // (num_physical // num_nodes)
            group_of_slot = phy2log // (num_experts // num_groups)
            for group in range(num_groups):
                assert node_of_slot[group_of_slot == group].unique().numel() == 1
    hierarchical = num_nodes > 1 and num_groups % num_nodes == 0
    assert result.policy == (HIERARCHICAL if hierarchical else GLOBAL)
    again = rebalance(load.double(), num_physical, num_groups, num_nodes, num_ranks)
    assert torch.equal(again.phy2log, result.phy2log)


def test_rebalance_does_not_depend_on_thread_count() -> None:
    load = zipf_load(4, 64, 1.1, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = [rebalance(load, 80, 8, nodes, 16).phy2log for nodes in (1, 4)]
        torch.set_num_threads(max(2, threads))
        multi = [rebalance(load, 80, 8, nodes, 16).phy2log for nodes in (1, 4)]
    finally:
        torch.set_num_threads(threads)
    for one, many in zip(single, multi, strict=True):
        assert torch.equal(one, many)


def test_rebalance_rejects_bad_arguments_naming_them() -> None:
    load = torch.ones(2, 8)
    with pytest.raises(ValueError, match=r"load must be \[L, E\] with E >= 1, got shape \(8,\)"):
        rebalance(load[0], 8, 1, 1, 2)
    with pytest.raises(ValueError, match=r"num_physical=6 must be >= num_experts=8"):
        rebalance(load, 6, 1, 1, 2)
    with pytest.raises(ValueError, match=r"num_physical=10 .* multiple of num_ranks=4"):
        rebalance(load, 10, 1, 1, 4)
    with pytest.raises(ValueError, match=r"num_nodes=3 must be >= 1 and divide num_ranks=4"):
        rebalance(load, 8, 1, 3, 4)
    with pytest.raises(ValueError, match=r"num_groups=3 must be >= 1 and divide num_experts=8"):
        rebalance(load, 8, 3, 1, 4)
    bad = load.clone()
    bad[1, 5] = -2
    with pytest.raises(ValueError, match=r"finite and >= 0; load\[1, 5\]=-2.0"):
        rebalance(bad, 8, 1, 1, 4)
    bad[1, 5] = float("nan")
    with pytest.raises(ValueError, match=r"load\[1, 5\]=nan"):
        rebalance(bad, 8, 1, 1, 4)
    with pytest.raises(ValueError, match=r"layer=2 outside \[0, num_layers=2\)"):
        rebalance(load, 8, 1, 1, 4).placement(2)


# --- quality on skewed loads ------------------------------------------------------------


def best_possible_max(load: torch.Tensor, num_slots: int, num_ranks: int) -> float:
    """A lower bound on any placement's busiest rank: no rank is below the mean, and one rank
    holds the most loaded replica, which is at least the optimum of replication alone."""
    _, logcnt = replicate_experts(load.unsqueeze(0), num_slots)
    return max(float(load.sum()) / num_ranks, float((load / logcnt[0]).max()))


@pytest.mark.parametrize("exponent", [0.5, 1.0, 1.5])
@pytest.mark.parametrize(("num_ranks", "num_redundant"), [(8, 8), (8, 64), (16, 16), (16, 32)])
def test_global_policy_is_close_to_the_best_possible(
    exponent: float, num_ranks: int, num_redundant: int
) -> None:
    num_experts = 64
    load = zipf_load(3, num_experts, exponent, seed=num_ranks + num_redundant)
    result = rebalance(load, num_experts + num_redundant, 1, 1, num_ranks)
    for layer in range(3):
        before = balancedness(load[layer], ExpertPlacement.even(num_experts, num_ranks))
        after = balancedness(load[layer], result.placement(layer))
        mean = float(load[layer].sum()) / num_ranks
        best = mean / best_possible_max(load[layer], num_experts + num_redundant, num_ranks)
        assert after >= before
        assert after >= 0.85 * best, (layer, before, after, best)


@pytest.mark.parametrize("exponent", [0.5, 1.0, 1.5])
@pytest.mark.parametrize(("num_nodes", "num_groups"), [(2, 8), (4, 8), (4, 16)])
def test_hierarchical_policy_balances_within_each_node(
    exponent: float, num_nodes: int, num_groups: int
) -> None:
    """Groups fix each node's tokens, so the bound is per node: its mean over its ranks, or
    its most loaded replica. Replicas outnumbering a node's ranks may share a rank (the
    greedy replicates before it packs), hence a looser margin than the global policy's."""
    num_experts, num_ranks, num_physical = 64, 16, 96
    load = zipf_load(3, num_experts, exponent, seed=num_nodes * num_groups)
    result = rebalance(load, num_physical, num_groups, num_nodes, num_ranks)
    assert result.policy == HIERARCHICAL
    slots_per_node, ranks_per_node = num_physical // num_nodes, num_ranks // num_nodes
    for layer in range(3):
        placement = result.placement(layer)
        before = balancedness(load[layer], ExpertPlacement.even(num_experts, num_ranks))
        assert balancedness(load[layer], placement) >= before
        per_rank = rank_loads(load[layer], placement)
        for node in range(num_nodes):
            slots = placement.phy2log[node * slots_per_node : (node + 1) * slots_per_node]
            node_load = load[layer, slots.unique()]
            best = best_possible_max(node_load, slots_per_node, ranks_per_node)
            busiest = float(per_rank[node * ranks_per_node : (node + 1) * ranks_per_node].max())
            assert busiest <= best / 0.75, (layer, node, busiest, best)


def test_rank_loads_match_what_dispatch_sends() -> None:
    """The even split over replicas is what choose_replicas' round robin delivers, up to
    sampling noise: which tokens pick an expert is random, so each replica's share is off by
    about the square root of its count (~1% of a rank's 10k pairs here)."""
    gen = torch.Generator().manual_seed(7)
    num_experts, num_ranks = 16, 4
    popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(torch.rand(20_000, num_experts, generator=gen)))
    ids = (popularity.log() + gumbel).topk(2, dim=1).indices  # 2 distinct, by popularity
    load = torch.bincount(ids.flatten(), minlength=num_experts)
    placement = rebalance(load[None], 24, 1, 1, num_ranks).placement(0)
    assert placement.logcnt.max() > 1
    physical = choose_replicas(ids, placement, token_offset=0)
    sent = torch.bincount(physical.flatten() // placement.slots_per_rank, minlength=num_ranks)
    torch.testing.assert_close(sent.double(), rank_loads(load, placement), rtol=0.03, atol=0)


# --- adoption rule --------------------------------------------------------------------


def test_worth_adopting_needs_a_real_gain() -> None:
    even = ExpertPlacement.even(4, 2)
    load = torch.tensor([[90, 30, 20, 10]])
    proposed = rebalance(load, 6, 1, 1, 2).placement(0)  # ranks 80 / 70 vs even's 120 / 30
    assert rebalance_gain(load, [even], [proposed]) == pytest.approx(1 - 80 / 120)
    assert worth_adopting(load, [even], [proposed])
    assert not worth_adopting(load, [even], [proposed], min_gain=0.5)
    assert not worth_adopting(load, [proposed], [even], min_gain=0.0)  # worse: never
    assert not worth_adopting(load, [proposed], [proposed], min_gain=0.0)  # no change
    assert not worth_adopting(torch.zeros(1, 4), [even], [proposed], min_gain=0.0)  # no tokens
    # Two layers: the summed busiest ranks decide (120 + 60 now, 80 + 60 after).
    two = torch.tensor([[90, 30, 20, 10], [30, 30, 30, 30]])
    assert rebalance_gain(two, [even, even], [proposed, even]) == pytest.approx(1 - 140 / 180)
    with pytest.raises(ValueError, match=r"min_gain=1.0 must be in \[0, 1\)"):
        worth_adopting(load, [even], [proposed], min_gain=1.0)
    with pytest.raises(ValueError, match=r"\[L=2, E\]; got 1 current, 1 proposed"):
        rebalance_gain(two, [even], [proposed])
    with pytest.raises(ValueError, match=r"load must be \[E=4\], got shape \(3,\)"):
        rank_loads(torch.ones(3), even)


# --- load window -----------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(window_steps=st.integers(1, 5), num_steps=st.integers(0, 12), seed=st.integers(0, 999))
def test_window_sums_the_last_w_steps(window_steps: int, num_steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    window = ExpertLoadWindow(num_layers=3, num_experts=5, window_steps=window_steps)
    recent: deque[torch.Tensor] = deque(maxlen=window_steps)
    for _ in range(num_steps):
        step = torch.randint(0, 100, (3, 5), generator=gen)
        window.record(step)
        recent.append(step)
    expected = sum(recent, torch.zeros(3, 5, dtype=torch.int64))
    assert torch.equal(window.window_sum(), expected)
    assert window.num_steps == len(recent)
    window.clear()
    assert window.num_steps == 0 and not window.window_sum().any()


def test_window_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"window_steps >= 1, got 2, 4, 0"):
        ExpertLoadWindow(2, 4, 0)
    window = ExpertLoadWindow(2, 4, 3)
    with pytest.raises(ValueError, match=r"step_load must be \[L, E\]=\(2, 4\), got \(4,\)"):
        window.record(torch.zeros(4, dtype=torch.int64))
