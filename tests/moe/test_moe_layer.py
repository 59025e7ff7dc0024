"""MoELayer in a single process (group=None) against dense_reference_moe; its input checks."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe import (
    DispatchMode,
    ExpertPlacement,
    MoELayer,
    StagedPlacement,
    dense_reference_moe,
    fill_expert,
    keep_hosted_slots,
    slot_moves,
    softmax_topk,
)

NUM_EXPERTS, HIDDEN, INTERMEDIATE = 8, 16, 24


def expert_weights(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(NUM_EXPERTS, INTERMEDIATE, HIDDEN, generator=gen) * 0.3
    up = torch.randn(NUM_EXPERTS, INTERMEDIATE, HIDDEN, generator=gen) * 0.3
    down = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.3
    return gate, up, down


def loaded_layer(placement: ExpertPlacement, seed: int, **kwargs) -> MoELayer:
    layer = MoELayer(NUM_EXPERTS, HIDDEN, INTERMEDIATE, placement, **kwargs)
    gate, up, down = expert_weights(seed)
    for logical in placement.hosted_logical(0):
        layer.load_expert(logical, gate[logical], up[logical], down[logical])
    return layer


@pytest.mark.parametrize("mode", list(DispatchMode))
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("num_tokens", [0, 1, 33])
@pytest.mark.parametrize("replicas", [False, True])
def test_single_process_layer_matches_dense(
    mode: DispatchMode, top_k: int, num_tokens: int, replicas: bool
) -> None:
    phy2log = [0, 1, 2, 3, 4, 5, 6, 7] + ([0, 0, 5] if replicas else [])
    placement = ExpertPlacement.from_phy2log(phy2log, NUM_EXPERTS, num_ranks=1)
    layer = loaded_layer(placement, seed=top_k, ll_max_tokens_per_rank=64)
    gen = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    routing = softmax_topk(torch.randn(num_tokens, NUM_EXPERTS, generator=gen), top_k, True)
    out = layer(hidden, routing.topk_weights, routing.topk_ids, mode, token_offset=3)
    expected = dense_reference_moe(
        hidden, routing.topk_weights, routing.topk_ids, *expert_weights(seed=top_k)
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_load_expert_fills_every_replica() -> None:
    placement = ExpertPlacement.from_phy2log([0, 1, 0, 1, 0], 2, num_ranks=1)
    layer = MoELayer(2, HIDDEN, INTERMEDIATE, placement)
    gate, up, down = (w[0] for w in expert_weights(0))
    layer.load_expert(0, gate, up, down)
    for slot in (0, 2, 4):
        assert torch.equal(layer.experts.w13[slot], torch.cat([gate, up]).t())
        assert torch.equal(layer.experts.w2[slot], down.t())
    for slot in (1, 3):
        assert not layer.experts.w13[slot].any()


def test_expert_weights_are_made_on_the_layer_device() -> None:
    """On "meta" (a device no host memory backs): a GPU rank's experts never pass through the
    host on the way to the device (DeepSeek-V3's are tens of GB per rank)."""
    placement = ExpertPlacement.from_phy2log(list(range(NUM_EXPERTS)), NUM_EXPERTS, num_ranks=1)
    layer = MoELayer(NUM_EXPERTS, HIDDEN, INTERMEDIATE, placement, device="meta")
    assert layer.experts.w13.device.type == layer.experts.w2.device.type == "meta"
    assert MoELayer(NUM_EXPERTS, HIDDEN, INTERMEDIATE, placement).experts.w13.device.type == "cpu"


def test_layer_rejects_bad_construction_and_inputs() -> None:
    two_ranks = ExpertPlacement.even(NUM_EXPERTS, 2)
    with pytest.raises(ValueError, match=r"num_ranks=2 but the group has 1 rank"):
        MoELayer(NUM_EXPERTS, HIDDEN, INTERMEDIATE, two_ranks)
    one_rank = ExpertPlacement.even(NUM_EXPERTS, 1)
    with pytest.raises(ValueError, match=r"num_experts=4 but the placement maps 8"):
        MoELayer(4, HIDDEN, INTERMEDIATE, one_rank)
    layer = MoELayer(NUM_EXPERTS, HIDDEN, INTERMEDIATE, one_rank, ll_max_tokens_per_rank=4)
    gate, up, down = (w[0] for w in expert_weights(0))
    with pytest.raises(ValueError, match=r"down must be \[D=16, I=24\], got \(24, 16\)"):
        layer.load_expert(0, gate, up, down.t())
    with pytest.raises(ValueError, match=r"does not host logical expert 9"):
        layer.load_expert(9, gate, up, down)
    hidden = torch.randn(5, HIDDEN)
    ids = torch.zeros(5, 2, dtype=torch.int64)
    weights = torch.ones(5, 2)
    with pytest.raises(ValueError, match=r"T=5 tokens but ll_max_tokens_per_rank C=4"):
        layer(hidden, weights, ids, DispatchMode.LOW_LATENCY)
    layer(hidden, weights, ids, DispatchMode.NORMAL)  # normal mode has no capacity
    with pytest.raises(ValueError, match=r"mode must be a DispatchMode, got 'normal'"):
        layer(hidden, weights, ids, "normal")
    with pytest.raises(ValueError, match=r"topk_weights shape \(5, 1\) != topk_ids shape"):
        layer(hidden, weights[:, :1], ids, DispatchMode.NORMAL)
    with pytest.raises(ValueError, match=r"hidden must be \[T, D=16\], got shape \(5, 3\)"):
        layer(hidden[:, :3], weights, ids, DispatchMode.NORMAL)


class OpRecorder(TorchDispatchMode):
    """Records every aten op that reaches the dispatcher (a CPU `.tolist()` never does)."""

    # Ops whose output shape or value the host must wait for: each is a device sync on GPU.
    HOST_SYNC_OPS = ("_local_scalar_dense", "nonzero", "bincount", "masked_select", "unique")

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def host_syncs(self, ops: Counter[str] | None = None) -> list[str]:
        return sorted(op for op in (ops or self.ops) if op.startswith(self.HOST_SYNC_OPS))


def test_op_recorder_sees_host_syncs() -> None:
    with OpRecorder() as recorder:
        ids = torch.tensor([0, 2, 2])
        ids[0].item()
        torch.bincount(ids)
        ids.nonzero()
    assert recorder.host_syncs() == ["_local_scalar_dense", "bincount", "nonzero"]


@pytest.mark.parametrize("mode", list(DispatchMode))
def test_load_counting_changes_nothing_and_counts_routed_pairs(mode: DispatchMode) -> None:
    placement = ExpertPlacement.from_phy2log([0, 1, 2, 3, 4, 5, 6, 7, 0, 5], NUM_EXPERTS, 1)
    plain = loaded_layer(placement, seed=1, ll_max_tokens_per_rank=64)
    counting = loaded_layer(placement, seed=1, ll_max_tokens_per_rank=64, count_expert_load=True)
    gen = torch.Generator().manual_seed(4)
    expected = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    for num_tokens in (17, 0, 33):  # counts add up over forwards until taken
        hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
        routing = softmax_topk(torch.randn(num_tokens, NUM_EXPERTS, generator=gen), 3, True)
        args = (hidden, routing.topk_weights, routing.topk_ids, mode)
        with OpRecorder() as without:
            out_plain = plain(*args, token_offset=5)
        with OpRecorder() as with_counting:
            out_counting = counting(*args, token_offset=5)
        assert torch.equal(out_plain, out_counting)
        # Counting adds ops and removes none, and none it adds waits for the device.
        added, removed = with_counting.ops - without.ops, without.ops - with_counting.ops
        assert added["scatter_add_"] == 1 and not removed, (added, removed)
        assert with_counting.host_syncs(added) == [], added
        expected += torch.bincount(routing.topk_ids.flatten(), minlength=NUM_EXPERTS)
    assert not plain.expert_load.any()  # off by default: nothing counted
    assert torch.equal(counting.take_expert_load(), expected)
    assert not counting.take_expert_load().any()  # taking resets


def staged_for(layer: MoELayer, proposed: ExpertPlacement, seed: int) -> StagedPlacement:
    """What the engine's staging builds for `layer` (rank 0) to move to `proposed`."""
    new = keep_hosted_slots(layer.placement, proposed)
    moves = slot_moves(layer.placement, new, rank=0)
    gate, up, down = expert_weights(seed)
    w13 = torch.empty(len(moves.load), HIDDEN, 2 * INTERMEDIATE)
    w2 = torch.empty(len(moves.load), INTERMEDIATE, HIDDEN)
    for row, (_, expert) in enumerate(moves.load):
        fill_expert(w13[row], w2[row], gate[expert], up[expert], down[expert])
    return StagedPlacement(
        placement=new,
        log2phy=new.log2phy.clone(),
        logcnt=new.logcnt.clone(),
        slots=torch.tensor([slot for slot, _ in moves.load], dtype=torch.int64),
        w13=w13,
        w2=w2,
        copy_to=torch.tensor([slot for slot, _ in moves.copy], dtype=torch.int64),
        copy_from=torch.tensor([source for _, source in moves.copy], dtype=torch.int64),
    )


@pytest.mark.parametrize("mode", list(DispatchMode))
def test_adopting_a_placement_between_forwards_keeps_the_results(mode: DispatchMode) -> None:
    """EPLB's swap: only changed slots are written, the parameters stay the same tensors, and
    forwards before and after it equal the dense reference."""
    before = ExpertPlacement.from_phy2log([0, 1, 2, 3, 4, 5, 6, 7, 0, 1], NUM_EXPERTS, 1)
    after = ExpertPlacement.from_phy2log([6, 6, 2, 3, 4, 5, 6, 7, 0, 1], NUM_EXPERTS, 1)
    layer = loaded_layer(before, seed=2, ll_max_tokens_per_rank=64)
    w13 = layer.experts.w13
    gen = torch.Generator().manual_seed(7)
    for placement in (before, after):
        if placement is after:
            staged = staged_for(layer, after, seed=2)
            assert staged.slots.tolist() == [] and staged.copy_to.numel() == 2  # 6, from slot 6
            layer.adopt(staged)
        hidden = torch.randn(9, HIDDEN, generator=gen)
        routing = softmax_topk(torch.randn(9, NUM_EXPERTS, generator=gen), 2, True)
        out = layer(hidden, routing.topk_weights, routing.topk_ids, mode)
        expected = dense_reference_moe(
            hidden, routing.topk_weights, routing.topk_ids, *expert_weights(seed=2)
        )
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert layer.experts.w13 is w13
    assert sorted(layer.placement.phy2log.tolist()) == sorted(after.phy2log.tolist())
    assert torch.equal(layer.logcnt, after.logcnt)
    # Weights can also come from staged buffers (what a rank reads for experts new to it).
    layer = loaded_layer(before, seed=2)
    gate, up, down = expert_weights(2)
    w13, w2 = torch.empty(2, HIDDEN, 2 * INTERMEDIATE), torch.empty(2, INTERMEDIATE, HIDDEN)
    for row in range(2):
        fill_expert(w13[row], w2[row], gate[6], up[6], down[6])
    target = ExpertPlacement.from_phy2log([0, 1, 2, 3, 4, 5, 6, 7, 6, 6], NUM_EXPERTS, 1)
    slots, none = torch.tensor([8, 9]), torch.empty(0, dtype=torch.int64)
    layer.adopt(StagedPlacement(target, target.log2phy, target.logcnt, slots, w13, w2, none, none))
    for slot, logical in enumerate(target.phy2log.tolist()):
        assert torch.equal(layer.experts.w13[slot], torch.cat([gate[logical], up[logical]]).t())
        assert torch.equal(layer.experts.w2[slot], down[logical].t())


def test_adopt_refuses_another_shape_and_counts_go_where_asked() -> None:
    layer = loaded_layer(ExpertPlacement.even(NUM_EXPERTS, 1), seed=0)
    wider = ExpertPlacement.from_phy2log([*range(NUM_EXPERTS), 0], NUM_EXPERTS, 1)
    empty = torch.empty(0, dtype=torch.int64)
    staged = StagedPlacement(wider, wider.log2phy, wider.logcnt, empty, empty, empty, empty, empty)
    with pytest.raises(ValueError, match=r"new placement has E=8, P=9, N=1; this layer has E=8"):
        layer.adopt(staged)
    counts = torch.zeros(2, NUM_EXPERTS, dtype=torch.int64)
    layer.count_load_into(counts[1])
    ids = torch.tensor([[3, 5], [3, 0]])
    assert layer.next_token_offset == 0
    layer(torch.randn(2, HIDDEN), torch.ones(2, 2), ids, DispatchMode.NORMAL)
    assert counts[1].tolist() == [1, 0, 0, 2, 0, 1, 0, 0] and not counts[0].any()
    assert layer.next_token_offset == 2  # a forward without an offset advances the layer's
    layer(torch.randn(3, HIDDEN), torch.ones(3, 2), ids[:1].repeat(3, 1), DispatchMode.NORMAL, 9)
    assert layer.next_token_offset == 2
    with pytest.raises(ValueError, match=r"counts must be \[E=8\] int64, got \(2, 8\)"):
        layer.count_load_into(counts)


@pytest.mark.multirank
def test_moe_imports_nothing_above_it() -> None:
    """moe/ sits below dist_engine and beside scheduler (DESIGN §1)."""
    code = (
        "import sys, moe; "
        "bad = sorted({m.split('.')[0] for m in sys.modules} "
        "& {'scheduler', 'dist_engine', 'launcher'}); "
        "assert not bad, bad"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)
