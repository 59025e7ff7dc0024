"""RMSNorm against transformers' own module: bit for bit on its PyTorch paths, to float32
rounding through the CPU kernel (and bf16's rounding in bf16); the oneDNN linear against
F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from dist_engine.kernels import compute
from dist_engine.layers.linear import (
    Linear,
    LinearKernel,
    linear,
    onednn_available,
    onednn_linear,
    onednn_serves,
    pack_weight,
)
from dist_engine.layers.norm import NormKernel, RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 64), (5, 4, 32), (0, 64)])
def test_rms_norm_equals_transformers(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Without the CPU kernel, float32 takes torch's fused `F.rms_norm`; half types the explicit
    upcast-then-cast path (HF casts back to the input dtype *before* the weight multiply). Both
    must equal HF bit for bit."""
    gen = torch.Generator().manual_seed(len(shape))
    size, eps = shape[-1], 1e-6
    ours = RMSNorm(size, eps, dtype)  # no kernel: PyTorch's ops
    reference = Qwen3MoeRMSNorm(size, eps=eps).to(dtype)
    with torch.no_grad():
        weight = (torch.randn(size, generator=gen) * 0.5 + 1).to(dtype)
        ours.weight.copy_(weight)
        reference.weight.copy_(weight)
        x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
        if x.dim() == 3:
            x = x.transpose(0, 1)  # a strided input, as q/k heads are after the fused qkv split
        expected = reference(x)
        actual = ours(x)
    assert actual.dtype == expected.dtype == dtype
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("shape", [(7, 64), (5, 4, 32), (3, 50), (0, 64), (130, 256)])
def test_rms_norm_kernel_matches_transformers(shape: tuple[int, ...]) -> None:
    """The float32 CPU kernel: strided rows (q/k heads), sizes that are not a multiple of its
    16 lanes, empty batches, and a batch big enough to split over threads."""
    kernel = compute.rms_norm()
    assert kernel is not None, "the CPU kernels failed to build (see the warning)"
    ours = RMSNorm(shape[-1], 1e-6, torch.float32, kernel=NormKernel(kernel))
    reference = Qwen3MoeRMSNorm(shape[-1], eps=1e-6)
    gen = torch.Generator().manual_seed(sum(shape))
    with torch.no_grad():
        weight = torch.randn(shape[-1], generator=gen) * 0.5 + 1
        ours.weight.copy_(weight)
        reference.weight.copy_(weight)
        x = torch.randn(*shape, generator=gen) * 3
        if x.dim() == 3:
            x = x.transpose(0, 1)
        torch.testing.assert_close(ours(x), reference(x), rtol=2e-6, atol=1e-6)


