"""The SwiGLU experts one rank hosts, computed grouped by slot.

Shape legend: N = token rows handed to the experts, S = local physical slots, D = hidden,
I = expert intermediate size.

Weight layout follows the Hugging Face fused layout (`gate_up_proj` / `down_proj`), so a
checkpoint row block copies in without transposes: w13[s] = [gate rows; up rows].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LocalExperts(nn.Module):
    """SwiGLU experts for the S physical slots hosted on this rank.

    w13: [S, 2I, D] — gate_proj rows then up_proj rows.
    w2:  [S, D, I]  — down_proj.
    Weights start at zero; the checkpoint loader fills them through `MoELayer.load_expert`.
    """

    def __init__(
        self,
        num_slots: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if num_slots < 0 or hidden_size < 1 or intermediate_size < 1:
            raise ValueError(
                f"need num_slots >= 0 and positive sizes, got num_slots={num_slots}, "
                f"hidden_size={hidden_size}, intermediate_size={intermediate_size}"
            )
        self.num_slots = num_slots
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(
            torch.zeros(num_slots, 2 * intermediate_size, hidden_size, dtype=dtype),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.zeros(num_slots, hidden_size, intermediate_size, dtype=dtype),
            requires_grad=False,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        slot_ids: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run each row through the expert in its slot.

        hidden:   [N, D]
        slot_ids: [N] int64 local slot index in [0, S).
        weights:  [N] or None — multiplies each output row (in float32, then cast back).
        Returns [N, D] in hidden's dtype, rows in the input order.
        """
        num_rows = hidden.shape[0]
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(
                f"hidden must be [N, D={self.hidden_size}], got shape {tuple(hidden.shape)}"
            )
        if slot_ids.shape != (num_rows,) or (weights is not None and weights.shape != (num_rows,)):
            raise ValueError(
                f"slot_ids and weights must be [N={num_rows}], got slot_ids "
                f"{tuple(slot_ids.shape)}, weights "
                f"{None if weights is None else tuple(weights.shape)}"
            )
        # One host sync for the per-slot counts: the loop below is over slots, never tokens.
        counts = torch.bincount(slot_ids, minlength=self.num_slots).tolist()
        if len(counts) > self.num_slots:
            raise ValueError(
                f"slot_ids reach slot {len(counts) - 1} but this rank hosts "
                f"num_slots={self.num_slots}"
            )
        order = torch.argsort(slot_ids, stable=True)
        sorted_hidden = hidden[order]
        sorted_out = torch.empty_like(hidden)
        start = 0
        for slot, count in enumerate(counts):
            if count == 0:
                continue
            rows = sorted_hidden[start : start + count]
            gate, up = F.linear(rows, self.w13[slot]).chunk(2, dim=-1)
            sorted_out[start : start + count] = F.linear(F.silu(gate) * up, self.w2[slot])
            start += count
        if weights is not None:
            scaled = sorted_out.float() * weights[order].float().unsqueeze(1)
            sorted_out = scaled.to(hidden.dtype)
        out = torch.empty_like(hidden)
        out[order] = sorted_out
        return out
