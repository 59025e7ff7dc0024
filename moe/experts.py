"""The SwiGLU experts one rank hosts, computed grouped by slot.

Shape legend: N = token rows handed to the experts, S = local physical slots, D = hidden,
I = expert intermediate size, C = padded rows per slot.

Weights are stored input-major (`x @ w`), the transpose of the Hugging Face layout:
w13[s] = [D, gate columns | up columns], w2[s] = [I, D]. Weights are transposed once, at load
(`LocalExperts.load_slot`); in exchange every expert GEMM reads its weight in the layout MKL's
batched and plain GEMMs stream fastest (faster than the same calls on the HF layout, most for
a decode-sized padded `bmm`: docs/benchmark_notes.md, "MoE layer").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import torch
import torch.nn.functional as F
from torch import nn

# The padded batched path runs one `bmm` per projection over every slot, padding each slot's
# rows to the largest group (C). With 2 torch threads it beats the per-slot loop at a few to a
# few dozen rows per slot, because one batched GEMM spreads the slots over the threads while a
# GEMM of a few rows does not parallelise; at 128 rows per slot the loop wins. With 1 thread
# neither wins clearly and the loop never computes padding, so it is kept (the measurements:
# docs/benchmark_notes.md, "MoE layer"). Hence: padded only with more than one thread (or on an
# accelerator, where each loop step is a kernel launch), and only while the padding adds at
# most PADDED_SLACK_ROWS rows per slot over the real rows.
PADDED_SLACK_ROWS = 16

# Another implementation of `LocalExperts.weighted_sum`: `(experts, hidden [N, D],
# local_slots [N, K], weights [N, K]) -> [N, D]`, with `torch_weighted_sum`'s results (to
# float32 rounding). The runtime plugs in a compiled CPU kernel this way (per dispatch mode,
# see `MoELayer.set_expert_impl`); None means the PyTorch path below.
ExpertImpl: TypeAlias = Callable[
    ["LocalExperts", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


class LocalExperts(nn.Module):
    """SwiGLU experts for the S physical slots hosted on this rank.

    w13: [S, D, 2I] — gate_proj then up_proj, input-major (HF's [2I, D] transposed).
    w2:  [S, I, D]  — down_proj, input-major (HF's [D, I] transposed).
    Weights start at zero, on `device` (None: torch's default, the CPU); the checkpoint
    loader fills them through `MoELayer.load_expert`.
    """

    def __init__(
        self,
        num_slots: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
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
            torch.zeros(num_slots, hidden_size, 2 * intermediate_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.zeros(num_slots, intermediate_size, hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )

    @torch.no_grad()
    def load_slot(
        self, slot: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
    ) -> None:
        """Fill one slot from HF-layout weights: gate, up [I, D]; down [D, I]."""
        fill_expert(self.w13[slot], self.w2[slot], gate, up, down)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot's weights (w13 and w2)."""
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()

    @torch.no_grad()
    def write_slots(
        self,
        slots: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        copy_to: torch.Tensor,
        copy_from: torch.Tensor,
    ) -> None:
        """Replace the weights of some slots in place: `slots` [M] from `w13` [M, D, 2I] and
        `w2` [M, I, D] (input-major, as `fill_expert` writes them), then `copy_to` [C] from
        `copy_from` [C] (local slots whose weights do not change here). Index tensors are
        int64 on the weights' device; the parameters stay the same tensors, so whatever holds
        them (an expert implementation, a compiled graph) sees the new weights."""
        if slots.numel():
            self.w13.index_copy_(0, slots, w13)
            self.w2.index_copy_(0, slots, w2)
        if copy_to.numel():
            self.w13.index_copy_(0, copy_to, self.w13.index_select(0, copy_from))
            self.w2.index_copy_(0, copy_to, self.w2.index_select(0, copy_from))

    def forward(
        self,
        hidden: torch.Tensor,
        slot_ids: torch.Tensor,
        weights: torch.Tensor | None = None,
        impl: ExpertImpl | None = None,
    ) -> torch.Tensor:
        """Run each row through the expert in its slot.

        hidden:   [N, D]
        slot_ids: [N] int64 local slot index in [0, S).
        weights:  [N] or None — multiplies each output row (in float32, then cast back).
        impl:     another implementation (see `ExpertImpl`), used as `weighted_sum` with K = 1.
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
        if impl is not None:  # its contract, with K = 1
            scale = torch.ones(num_rows) if weights is None else weights
            return impl(self, hidden, slot_ids.reshape(-1, 1), scale.reshape(-1, 1))
        counts, order = self._group_by_slot(slot_ids)
        sorted_out = self._grouped_swiglu(hidden.index_select(0, order), slot_ids[order], counts)
        if weights is not None:
            sorted_out = _scale_rows(sorted_out, weights[order])
        out = torch.empty_like(hidden)
        out[order] = sorted_out
        return out

    def weighted_sum(
        self,
        hidden: torch.Tensor,
        local_slots: torch.Tensor,
        weights: torch.Tensor,
        impl: ExpertImpl | None = None,
    ) -> torch.Tensor:
        """out[n] = sum_k weights[n, k] * expert_{local_slots[n, k]}(hidden[n]): the expert side
        of a dispatch, every choice this rank serves summed per row.

        hidden: [N, D]; local_slots: [N, K] int64, -1 for choices served elsewhere (and
        padding rows); weights: [N, K]. Returns [N, D] in hidden's dtype, zero rows where
        nothing is served. Numerics are `add_weighted`'s, summed in float32. `impl`: another
        implementation of this contract (`ExpertImpl`); None runs `torch_weighted_sum`.
        """
        if impl is not None:
            return impl(self, hidden, local_slots, weights)
        return torch_weighted_sum(self, hidden, local_slots, weights)

    def torch_weighted_sum(
        self, hidden: torch.Tensor, local_slots: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """`weighted_sum` in PyTorch ops: the choices grouped by slot, one GEMM pair per slot
        (or one padded `bmm` per projection, see PADDED_SLACK_ROWS)."""
        row, choice = (local_slots >= 0).nonzero(as_tuple=True)
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        self.add_weighted(out, hidden, row, local_slots[row, choice], weights[row, choice])
        return out.to(hidden.dtype)

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
        scatter back into input order (a few percent of the expert side on CPU:
        docs/benchmark_notes.md, "MoE layer").
        Numerics are forward's: the weight is applied in float32, rounded to hidden's dtype, then
        accumulated in float32.
        """
        counts, order = self._group_by_slot(slot_ids)
        sorted_rows = rows[order]
        sorted_hidden = hidden.index_select(0, sorted_rows)  # far faster than hidden[sorted_rows]
        sorted_out = self._grouped_swiglu(sorted_hidden, slot_ids[order], counts)
        scaled = _scale_rows(sorted_out, weights[order])
        out.index_add_(0, sorted_rows, scaled.float())

    def _group_by_slot(self, slot_ids: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Per-slot row counts (one host sync: the path choice and the loop need ints) and the
        stable permutation that groups rows by slot."""
        counts = torch.bincount(slot_ids, minlength=self.num_slots).tolist()
        if len(counts) > self.num_slots:
            raise ValueError(
                f"slot_ids reach slot {len(counts) - 1} but this rank hosts "
                f"num_slots={self.num_slots}"
            )
        return counts, torch.argsort(slot_ids, stable=True)

    def _grouped_swiglu(
        self, sorted_hidden: torch.Tensor, sorted_slots: torch.Tensor, counts: list[int]
    ) -> torch.Tensor:
        """sorted_hidden: [N, D] grouped by slot (`counts[s]` rows for slot s, `sorted_slots`
        naming each row's slot) → [N, D], same row order."""
        largest = max(counts, default=0)
        parallel = sorted_hidden.device.type != "cpu" or torch.get_num_threads() > 1
        slack = PADDED_SLACK_ROWS * self.num_slots
        if parallel and 0 < largest * self.num_slots <= sorted_hidden.shape[0] + slack:
            return self._padded_swiglu(sorted_hidden, sorted_slots, counts, largest)
        return self._looped_swiglu(sorted_hidden, counts)

    def _looped_swiglu(self, sorted_hidden: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One GEMM pair per non-empty slot; the loop is over slots, never tokens. The down
        projection writes into its rows of the output directly (`out=`)."""
        sorted_out = torch.empty_like(sorted_hidden)
        start = 0
        for slot, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            gate_up = torch.mm(sorted_hidden[rows], self.w13[slot])
            torch.mm(_swiglu(gate_up, self.intermediate_size), self.w2[slot], out=sorted_out[rows])
            start += count
        return sorted_out

    def _padded_swiglu(
        self,
        sorted_hidden: torch.Tensor,
        sorted_slots: torch.Tensor,
        counts: list[int],
        capacity: int,
    ) -> torch.Tensor:
        """Every slot's rows padded to `capacity` (C) with zeros, then one `bmm` per projection
        over all S slots: [S, C, D] @ [S, D, 2I] and [S, C, I] @ [S, I, D]. Padding rows are
        computed and dropped; real rows come back in `sorted_hidden`'s order."""
        starts, start = [], 0
        for count in counts:
            starts.append(start)
            start += count
        first_row = torch.tensor(starts, dtype=torch.int64, device=sorted_hidden.device)
        row_in_slot = torch.arange(sorted_hidden.shape[0], device=sorted_hidden.device)
        row_in_slot -= first_row[sorted_slots]
        padded_row = sorted_slots * capacity + row_in_slot  # [N] row of the padded buffer
        size_d = self.hidden_size
        padded = sorted_hidden.new_zeros(self.num_slots * capacity, size_d)
        padded.index_copy_(0, padded_row, sorted_hidden)
        gate_up = torch.bmm(padded.view(self.num_slots, capacity, size_d), self.w13)
        down = torch.bmm(_swiglu(gate_up, self.intermediate_size), self.w2)
        return down.view(-1, size_d).index_select(0, padded_row)


def torch_weighted_sum(
    experts: LocalExperts, hidden: torch.Tensor, local_slots: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The PyTorch implementation of `LocalExperts.weighted_sum` (an `ExpertImpl`)."""
    return experts.torch_weighted_sum(hidden, local_slots, weights)


def grouped_mm_weighted_sum(
    experts: LocalExperts, hidden: torch.Tensor, local_slots: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """`LocalExperts.weighted_sum` as one `torch.nn.functional.grouped_mm` per projection over
    every local slot (an `ExpertImpl`): the op a GPU wants, and on the CPU another candidate
    for `expert_backend: auto` to time.

    The (row, choice) pairs are sorted by slot (choices served elsewhere, -1, go last and are
    masked out), so no padding is computed and nothing syncs with the host: the group sizes
    are counted on the device (`count_per_slot`) and stay there as the `offs` of the grouped
    GEMMs, so a decode step through this path can be compiled whole or captured.
    hidden: [N, D]; local_slots, weights: [N, K] → [N, D] in hidden's dtype.
    """
    top_k = local_slots.shape[1]
    num_slots = experts.num_slots
    flat = local_slots.reshape(-1)
    served = flat >= 0
    keyed = torch.where(served, flat, num_slots)  # not served: after every slot
    order = torch.argsort(keyed, stable=True)
    offs = torch.cumsum(count_per_slot(keyed, num_slots + 1)[:num_slots], 0).to(torch.int32)
    rows = torch.div(order, top_k, rounding_mode="floor")
    sorted_hidden = hidden.index_select(0, rows)
    gate_up = F.grouped_mm(sorted_hidden, experts.w13, offs=offs)  # [P, 2I]
    down = F.grouped_mm(_swiglu(gate_up, experts.intermediate_size), experts.w2, offs=offs)
    # Rows past the last group (choices not served here) are left undefined by grouped_mm:
    # `where`, not a product with a zero weight, so a NaN there cannot leak into the sum.
    keep = served[order].unsqueeze(1)
    scaled = torch.where(keep, _scale_rows(down, weights.reshape(-1)[order]).float(), 0.0)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    out.index_add_(0, rows, scaled)
    return out.to(hidden.dtype)


def count_per_slot(slot_ids: torch.Tensor, num_slots: int) -> torch.Tensor:
    """slot_ids: [P] int64 in [0, num_slots) → [num_slots] int64 rows per slot, on the device.

    `torch.bincount` gives the same counts but sizes its output from the largest id, which
    the host must read first: a device sync on a GPU, and an op a captured or compiled graph
    cannot hold. A scatter into a tensor of known size needs neither.
    """
    counts = torch.zeros(num_slots, dtype=torch.int64, device=slot_ids.device)
    return counts.scatter_add_(0, slot_ids, torch.ones_like(slot_ids))


@torch.no_grad()
def fill_expert(
    w13: torch.Tensor, w2: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> None:
    """Write one expert's HF-layout weights (gate, up [I, D]; down [D, I]) input-major into
    w13 [D, 2I] (gate columns, then up) and w2 [I, D], converting to their dtype."""
    size_i = gate.shape[0]
    w13[:, :size_i].copy_(gate.t())
    w13[:, size_i:].copy_(up.t())
    w2.copy_(down.t())


def _swiglu(gate_up: torch.Tensor, size_i: int) -> torch.Tensor:
    """[..., 2I] (gate | up) → silu(gate) * up, [..., I]."""
    return F.silu(gate_up[..., :size_i]).mul_(gate_up[..., size_i:])


def _scale_rows(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """rows [N, D] * weights [N], multiplied in float32 and cast back to rows' dtype."""
    # For float32 rows .float() is the same tensor, so the in-place multiply saves a copy; it
    # is safe because every caller owns `rows`.
    return rows.float().mul_(weights.float().unsqueeze(1)).to(rows.dtype)
