"""RMSNorm, as Hugging Face computes it, with an optional compiled kernel for small steps.

Shape legend: T = tokens in the flat batch, D = normalised size (hidden or head dim).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NATIVE_NORM_DTYPES = (torch.float32, torch.bfloat16)  # what csrc/rms_norm.cpp takes


@dataclass(frozen=True)
class NormKernel:
    """Where the compiled RMSNorm (`kernels.compute.rms_norm`, float32 or bfloat16 on the CPU,
    weight of the input's dtype) runs: for
    steps of `min_tokens` to `max_tokens` tokens (None: no upper bound), e.g. only decode-sized
    steps when only those are faster with it. Chosen by `norm_backend` (dist_engine/backends.py).
    """

    kernel: Callable[..., torch.Tensor]
    min_tokens: int = 0
    max_tokens: int | None = None

    def serves(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
        """x: [T, ..., D]; weight: the norm's (None: of x's dtype)."""
        if x.dtype not in NATIVE_NORM_DTYPES or x.device.type != "cpu":
            return False
        if weight is not None and weight.dtype != x.dtype:
            return False
        tokens = x.shape[0]
        return tokens >= self.min_tokens and (self.max_tokens is None or tokens <= self.max_tokens)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: normalise in (at least) float32, cast back to the input
    dtype, then scale — the cast before the scale matters for bf16 parity."""

    def __init__(
        self,
        size: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device | None = None,
        kernel: NormKernel | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), False)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, ..., D] → the same shape."""
        if self.kernel is not None and self.kernel.serves(x, self.weight):
            return self.kernel.kernel(x, self.weight, self.eps)
        if x.dtype in (torch.float32, torch.float64):
            # No casts to order: torch's fused kernel gives HF's result bit for bit here (checked
            # in the layer tests) at a fraction of the cost of the five ops below.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        x_up = x.to(compute_dtype)
        variance = x_up.pow(2).mean(-1, keepdim=True)
        return self.weight * (x_up * torch.rsqrt(variance + self.eps)).to(x.dtype)
