"""Small building blocks of the decoder: RMSNorm, rotary embedding, dense SwiGLU MLP.

Shape legend: T = tokens in the flat batch, D = hidden, H = heads, Dh = head dim, F = dense MLP
intermediate size.

Parameters are created empty (no initialisation work) because the checkpoint loader overwrites
every one of them; the loader checks that none is left unfilled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dist_engine.kernels import build as native


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """`y = x W^T (+ b)` with HF's parameter names (`weight [out, in]`, `bias [out]`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.weight = empty_parameter(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, as HF computes it: normalise in (at least) float32, cast back
    to the input dtype, then scale — the cast before the scale matters for bf16 parity."""

    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(size, dtype=dtype, device=device)
        # The one-pass CPU kernel for float32 (dist_engine.native), where it builds.
        self.native: Callable[..., torch.Tensor] | None = None
        if dtype == torch.float32 and (device is None or torch.device(device).type == "cpu"):
            self.native = native.rms_norm_kernel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            return self.native(x, self.weight, self.eps)
        if x.dtype in (torch.float32, torch.float64):
            # No casts to order: torch's fused kernel gives HF's result bit for bit here (checked
            # in tests/test_layers.py) at a fraction of the cost of the five ops below (10x on a
            # [2048, 256] prefill batch on CPU).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        x_up = x.to(compute_dtype)
        variance = x_up.pow(2).mean(-1, keepdim=True)
        return self.weight * (x_up * torch.rsqrt(variance + self.eps)).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE, HF convention: the two halves of the head dim are rotated as pairs
    (`rotate_half`), not interleaved even/odd lanes."""

    def __init__(self, head_dim: int, theta: float, device: torch.device | None = None) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        # float32 like HF, so bf16/fp16 models see the same angles as the reference.
        self.register_buffer("inv_freq", 1.0 / (theta**exponents), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 → (cos, sin) each [T, Dh] in `dtype`."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, Dh]; cos, sin: [T, Dh]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class DenseMLP(nn.Module):
    """SwiGLU MLP of the layers that are not MoE (Qwen3-MoE `mlp_only_layers`)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, False, dtype, device)
        self.up_proj = Linear(hidden_size, intermediate_size, False, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] → [T, D]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
