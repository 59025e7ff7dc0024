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
        counts, order = self._group_by_slot(slot_ids)
        sorted_out = self._grouped_swiglu(hidden[order], counts)
        if weights is not None:
            sorted_out = _scale_rows(sorted_out, weights[order])
        out = torch.empty_like(hidden)
        out[order] = sorted_out
        return out

    def add_weighted(
        self,
        out: torch.Tensor,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        slot_ids: torch.Tensor,
        weights: torch.Tensor,
    ) -> None:
        """out[rows[n]] += weights[n] * expert_{slot_ids[n]}(hidden[rows[n]]) for every n.

        out: [M, D] float32 accumulator; hidden: [M, D]; rows, slot_ids, weights: [P].
        The fused form of `forward` + `index_add_` for the dispatch path: rows are gathered once,
        already grouped by slot, and results go straight into `out` — no second gather and no
        scatter back into input order (measured: ~5% of the expert side at 1024 rows on CPU).
        Numerics are forward's: the weight is applied in float32, rounded to hidden's dtype, then
        accumulated in float32.
        """
        counts, order = self._group_by_slot(slot_ids)
        sorted_rows = rows[order]
        sorted_out = self._grouped_swiglu(hidden[sorted_rows], counts)
        scaled = _scale_rows(sorted_out, weights[order])
        out.index_add_(0, sorted_rows, scaled.float())

    def _group_by_slot(self, slot_ids: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Per-slot row counts (one host sync: the loop over slots needs ints) and the stable
        permutation that groups rows by slot."""
        counts = torch.bincount(slot_ids, minlength=self.num_slots).tolist()
        if len(counts) > self.num_slots:
            raise ValueError(
                f"slot_ids reach slot {len(counts) - 1} but this rank hosts "
                f"num_slots={self.num_slots}"
            )
        return counts, torch.argsort(slot_ids, stable=True)

    def _grouped_swiglu(self, sorted_hidden: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """sorted_hidden: [N, D] grouped by slot (`counts[s]` rows for slot s) → [N, D].

        The loop is over slots, never tokens. The down projection writes into its rows of the
        output directly (`out=`), saving a copy per slot.
        """
        sorted_out = torch.empty_like(sorted_hidden)
        start = 0
        for slot, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            gate, up = F.linear(sorted_hidden[rows], self.w13[slot]).chunk(2, dim=-1)
            torch.matmul(F.silu(gate).mul_(up), self.w2[slot].t(), out=sorted_out[rows])
            start += count
        return sorted_out


def _scale_rows(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """rows [N, D] * weights [N], multiplied in float32 and cast back to rows' dtype."""
    # For float32 rows .float() is the same tensor, so the in-place multiply saves a copy; it
    # is safe because every caller owns `rows`.
    return rows.float().mul_(weights.float().unsqueeze(1)).to(rows.dtype)
