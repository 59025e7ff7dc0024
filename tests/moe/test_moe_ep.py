"""Expert parallelism over real gloo groups (2 and 4 ranks) against the dense reference.

Each world size spawns ONE group and runs every case in it (process start-up dominates the cost).
Children return their outputs; the parent regenerates the same inputs from the case seeds and
compares each rank's output with `dense_reference_moe` computed independently here. Each case
runs twice: through MoELayer and through the public dispatch → run_local_experts → combine.
Odd seeds run the experts through the compiled kernel (when it is built; it reads the received
rows in place, strided), even seeds through PyTorch. Every case travels both through the gloo
group and through the shared-memory exchange (small slots, so rows go in several chunks).
Placements are even, random with replicas, or `moe.rebalance`'s for a skewed load (both
policies); every layer counts its routed load, checked against the case's topk_ids. Last,
decode-sized batches (one or two tokens a rank) on a hot expert with replicas, through the
layer's own running offsets, with the placement swapped between two forwards as EPLB does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from dist_engine.distributed.shm_exchange import open_shared_memory_exchange
from dist_engine.distributed.spawn import run_multirank
from dist_engine.kernels import compute
from dist_engine.layers.moe import NativeExperts
from moe import (
    DispatchMode,
    ExpertPlacement,
    MoELayer,
    StagedPlacement,
    choose_replicas,
    combine,
    dense_reference_moe,
    dispatch,
    fill_expert,
    keep_hosted_slots,
    rebalance,
    run_local_experts,
    slot_moves,
    softmax_topk,
)

NUM_EXPERTS = 8
HIDDEN = 16
INTERMEDIATE = 24
CAPACITY = 12  # ll_max_tokens_per_rank, the same on every rank


@dataclass(frozen=True)
class Case:
    mode: DispatchMode
    top_k: int
    replicas: bool
    seed: int
    token_counts: str = "random"  # "random" (one rank forced to 0), "zero" or "over_capacity"
    eplb_nodes: int = 0  # > 0: the placement is rebalance()'s over this many nodes


def build_cases() -> list[Case]:
    cases = []
    seed = 0
    for mode in DispatchMode:
        for top_k in (1, 2, 4):
            for replicas in (False, True):
                cases.append(Case(mode, top_k, replicas, seed))
                seed += 1
        cases.append(Case(mode, 2, True, seed, token_counts="zero"))
        seed += 1
    # Every rank over capacity: each must raise before any collective, and the group must stay
    # usable (the case after it runs normally).
    cases.append(Case(DispatchMode.LOW_LATENCY, 2, False, seed, token_counts="over_capacity"))
    cases.append(Case(DispatchMode.LOW_LATENCY, 2, True, seed + 1))
    # EPLB placements: hierarchical (2 nodes divide the 2 groups) and global (1 node).
    cases.append(Case(DispatchMode.NORMAL, 2, True, seed + 2, eplb_nodes=2))
    cases.append(Case(DispatchMode.LOW_LATENCY, 4, True, seed + 3, eplb_nodes=1))
    return cases


def make_placement(case: Case, world_size: int) -> ExpertPlacement:
    if case.eplb_nodes:
        gen = torch.Generator().manual_seed(1000 + case.seed)
        load = torch.randint(0, 50, (1, NUM_EXPERTS), generator=gen)
        load[0, case.seed % NUM_EXPERTS] = 1000  # one hot expert: it gets replicas
        num_physical = world_size * (NUM_EXPERTS // world_size + 1)
        return rebalance(load, num_physical, 2, case.eplb_nodes, world_size).placement(0)
    if not case.replicas:
        return ExpertPlacement.even(NUM_EXPERTS, world_size)
    gen = torch.Generator().manual_seed(1000 + case.seed)
    num_physical = world_size * (NUM_EXPERTS // world_size + 2)
    extra = torch.randint(NUM_EXPERTS, (num_physical - NUM_EXPERTS,), generator=gen)
    phy2log = torch.cat([torch.arange(NUM_EXPERTS), extra])
    phy2log = phy2log[torch.randperm(num_physical, generator=gen)]
    return ExpertPlacement.from_phy2log(phy2log, NUM_EXPERTS, world_size)


def make_expert_weights(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up: [E, I, D]; down: [E, D, I] — identical on every rank."""
    gen = torch.Generator().manual_seed(2000 + case.seed)
    gate = torch.randn(NUM_EXPERTS, INTERMEDIATE, HIDDEN, generator=gen) * 0.3
    up = torch.randn(NUM_EXPERTS, INTERMEDIATE, HIDDEN, generator=gen) * 0.3
    down = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.3
    return gate, up, down


