"""Rotary position embedding, Hugging Face's conventions: default RoPE and YaRN, with the
rotated pairs either split in halves (`rotate_half`) or interleaved (DeepSeek).

Shape legend: T = tokens in the flat batch, H = heads, Dh = head dim, R = rotated dims
(Dh, or fewer with a partial rotary factor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class YarnScaling:
    """YaRN context extension (`rope_type: yarn`), as transformers computes it.

    factor: how far the context is stretched; original_max_position_embeddings: the
    pre-training context; beta_fast, beta_slow: the ramp between extrapolated and interpolated
    frequencies; mscale, mscale_all_dim (DeepSeek) or attention_factor: how cos/sin (and, for
    DeepSeek's MLA, the softmax scale) are scaled; truncate: round the ramp's ends.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def inv_freq(self, dim: int, theta: float, device: torch.device | None) -> torch.Tensor:
        """[dim / 2] float32 inverse frequencies, in transformers' float32 operation order."""
        pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        low, high = self._correction_range(dim, theta)
        if low == high:
            high += 0.001  # as transformers does, so the ramp never divides by zero
        ramp = (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)
        extrapolation_share = 1 - ramp.clamp(0, 1)
        return interpolation * (1 - extrapolation_share) + extrapolation * extrapolation_share

    def _correction_range(self, dim: int, theta: float) -> tuple[float, float]:
        def correction_dim(num_rotations: float) -> float:
            turns = self.original_max_position_embeddings / (num_rotations * 2 * math.pi)
            return (dim * math.log(turns)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by (transformers' `attention_factor`)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    def softmax_scale_factor(self) -> float:
        """DeepSeek's MLA multiplies its softmax scale by mscale(factor, mscale_all_dim)²."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables for `rotary_dim` rotated dims (`cat(freqs, freqs)`, HF's layout), with
    YaRN frequencies and cos/sin scale when `scaling` is given."""

    def __init__(
        self,
        rotary_dim: int,
        theta: float,
        device: torch.device | None = None,
        scaling: YarnScaling | None = None,
    ) -> None:
        super().__init__()
        if scaling is None:
            exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device)
            # float32 like HF, so bf16/fp16 models see the same angles as the reference.
            inv_freq = 1.0 / (theta ** (exponents / rotary_dim))
            self.cos_sin_scale = None
        else:
            inv_freq = scaling.inv_freq(rotary_dim, theta, device)
            self.cos_sin_scale = scaling.cos_sin_scale()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # cos and sin of every position below a bound, once `cache` made them: a step then
        # looks its rows up (2 ops) instead of computing them (8; 72 us of a 32-row decode
        # step on the AVX-512 host, 5 us looked up). The same values: each element is the
        # same elementwise computation either way.
        self.register_buffer("cos_table", None, persistent=False)
        self.register_buffer("sin_table", None, persistent=False)

    def cache(self, num_positions: int, dtype: torch.dtype) -> None:
        """Tabulate cos and sin in `dtype` for positions 0 .. num_positions - 1 at least (a
        model's longest context; a table already as long is kept, so one model can serve
        runners of several lengths); `cos_sin` in `dtype` then reads them from the tables, so
        every position it is given must be below the tables' length."""
        table = self.cos_table
        if table is not None and table.dtype == dtype and table.shape[0] >= num_positions:
            return
        positions = torch.arange(num_positions, device=self.inv_freq.device)
        self.cos_table, self.sin_table = self._compute(positions, dtype)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 → (cos, sin) each [T, R] in `dtype`."""
        if self.cos_table is not None and self.cos_table.dtype == dtype:
            return self.cos_table.index_select(0, positions), self.sin_table.index_select(
                0, positions
            )
        return self._compute(positions, dtype)

    def _compute(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.cos_sin_scale is not None:
            cos, sin = cos * self.cos_sin_scale, sin * self.cos_sin_scale
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, R]; cos, sin: [T, R]. Pairs are (i, i + R/2) (`rotate_half`)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, R]; cos, sin: [T, R] as `RotaryEmbedding` makes them. Pairs are (2i, 2i+1)
    (DeepSeek's layout); the result holds the rotated even lanes, then the odd ones, as
    transformers returns it. Scores are unchanged by that reordering when q and k share it."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
