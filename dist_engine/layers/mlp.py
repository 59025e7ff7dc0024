"""The dense SwiGLU MLP of decoder layers that are not MoE.

Shape legend: T = tokens in the flat batch, D = hidden, F = intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dist_engine.layers.linear import Linear


class DenseMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with HF's names (`gate_proj`, `up_proj`, `down_proj`)."""

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