def test_rms_norm_kernel_checks_its_inputs() -> None:
    kernel = compute.rms_norm()
    assert kernel is not None, "the CPU kernels failed to build (see the warning)"
    with pytest.raises(RuntimeError, match=r"must be float32"):
        kernel(torch.randn(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(RuntimeError, match=r"contiguous weight \[D\]"):
        kernel(torch.randn(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match=r"last dim must be contiguous"):
        kernel(torch.randn(8, 2).t(), torch.ones(8), 1e-6)


@pytest.mark.parametrize("shape", [(7, 384), (3, 4, 40), (1, 17)])
def test_rms_norm_kernel_in_bfloat16_follows_hf_roundings(shape) -> None:
    """bf16: the kernel widens, sums in float32, rounds the normalised row to bf16 and the
    product with the weight again, as HF's RMSNorm does. Against the PyTorch path in bf16,
    nothing is off by more than one bf16 step (the float32 sums run in another order, so a
    value next to a rounding boundary may round the other way), and almost nothing is off."""
    kernel = compute.rms_norm()
    assert kernel is not None, "the CPU kernels failed to build (see the warning)"
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=gen) * 3).bfloat16()
    norm = RMSNorm(shape[-1], 1e-6, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[-1], generator=gen) + 0.5)
    expected = norm(x)
    got = kernel(x, norm.weight, 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    step = expected.float().abs().clamp_min(1e-30) * 2**-7  # one bf16 step, with margin
    off = (got.float() - expected.float()).abs()
    assert bool((off <= step).all()) and (off > 0).float().mean() < 0.02
    # Through the layer: a bf16 norm with the kernel takes it (and the same strided q-head
    # views the float32 kernel takes).
    with_kernel = RMSNorm(shape[-1], 1e-6, torch.bfloat16, kernel=NormKernel(kernel))
    with torch.no_grad():
        with_kernel.weight.copy_(norm.weight)
    assert torch.equal(with_kernel(x), got)


def test_norm_kernel_serves_only_its_token_range() -> None:
    """`norm_backend` decode-only: the kernel for steps of up to max_tokens tokens, PyTorch's
    op above (and for other dtypes)."""
    calls: list[int] = []

    def counting(x, weight, eps):
        calls.append(x.shape[0])
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)

    norm = RMSNorm(8, 1e-6, torch.float32, kernel=NormKernel(counting, max_tokens=4))
    with torch.no_grad():
        norm.weight.fill_(1.0)
    norm(torch.randn(4, 8))
    norm(torch.randn(5, 8))
    assert calls == [4]
    above = RMSNorm(8, 1e-6, torch.float32, kernel=NormKernel(counting, min_tokens=5))
    with torch.no_grad():
        above.weight.fill_(1.0)
    above(torch.randn(4, 8))
    above(torch.randn(6, 8))
    assert calls == [4, 6]


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_linear_equals_f_linear(dtype) -> None:
    """`linear_backend: onednn` computes F.linear's result (to the dtype's rounding: another
    GEMM sums in another order), with and without bias, on a weight in either layout."""
    if not onednn_serves(dtype):
        # oneDNN has bfloat16 GEMMs for AVX-512 processors only: what this host lacks is
        # refused, and the layers keep F.linear for it.
        with pytest.raises(RuntimeError, match="primitive descriptor"):
            onednn_linear(torch.ones(2, 16, dtype=dtype), torch.ones(8, 16, dtype=dtype))
        x = torch.ones(2, 16, dtype=dtype)
        assert not LinearKernel(onednn_linear).serves(x, x[:1])
        return
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=gen).to(dtype)
    weight = torch.randn(200, 96, generator=gen).to(dtype)
    bias = torch.randn(200, generator=gen).to(dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for b in (None, bias):
        expected = torch.nn.functional.linear(
            x.double(), weight.double(), None if b is None else b.double()
        )
        got = onednn_linear(x, weight, b)
        assert got.dtype == dtype and got.shape == (37, 200)
        assert torch.allclose(got.double(), expected, rtol=tolerance, atol=tolerance * 10)
    transposed = weight.t().contiguous().t()  # the [in, out] layout, seen as [out, in]
    assert torch.equal(onednn_linear(x, transposed), onednn_linear(x, weight))


def test_a_linear_stored_in_out_keeps_its_values_and_takes_a_checkpoint() -> None:
    """`store_in_out` re-stores the weight [in, out] behind an [out, in] view: same values,
    shape and result; writing into it (as the loader does, rows at a time) lands in the view;
    a second call changes nothing; `keep_layout` opts a layer out."""
    layer = Linear(8, 5, True, torch.float32)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(3, 8)
    before, values = layer(x), layer.weight.detach().clone()
    layer.store_in_out()
    assert layer.weight.shape == (5, 8) and layer.weight.stride() == (1, 5)
    assert torch.equal(layer.weight, values)
    torch.testing.assert_close(layer(x), before)
    stored = layer.weight
    layer.store_in_out()
    assert layer.weight is stored
    fresh = torch.randn(5, 8)
    with torch.no_grad():
        layer.weight[:2].copy_(fresh[:2])
        layer.weight[2:].copy_(fresh[2:])
    assert torch.equal(layer.weight, fresh) and layer.weight.stride() == (1, 5)
    kept = Linear(8, 5, False, torch.float32)
    kept.keep_layout = True
    kept.store_in_out()
    assert kept.weight.is_contiguous()


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
def test_linear_kernel_runs_each_regime_by_rows_and_dtype() -> None:
    """A kernel with a packed decode regime: decode-sized rows read the packed weight, larger
    ones the prefill choice (here PyTorch's F.linear, bit for bit); a dtype oneDNN does not
    serve, or no packed weight given, never reaches the packed path."""
    x, weight = torch.randn(6, 32), torch.randn(8, 32)
    kernel = LinearKernel("onednn_packed", "torch", max_decode_tokens=4)
    assert [kernel.choice(x[:n], weight) for n in (1, 4, 5)] == ["onednn_packed"] * 2 + ["torch"]
    packed = pack_weight(weight)
    assert torch.equal(linear(x, weight, kernel=kernel, packed=packed), F.linear(x, weight))
    small = linear(x[:4], weight, kernel=kernel, packed=packed)
    torch.testing.assert_close(small, F.linear(x[:4], weight))
    torch.testing.assert_close(linear(x[:4], weight, kernel=kernel), F.linear(x[:4], weight))
    assert kernel.choice(x.double(), weight.double()) == "torch"  # oneDNN serves no float64
    layer = Linear(32, 8, False, torch.float32)
    with torch.no_grad():
        layer.weight.copy_(weight)
    layer.kernel = kernel
    layer.pack()
    assert layer.packed is not None and layer.packed.is_mkldnn
    torch.testing.assert_close(layer(x[:2]), F.linear(x[:2], weight))