def make_tokens(case: Case, rank: int, world_size: int):
    """This rank's inputs: hidden [T, D], topk_weights [T, K], topk_ids [T, K], token_offset."""
    gen = torch.Generator().manual_seed(3000 + 100 * case.seed + rank)
    if case.token_counts == "zero" or (
        case.token_counts == "random" and rank == case.seed % world_size
    ):
        num_tokens = 0
    elif case.token_counts == "over_capacity":
        num_tokens = CAPACITY + 1
    else:
        num_tokens = int(torch.randint(1, CAPACITY + 1, (1,), generator=gen))
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen)
    routing = softmax_topk(logits, case.top_k, renormalize=True)
    token_offset = int(torch.randint(0, 1000, (1,), generator=gen))
    return hidden, routing.topk_weights, routing.topk_ids, token_offset


def ep_worker(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    """Runs in each spawned rank: every case through MoELayer, plus a raw dispatch for counts."""
    exchanges = {
        "": dist.group.WORLD,
        "_shm": open_shared_memory_exchange(
            dist.group.WORLD, "shared_memory", timeout_s=60, slot_bytes=4096
        ),
    }
    results = []
    for case, (suffix, group) in itertools.product(cases, exchanges.items()):
        placement = make_placement(case, world_size)
        layer = MoELayer(
            NUM_EXPERTS,
            HIDDEN,
            INTERMEDIATE,
            placement,
            rank=rank,
            group=group,
            ll_max_tokens_per_rank=CAPACITY,
            count_expert_load=True,
        )
        gate, up, down = make_expert_weights(case)
        for logical in placement.hosted_logical(rank):
            layer.load_expert(logical, gate[logical], up[logical], down[logical])
        impl = NativeExperts(compute.routed_swiglu()) if case.seed % 2 else None
        layer.set_expert_impl(impl)
        hidden, weights, ids, offset = make_tokens(case, rank, world_size)
        try:
            output = layer(hidden, weights, ids, case.mode, token_offset=offset)
        except ValueError as exc:
            results.append({"error" + suffix: str(exc)})
            continue
        physical = choose_replicas(ids, placement, offset)
        recv_hidden, recv_routing, meta = dispatch(
            case.mode, hidden, weights, physical, placement.slots_per_rank, group, CAPACITY
        )
        expert_out = run_local_experts(layer.experts, recv_hidden, recv_routing, impl)
        composed = combine(expert_out, meta, group)
        results.append(
            {
                "output" + suffix: output,
                "composed" + suffix: composed,
                "num_received" + suffix: recv_hidden.shape[0],
                "expert_load" + suffix: layer.take_expert_load(),
            }
        )
    # One dict per case, both exchanges' results in it; then the swap's.
    cases_out = [{**results[2 * i], **results[2 * i + 1]} for i in range(len(cases))]
    return {"cases": cases_out, "swap": swap_worker(rank, world_size)}


# -- decode-sized batches, replicas and a placement swap -------------------------------------
HOT = 3  # every token's first choice
SWAP_STEPS, SWAP_AT = 6, 3  # decode forwards; the placement changes before forward SWAP_AT


def swap_placements(world_size: int) -> tuple[ExpertPlacement, ExpertPlacement]:
    """EPLB's start (one spare slot per rank) and its placement for the hot load, aligned."""
    before = ExpertPlacement.with_redundancy(NUM_EXPERTS, world_size, world_size)
    load = torch.ones(1, NUM_EXPERTS)
    load[0, HOT] = 100.0
    proposed = rebalance(load, NUM_EXPERTS + world_size, 1, 1, world_size).placement(0)
    return before, keep_hosted_slots(before, proposed)


def swap_tokens(rank: int, step: int):
    """hidden [T, D], topk_weights [T, 2], topk_ids [T, 2] with T = 1 or 2, HOT first."""
    gen = torch.Generator().manual_seed(5000 + 10 * rank + step)
    num_tokens = 1 + (rank + step) % 2
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    other = (HOT + 1 + torch.randint(NUM_EXPERTS - 1, (num_tokens, 1), generator=gen)) % 8
    ids = torch.cat([torch.full((num_tokens, 1), HOT), other], dim=1)
    weights = torch.softmax(torch.randn(num_tokens, 2, generator=gen), dim=1)
    return hidden, weights, ids


def swap_worker(rank: int, world_size: int) -> dict:
    """Decode forwards without a token_offset; before forward SWAP_AT every rank adopts the
    new placement, staging the experts new to it from the (regenerated) weights."""
    before, after = swap_placements(world_size)
    gate, up, down = make_expert_weights(Case(DispatchMode.LOW_LATENCY, 2, True, 77))
    layer = MoELayer(
        NUM_EXPERTS, HIDDEN, INTERMEDIATE, before, rank, dist.group.WORLD, torch.float32, CAPACITY
    )
    for logical in before.hosted_logical(rank):
        layer.load_expert(logical, gate[logical], up[logical], down[logical])
    outputs, offsets = [], []
    for step in range(SWAP_STEPS):
        if step == SWAP_AT:
            moves = slot_moves(before, after, rank)
            w13 = torch.empty(len(moves.load), HIDDEN, 2 * INTERMEDIATE)
            w2 = torch.empty(len(moves.load), INTERMEDIATE, HIDDEN)
            for row, (_, e) in enumerate(moves.load):
                fill_expert(w13[row], w2[row], gate[e], up[e], down[e])
            index = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
            layer.adopt(
                StagedPlacement(
                    after,
                    after.log2phy.clone(),
                    after.logcnt.clone(),
                    index([slot for slot, _ in moves.load]),
                    w13,
                    w2,
                    index([slot for slot, _ in moves.copy]),
                    index([source for _, source in moves.copy]),
                )
            )
        offsets.append(layer.next_token_offset)
        outputs.append(layer(*swap_tokens(rank, step), DispatchMode.LOW_LATENCY))
    return {"outputs": outputs, "offsets": offsets, "phy2log": layer.placement.phy2log}


def num_token_rank_pairs(case: Case, world_size: int) -> int:
    """Distinct (token, destination rank) pairs over all ranks: what normal mode must send."""
    placement = make_placement(case, world_size)
    total = 0
    for rank in range(world_size):
        _, _, ids, offset = make_tokens(case, rank, world_size)
        dest = choose_replicas(ids, placement, offset) // placement.slots_per_rank
        total += sum(len(set(row)) for row in dest.tolist())
    return total


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_ep_matches_dense_reference(world_size: int) -> None:
    cases = build_cases()
    returned = run_multirank(world_size, ep_worker, (cases,), timeout_s=90)
    per_rank = [result["cases"] for result in returned]
    check_swap(world_size, [result["swap"] for result in returned])
    for index, case in enumerate(cases):
        gate, up, down = make_expert_weights(case)
        results = [per_rank[rank][index] for rank in range(world_size)]
        if case.token_counts == "over_capacity":
            for result, suffix in itertools.product(results, ("", "_shm")):
                assert "error" + suffix in result, (case, result)
                assert f"T={CAPACITY + 1}" in result["error" + suffix], result
                assert f"C={CAPACITY}" in result["error" + suffix], result
            continue
        for rank, result in enumerate(results):
            assert "output" in result, (case, rank, result)
            hidden, weights, ids, _ = make_tokens(case, rank, world_size)
            expected = dense_reference_moe(hidden, weights, ids, gate, up, down)
            for path in ("output", "composed", "output_shm", "composed_shm"):
                torch.testing.assert_close(
                    result[path], expected, rtol=1e-5, atol=1e-5, msg=f"{case} rank {rank} {path}"
                )
            routed = torch.bincount(ids.flatten(), minlength=NUM_EXPERTS)
            for path in ("expert_load", "expert_load_shm"):
                assert torch.equal(result[path], routed), (case, rank, path)
        received = sum(result["num_received"] for result in results)
        assert received == sum(result["num_received_shm"] for result in results), case
        if case.mode is DispatchMode.NORMAL:
            assert received == num_token_rank_pairs(case, world_size), case
        else:
            assert received == world_size * world_size * CAPACITY, case


def check_swap(world_size: int, per_rank: list[dict]) -> None:
    """Every decode forward equals the dense reference, across the swap; the layer's own
    offsets start at the rank and advance by its tokens; and those offsets send the hot
    expert's tokens to each of its replicas, on several ranks."""
    before, after = swap_placements(world_size)
    assert after.logcnt[HOT] >= 2 and len(set(after.log2phy[HOT].tolist()) - {-1}) >= 2
    gate, up, down = make_expert_weights(Case(DispatchMode.LOW_LATENCY, 2, True, 77))
    used = set()
    for rank, result in enumerate(per_rank):
        assert result["phy2log"].tolist() == after.phy2log.tolist()
        offset = rank
        for step in range(SWAP_STEPS):
            hidden, weights, ids = swap_tokens(rank, step)
            expected = dense_reference_moe(hidden, weights, ids, gate, up, down)
            torch.testing.assert_close(
                result["outputs"][step], expected, rtol=1e-5, atol=1e-5, msg=(rank, step)
            )
            assert result["offsets"][step] == offset
            placement = after if step >= SWAP_AT else before
            if step >= SWAP_AT:
                used |= set(choose_replicas(ids, placement, offset)[:, 0].tolist())
            offset += hidden.shape[0]
    hot_slots = set(after.log2phy[HOT].tolist()) - {-1}
    assert used == hot_slots, (used, hot_slots)
