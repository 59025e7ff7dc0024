"""A group that shrinks onto its survivors and grows back: the placement maths (pure) and
`MoELayer.reshard` over real gloo groups, 4 ranks -> the 3 that survive -> 4 again, every
forward against the dense reference."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from dist_engine.distributed.spawn import current_store, run_multirank
from moe import (
    DispatchMode,
    ExpertPlacement,
    MoELayer,
    dense_reference_moe,
    reshard_moves,
    shrink_placement,
    softmax_topk,
)

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 16, 24, 2


def test_shrink_keeps_every_survivors_slots_and_places_each_orphan_hand_worked() -> None:
    even = ExpertPlacement.even(8, 4)  # [0 1 | 2 3 | 4 5 | 6 7]
    shrunk = shrink_placement(even, [0, 1, 2])
    # Rank 3's experts 6 and 7 go to ranks 0 and 1; rank 2 pads with a replica of its own.
    assert shrunk.phy2log.tolist() == [0, 1, 6, 2, 3, 7, 4, 5, 4]
    assert shrunk.num_ranks == 3 and shrunk.slots_per_rank == 3
    moves = reshard_moves(even.local_phy2log(1), shrunk.local_phy2log(1))
    assert moves.kept == ((0, 0), (1, 1)) and moves.load == ((2, 7),) and moves.copy == ()
    # Growing back to the even placement: the survivor drops its orphan, reads nothing.
    back = reshard_moves(shrunk.local_phy2log(1), even.local_phy2log(1))
    assert back.kept == ((0, 0), (1, 1)) and back.load == ()
    with pytest.raises(ValueError, match="ascending"):
        shrink_placement(even, [2, 0])


def test_reshard_moves_load_each_missing_expert_once_and_copy_its_replicas() -> None:
    moves = reshard_moves([0, 1], [1, 5, 5, 0, 6])
    assert moves.kept == ((0, 1), (3, 0))
    assert moves.load == ((1, 5), (4, 6))
    assert moves.copy == ((2, 1),)


@pytest.mark.parametrize("seed", range(40))
def test_shrink_of_random_placements_hosts_every_expert_and_keeps_what_survives(seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_ranks = int(torch.randint(2, 6, (1,), generator=gen))
    num_experts = int(torch.randint(num_ranks, 20, (1,), generator=gen))
    slots = num_ranks * -(-num_experts // num_ranks) + num_ranks * int(
        torch.randint(0, 2, (1,), generator=gen)
    )
    phy2log = torch.cat(
        [
            torch.arange(num_experts),
            torch.randint(0, num_experts, (slots - num_experts,), generator=gen),
        ]
    )
    phy2log = phy2log[torch.randperm(slots, generator=gen)]
    current = ExpertPlacement.from_phy2log(phy2log, num_experts, num_ranks)
    lost = int(torch.randint(0, num_ranks, (1,), generator=gen))
    survivors = [rank for rank in range(num_ranks) if rank != lost]
    shrunk = shrink_placement(current, survivors)
    assert shrunk.num_ranks == len(survivors)
    assert bool((shrunk.logcnt >= 1).all())  # every expert somewhere
    orphans = set(range(num_experts)) - {
        e for rank in survivors for e in current.local_phy2log(rank)
    }
    for new_rank, old_rank in enumerate(survivors):
        before, after = current.local_phy2log(old_rank), shrunk.local_phy2log(new_rank)
        assert after[: len(before)] == before  # nothing it holds moves
        moves = reshard_moves(before, after)
        assert {e for _, e in moves.load} <= orphans
    # Each orphan is read exactly once in the whole group.
    loads = Counter(
        e
        for new_rank, old_rank in enumerate(survivors)
        for _, e in reshard_moves(
            current.local_phy2log(old_rank), shrunk.local_phy2log(new_rank)
        ).load
    )
    assert loads == Counter(orphans)


def _weights():
    gen = torch.Generator().manual_seed(7)
    gate = torch.randn(NUM_EXPERTS, INTERMEDIATE, HIDDEN, generator=gen) * 0.3
    up = torch.randn(NUM_EXPERTS, INTERMEDIATE, HIDDEN, generator=gen) * 0.3
    down = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.3
    return gate, up, down


def _tokens(rank: int, phase: int):
    gen = torch.Generator().manual_seed(100 * phase + rank)
    hidden = torch.randn(5 + rank, HIDDEN, generator=gen)
    routing = softmax_topk(
        torch.randn(5 + rank, NUM_EXPERTS, generator=gen), TOP_K, renormalize=True
    )
    return hidden, routing.topk_weights, routing.topk_ids


def _new_group(rank: int, world: int, name: str):
    """Leave this process's group and join a new one of `world` under a new store prefix."""
    dist.destroy_process_group()
    store = dist.PrefixStore(f"{name}/", current_store())
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return dist.new_group(backend="gloo")


