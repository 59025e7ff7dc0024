"""LocalExperts against a per-row loop; dense_reference_moe against transformers' experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

import moe.experts as experts_module
from dist_engine.kernels import compute
from dist_engine.layers.moe import NativeExperts
from moe import LocalExperts, dense_reference_moe, grouped_mm_weighted_sum

HIDDEN, INTERMEDIATE, NUM_SLOTS = 16, 24, 5


def random_experts(seed: int) -> LocalExperts:
    gen = torch.Generator().manual_seed(seed)
    experts = LocalExperts(NUM_SLOTS, HIDDEN, INTERMEDIATE)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=gen) * 0.3)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=gen) * 0.3)
    return experts


def per_row_loop(experts: LocalExperts, hidden, slot_ids, weights) -> torch.Tensor:
    """The slow, obvious version: one token at a time."""
    rows = []
    for row, slot in enumerate(slot_ids.tolist()):
        gate = hidden[row] @ experts.w13[slot, :, :INTERMEDIATE]
        up = hidden[row] @ experts.w13[slot, :, INTERMEDIATE:]
        out = (F.silu(gate) * up) @ experts.w2[slot]
        rows.append(out if weights is None else out * weights[row])
    return torch.stack(rows) if rows else hidden.new_zeros(0, HIDDEN)


@pytest.mark.parametrize("num_rows", [0, 1, 7, 40])
@pytest.mark.parametrize("weighted", [True, False])
def test_local_experts_match_per_row_loop(num_rows: int, weighted: bool) -> None:
    experts = random_experts(seed=num_rows)
    gen = torch.Generator().manual_seed(100 + num_rows)
    hidden = torch.randn(num_rows, HIDDEN, generator=gen)
    slot_ids = torch.randint(NUM_SLOTS, (num_rows,), generator=gen)
    weights = torch.rand(num_rows, generator=gen) if weighted else None
    out = experts(hidden, slot_ids, weights)
    assert out.shape == (num_rows, HIDDEN)
    torch.testing.assert_close(out, per_row_loop(experts, hidden, slot_ids, weights))


def native_kernel():
    """The compiled SwiGLU kernel; a failed build fails the test."""
    kernel = compute.routed_swiglu()
    assert kernel is not None, "the CPU kernels failed to build (see the warning)"
    return kernel


@pytest.mark.parametrize("path", ["padded", "looped", "native"])
@pytest.mark.parametrize("num_rows", [1, 3, 40, 200])
def test_every_expert_path_matches_per_row_loop(
    num_rows: int, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Force each expert path whatever the group sizes (the automatic choice is a speed
    heuristic); rows skip slot 2 entirely, so the padded buffer has an all-padding slot and the
    kernel an empty group. D=16, I=24 exercise the kernel's column tails (not multiples of 16).
    Both entry points: `forward` (one slot per row) and `weighted_sum` (K choices per row, -1
    for choices served elsewhere, padding rows with none, strided rows)."""
    monkeypatch.setattr(experts_module, "PADDED_SLACK_ROWS", 10**6 if path == "padded" else -1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    calls: list[str] = []
    for name in ("_padded_swiglu", "_looped_swiglu"):
        original = getattr(LocalExperts, name)

        def spy(self, *args, _original=original, _name=name):
            calls.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(LocalExperts, name, spy)
    experts = random_experts(seed=7)
    impl = NativeExperts(native_kernel()) if path == "native" else None
    gen = torch.Generator().manual_seed(num_rows)
    hidden = torch.randn(num_rows, HIDDEN, generator=gen)
    slot_ids = torch.tensor([0, 1, 3, 4])[torch.randint(4, (num_rows,), generator=gen)]
    weights = torch.rand(num_rows, generator=gen)
    out = experts(hidden, slot_ids, weights, impl)
    torch.testing.assert_close(out, per_row_loop(experts, hidden, slot_ids, weights))

    # weighted_sum: a second choice per row (-1 on every third row), and a padding row at each
    # end; hidden rows are a strided view, as received byte rows are.
    second = torch.tensor([0, 1, 3, 4])[torch.randint(4, (num_rows,), generator=gen)]
    second[::3] = -1
    second_weights = torch.where(second >= 0, torch.rand(num_rows, generator=gen), 0.0)
    none = torch.full((1, 2), -1)
    local_slots = torch.cat([none, torch.stack([slot_ids, second], dim=1), none])
    choice_weights = torch.cat(
        [torch.zeros(1, 2), torch.stack([weights, second_weights], dim=1), torch.zeros(1, 2)]
    )
    wide = torch.zeros(num_rows + 2, HIDDEN + 5)
    wide[1:-1, :HIDDEN] = hidden
    summed = experts.weighted_sum(wide[:, :HIDDEN], local_slots, choice_weights, impl)
    served = second >= 0
    expected = out.clone()
    expected[served] += per_row_loop(
        experts, hidden[served], second[served], second_weights[served]
    )
    torch.testing.assert_close(summed[1:-1], expected)
    assert not summed[0].any() and not summed[-1].any()
    assert calls == ([] if path == "native" else [f"_{path}_swiglu"] * 2)


def bincount_per_slot(slot_ids: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The counting `grouped_mm_weighted_sum` did before (a host sync on a GPU)."""
    return torch.bincount(slot_ids, minlength=num_slots)


@pytest.mark.parametrize("num_rows", [0, 1, 9, 64])
def test_grouped_mm_counts_on_the_device_with_bincounts_results(
    num_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grouped_mm path counts its rows per slot with a scatter, not `bincount`: the same
    counts, bit-identical outputs, and no op on the way whose result the host must wait for.
    Rows skip slot 2 (an empty group) and a third of the choices are served elsewhere (-1)."""
    experts = random_experts(seed=num_rows + 3)
    gen = torch.Generator().manual_seed(num_rows)
    hidden = torch.randn(num_rows, HIDDEN, generator=gen)
    local_slots = torch.tensor([0, 1, 3, 4, -1, -1])[torch.randint(6, (num_rows, 2), generator=gen)]
    weights = torch.where(local_slots >= 0, torch.rand(num_rows, 2, generator=gen), 0.0)
    ids = torch.randint(NUM_SLOTS, (num_rows * 3,), generator=gen)
    assert torch.equal(
        experts_module.count_per_slot(ids, NUM_SLOTS), bincount_per_slot(ids, NUM_SLOTS)
    )
    with DispatchRecorder() as recorder:
        out = grouped_mm_weighted_sum(experts, hidden, local_slots, weights)
    flagged = {"bincount", "nonzero", "_local_scalar_dense", "masked_select", "unique"}
    assert not flagged & set(recorder.ops), sorted(recorder.ops)
    monkeypatch.setattr(experts_module, "count_per_slot", bincount_per_slot)
    assert torch.equal(out, grouped_mm_weighted_sum(experts, hidden, local_slots, weights))
    torch.testing.assert_close(out, experts.weighted_sum(hidden, local_slots, weights))


class DispatchRecorder(TorchDispatchMode):
    """The names of the aten ops that reach the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("hidden_size", "size_i", "rows_per_slot"),
    [(40, 72, 19), (64, 32, 8), (200, 88, 10), (48, 56, 9), (32, 16, 100), (44, 30, 7),
     (44, 30, 1), (200, 88, 1), (40, 72, 2)],
)  # fmt: skip
def test_native_kernel_matches_the_torch_path(
    threads, hidden_size, size_i, rows_per_slot, monkeypatch
):
    """Row blocks of 6 plus every remainder (1-5 rows), column panels of 128 with blocks of 4,
    2 and 1 vectors (16 lanes on AVX-512, 8 elsewhere) and scalar tails (2I = 176 and 60,
    D = 200 and 44), slots of more rows than one chunk (~200 > 120), slots of fewer rows
    than one block (a decode step's: on AVX2 one pass in blocks of up to 8 vectors, halved
    down to 1), and the split of slots over threads. Rows carry
    K = 3 choices: a slot with no rows, choices served elsewhere (-1), a token choosing one
    slot twice."""
    kernel = native_kernel()
    gen = torch.Generator().manual_seed(hidden_size + threads)
    experts = LocalExperts(6, hidden_size, size_i)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=gen) * 1.5 / hidden_size**0.5)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=gen) * 1.5 / size_i**0.5)
    num_rows = 4 * rows_per_slot + 3
    local_slots = torch.tensor([0, 2, 3, 4, 5, -1])[torch.randint(6, (num_rows, 3), generator=gen)]
    local_slots[0] = torch.tensor([3, 3, -1])
    weights = torch.where(local_slots >= 0, torch.rand(num_rows, 3, generator=gen), 0.0)
    hidden = torch.randn(num_rows, hidden_size, generator=gen) * 3  # silu far from 0
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel(hidden, local_slots, weights, experts.w13, experts.w2)
        # Prefetching the next column panel (on by default on AVX-512) moves no value.
        for setting in ("0", "1"):
            monkeypatch.setenv("LOCKSTEP_NEXT_PANEL", setting)
            again = kernel(hidden, local_slots, weights, experts.w13, experts.w2)
            assert torch.equal(again, out), setting
    finally:
        torch.set_num_threads(before)
    # Outputs reach ~100, so both float32 paths are off by float32 rounding (~1e-5 relative);
    # judge the kernel against float64 by the error the float32 PyTorch path itself makes.
    experts64 = LocalExperts(6, hidden_size, size_i, dtype=torch.float64)
    experts64.load_state_dict(experts.state_dict())
    exact = experts64.weighted_sum(hidden.double(), local_slots, weights)
    torch_error = (experts.weighted_sum(hidden, local_slots, weights).double() - exact).abs().max()
    assert (out.double() - exact).abs().max() <= 2 * torch_error + 1e-6


@pytest.mark.parametrize("size_d, size_i", [(HIDDEN, INTERMEDIATE), (96, 80)])
@pytest.mark.parametrize("num_rows", [1, 5, 70])
def test_native_kernel_in_bfloat16(num_rows, size_d, size_i, monkeypatch):
    """bfloat16 hidden and weights. Where the processor has bf16 dot products (AVX512_BF16),
    the kernel multiplies bf16 pairs with them, rounding the activation between the GEMMs to
    bf16; elsewhere, or with LOCKSTEP_BF16_DOT=0, it widens everything and computes in
    float32, rounding the output once, so it equals the float32 kernel on the same
    (bf16-representable) values up to that one rounding. Either is no further from float64
    than PyTorch's bfloat16 path, which rounds after every op. D=16, I=24 exercise the
    column tails (not multiples of 32); D=96, I=80 the 64- and 32-column blocks; strided rows
    included."""
    kernel = native_kernel()
    gen = torch.Generator().manual_seed(num_rows)
    experts = LocalExperts(NUM_SLOTS, size_d, size_i)
    half = LocalExperts(NUM_SLOTS, size_d, size_i, dtype=torch.bfloat16)
    with torch.no_grad():
        half.w13.copy_(torch.randn(half.w13.shape, generator=gen) * size_d**-0.5)
        half.w2.copy_(torch.randn(half.w2.shape, generator=gen) * size_i**-0.5)
        experts.w13.copy_(half.w13.float())  # the float32 twin holds the bf16 values exactly
        experts.w2.copy_(half.w2.float())
    wide = torch.randn(num_rows, size_d + 3, generator=gen).bfloat16()
    hidden = wide[:, :size_d]
    local_slots = torch.tensor([0, 1, 3, 4, -1])[torch.randint(5, (num_rows, 2), generator=gen)]
    weights = torch.where(local_slots >= 0, torch.rand(num_rows, 2, generator=gen), 0.0)
    experts64 = LocalExperts(NUM_SLOTS, size_d, size_i, dtype=torch.float64)
    experts64.load_state_dict(experts.state_dict())
    exact = experts64.weighted_sum(hidden.double(), local_slots, weights)
    torch_error = (half.weighted_sum(hidden, local_slots, weights).double() - exact).abs().max()
    monkeypatch.setenv("LOCKSTEP_BF16_DOT", "0")
    widened = NativeExperts(kernel)(half, hidden, local_slots, weights)
    assert widened.dtype == torch.bfloat16 and widened.shape == (num_rows, size_d)
    as_float32 = kernel(hidden.float(), local_slots, weights, experts.w13, experts.w2)
    assert torch.equal(widened, as_float32.bfloat16())
    assert (widened.double() - exact).abs().max() <= torch_error + 1e-6
    monkeypatch.delenv("LOCKSTEP_BF16_DOT")
    dot = NativeExperts(kernel)(half, hidden, local_slots, weights)
    assert dot.dtype == torch.bfloat16 and dot.shape == (num_rows, size_d)
    assert (dot.double() - exact).abs().max() <= torch_error + 1e-6
    for setting in ("0", "1"):  # the next column panel's prefetch moves no value
        monkeypatch.setenv("LOCKSTEP_NEXT_PANEL", setting)
        assert torch.equal(NativeExperts(kernel)(half, hidden, local_slots, weights), dot)


def _cpu_has(*flags: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(flags) <= set(line.split())


@pytest.mark.parametrize("num_rows", [3, 20, 40, 150])
def test_native_kernel_on_amx_tiles(num_rows, monkeypatch):
    """bfloat16 where the processor has AMX: a slot with at least 5 rows multiplies on the
    tiles when K % 32 == 0 and N % 64 == 0 (D=64, I=96 here: gate/up [64, 192], down [96, 64]).
    The tiles multiply the same bf16 pairs as the vector dot products and sum them in another
    order, so the result is no further from float64 than PyTorch's bf16 path. The kernel says it
    uses the tiles exactly where /proc/cpuinfo has them and LOCKSTEP_BF16_AMX=0 is unset. 3
    rows leave every slot under the threshold (the vector path's bits); 20 give each slot about
    8 rows, one partial row block of 16 (B packed as the k loop goes); 40 put slots on both
    sides of 16 rows; 150 several blocks and a tail over a panel packed once."""
    kernel = native_kernel()
    size_d, size_i = 64, 96
    gen = torch.Generator().manual_seed(num_rows)
    half = LocalExperts(NUM_SLOTS, size_d, size_i, dtype=torch.bfloat16)
    with torch.no_grad():
        half.w13.copy_(torch.randn(half.w13.shape, generator=gen) * size_d**-0.5)
        half.w2.copy_(torch.randn(half.w2.shape, generator=gen) * size_i**-0.5)
    hidden = torch.randn(num_rows, size_d, generator=gen).bfloat16()
    local_slots = torch.tensor([0, 1, 3, 4, -1])[torch.randint(5, (num_rows, 2), generator=gen)]
    weights = torch.where(local_slots >= 0, torch.rand(num_rows, 2, generator=gen), 0.0)
    experts64 = LocalExperts(NUM_SLOTS, size_d, size_i, dtype=torch.float64)
    experts64.load_state_dict({name: value.double() for name, value in half.state_dict().items()})
    exact = experts64.weighted_sum(hidden.double(), local_slots, weights)
    torch_error = (half.weighted_sum(hidden, local_slots, weights).double() - exact).abs().max()
    monkeypatch.setenv("LOCKSTEP_BF16_AMX", "0")
    vector = NativeExperts(kernel)(half, hidden, local_slots, weights)
    monkeypatch.setenv("LOCKSTEP_BF16_AMX", "1")
    tiles = NativeExperts(kernel)(half, hidden, local_slots, weights)
    assert tiles.dtype == torch.bfloat16 and tiles.shape == (num_rows, size_d)
    assert (tiles.double() - exact).abs().max() <= torch_error + 1e-6
    if num_rows == 3:
        assert torch.equal(tiles, vector)
    assert compute.routed_swiglu_amx() == _cpu_has("amx_tile", "amx_bf16", "avx512_bf16")
    monkeypatch.setenv("LOCKSTEP_BF16_AMX", "0")
    assert not compute.routed_swiglu_amx()


def test_native_kernel_checks_its_inputs():
    kernel = native_kernel()
    experts = LocalExperts(2, 16, 8)
    hidden = torch.randn(3, 16)
    slots, weights = torch.tensor([[0, 1], [1, -1], [0, 0]]), torch.rand(3, 2)
    with pytest.raises(RuntimeError, match=r"local_slots\[1, 1\] = 2 is outside \[-1, 2\)"):
        kernel(hidden, torch.tensor([[0, 1], [1, 2], [0, 0]]), weights, experts.w13, experts.w2)
    with pytest.raises(RuntimeError, match=r"must be float32, or all three bfloat16"):
        kernel(hidden.double(), slots, weights, experts.w13, experts.w2)
    with pytest.raises(RuntimeError, match=r"must be float32, or all three bfloat16"):
        kernel(hidden.bfloat16(), slots, weights, experts.w13, experts.w2)  # mixed dtypes
    with pytest.raises(RuntimeError, match=r"local_slots must be int64"):
        kernel(hidden, slots.int(), weights, experts.w13, experts.w2)
    with pytest.raises(RuntimeError, match=r"shapes disagree"):
        kernel(torch.randn(3, 8), slots, weights, experts.w13, experts.w2)
    with pytest.raises(RuntimeError, match=r"shapes disagree"):
        kernel(hidden, slots, torch.rand(3, 3), experts.w13, experts.w2)
    with pytest.raises(RuntimeError, match=r"rows must be contiguous"):
        kernel(torch.randn(16, 3).t(), slots, weights, experts.w13, experts.w2)


def test_local_experts_validate_inputs() -> None:
    experts = LocalExperts(NUM_SLOTS, HIDDEN, INTERMEDIATE)
    hidden = torch.randn(3, HIDDEN)
    with pytest.raises(ValueError, match=r"reach slot 5 but this rank hosts num_slots=5"):
        experts(hidden, torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError, match=r"must be \[N=3\], got slot_ids \(2,\)"):
        experts(hidden, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"hidden must be \[N, D=16\], got shape \(3, 8\)"):
        experts(torch.randn(3, 8), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"num_slots=-1"):
        LocalExperts(-1, HIDDEN, INTERMEDIATE)


def test_dense_reference_matches_transformers_experts() -> None:
    """Pins the reference itself: same weights in the HF fused layout, same routing."""
    num_experts, num_tokens, top_k = 6, 20, 2
    config = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
    )
    hf_experts = Qwen3MoeExperts(config)
    gen = torch.Generator().manual_seed(3)
    gate = torch.randn(num_experts, INTERMEDIATE, HIDDEN, generator=gen)
    up = torch.randn(num_experts, INTERMEDIATE, HIDDEN, generator=gen)
    down = torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=gen)
    with torch.no_grad():
        hf_experts.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
        hf_experts.down_proj.copy_(down)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=gen)
    with torch.no_grad():
        expected = hf_experts(hidden, ids, weights)
    ours = dense_reference_moe(hidden, weights, ids, gate, up, down)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-4)
