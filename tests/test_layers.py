"""RMSNorm against transformers' own module, bit for bit, on both of its code paths."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from dist_engine.layers import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 64), (5, 4, 32), (0, 64)])
def test_rms_norm_equals_transformers(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """float32 takes torch's fused `F.rms_norm`; half types the explicit upcast-then-cast path
    (HF casts back to the input dtype *before* the weight multiply). Both must equal HF."""
    gen = torch.Generator().manual_seed(len(shape))
    size, eps = shape[-1], 1e-6
    ours = RMSNorm(size, eps, dtype)
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
