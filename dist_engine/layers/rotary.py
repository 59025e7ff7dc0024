"""Rotary position embedding, Hugging Face's convention.

Shape legend: T = tokens in the flat batch, H = heads, Dh = rotated head dim.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Default RoPE: the two halves of the head dim are rotated as pairs (`rotate_half`), not
    interleaved even/odd lanes."""

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
