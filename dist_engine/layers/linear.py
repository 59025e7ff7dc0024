"""Linear layers with Hugging Face's parameter names.

Parameters are created empty (no initialisation work) because the checkpoint loader overwrites
every one of them; the loader checks that none is left unfilled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