def _forward_all(layer, rank: int, phase: int) -> list[torch.Tensor]:
    return [
        layer(*_tokens(rank, phase), mode=mode, token_offset=0)
        for mode in (DispatchMode.NORMAL, DispatchMode.LOW_LATENCY)
    ]


def reshard_worker(rank: int, world: int) -> dict:
    gate, up, down = _weights()
    even = ExpertPlacement.even(NUM_EXPERTS, world)

    def build(placement, my_rank, group):
        layer = MoELayer(NUM_EXPERTS, HIDDEN, INTERMEDIATE, placement, my_rank, group)
        for expert in placement.hosted_logical(my_rank):
            layer.load_expert(expert, gate[expert], up[expert], down[expert])
        return layer

    read_log: list[list[int]] = []

    def read(experts):
        read_log.append(list(experts))
        return [(gate[e], up[e], down[e]) for e in experts]

    result = {"phase0": None, "phase1": None, "phase2": None}
    group = dist.new_group(backend="gloo")
    layer = build(even, rank, group)
    result["phase0"] = _forward_all(layer, rank, 0)
    survivors = [0, 1, 2]
    # Rank 3 leaves; the others shrink onto a group of 3 (new process groups).
    group = _new_group(survivors.index(rank), 3, "shrunk") if rank in survivors else None
    if rank in survivors:
        new_rank = survivors.index(rank)
        read_log.clear()
        layer.reshard(shrink_placement(even, survivors), new_rank, group, read)
        result["read_shrink"] = [e for batch in read_log for e in batch]
        result["phase1"] = _forward_all(layer, new_rank, 1)
    # Grow back: a fresh rank 3 (built as at start-up) and the survivors re-placed evenly.
    group = _new_group(rank, world, "grown")
    if rank in survivors:
        read_log.clear()
        layer.reshard(even, rank, group, read)
        result["read_grow"] = [e for batch in read_log for e in batch]
    else:
        layer = build(even, rank, group)
    result["phase2"] = _forward_all(layer, rank, 2)
    result["slots"] = layer.experts.num_slots
    return result


@pytest.mark.multirank
def test_reshard_onto_survivors_and_back_matches_the_dense_reference() -> None:
    results = run_multirank(4, reshard_worker, (), timeout_s=120)
    gate, up, down = _weights()
    for phase, ranks in (("phase0", range(4)), ("phase1", range(3)), ("phase2", range(4))):
        for rank in ranks:  # survivors 0, 1, 2 keep their numbers in the group of 3
            hidden, weights, ids = _tokens(rank, int(phase[-1]))
            expected = dense_reference_moe(hidden, weights, ids, gate, up, down)
            for got in results[rank][phase]:
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The survivors read only rank 3's experts (6 and 7), each once; growing back reads none.
    assert sorted(e for r in range(3) for e in results[r]["read_shrink"]) == [6, 7]
    assert all(results[r]["read_grow"] == [] for r in range(3))
    assert [results[r]["slots"] for r in range(4)] == [2, 2, 2, 2]
