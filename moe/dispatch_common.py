"""Pieces shared by both dispatch modes: the routing rows a rank receives, and their transport.

Shape legend: T = tokens, K = top-k, P = physical slots, S = slots per rank, N = received rows,
R = ranks in the EP group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Slot ids travel as float32 (see pack_routing); float32 holds every integer below 2**24 exactly.
_MAX_EXACT_FLOAT32_INT = 2**24


@dataclass(frozen=True, eq=False)
class ReceivedRouting:
    """What the expert side needs for each received row.

    local_slots: [N, K] int64 — local slot index on this rank, -1 where that k-choice is served
        by another rank (and for padding rows in low-latency mode).
    weights:     [N, K] float32 — combine weight, 0 wherever local_slots is -1.
    """

    local_slots: torch.Tensor
    weights: torch.Tensor

    def __post_init__(self) -> None:
        assert self.local_slots.shape == self.weights.shape, (
            self.local_slots.shape,
            self.weights.shape,
        )


def split_by_rank(physical_ids: torch.Tensor, slots_per_rank: int) -> tuple[torch.Tensor, ...]:
    """physical_ids: [T, K] → (destination rank [T, K], local slot on that rank [T, K])."""
    return physical_ids // slots_per_rank, physical_ids % slots_per_rank


def pack_routing(local_slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[..., K] slots + [..., K] weights → one [..., 2K] float32 tensor.

    Slot ids are small integers, exact in float32; see pack_rows for why they travel together.
    """
    return torch.cat([local_slots.to(torch.float32), weights.to(torch.float32)], dim=-1)


def unpack_routing(packed: torch.Tensor) -> ReceivedRouting:
    """Inverse of pack_routing on [N, 2K] rows."""
    top_k = packed.shape[-1] // 2
    return ReceivedRouting(
        local_slots=packed[..., :top_k].to(torch.int64),
        weights=packed[..., top_k:].contiguous(),
    )


def pack_rows(
    hidden: torch.Tensor, local_slots: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """[..., D] hidden rows + their [..., K] routing → one [..., D·e + 8K] uint8 row each.

    Why bytes: each all-to-all is a latency-bound collective (on gloo a fixed cost per call
    that a few more bytes hardly change, docs/benchmark_notes.md, "MoE layer"; a launch plus a
    sync on NCCL) and the routing is tiny, so a row and its routing travel in one collective
    whatever the hidden dtype (e = its element size). Reinterpreting is free; only the
    concatenation copies.
    """
    routing = pack_routing(local_slots, weights)
    return torch.cat([hidden.contiguous().view(torch.uint8), routing.view(torch.uint8)], dim=-1)


def unpack_rows(
    packed: torch.Tensor, hidden_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ReceivedRouting]:
    """Inverse of pack_rows on [N, W] byte rows → (hidden [N, D] of ``dtype``, routing).

    hidden is a view into ``packed`` (row stride W bytes), not a copy: the expert side gathers
    rows by slot anyway. W is a multiple of the element size, so the view is always valid.
    """
    width = hidden_size * torch.empty((), dtype=dtype).element_size()
    hidden = packed[:, :width].view(dtype)
    routing = packed[:, width:].contiguous().view(torch.float32)
    return hidden, unpack_routing(routing)


def check_slot_count(slots_per_rank: int) -> None:
    """Slot ids must survive the float32 round trip of pack_routing."""
    if slots_per_rank >= _MAX_EXACT_FLOAT32_INT:
        raise ValueError(
            f"slots_per_rank={slots_per_rank} too large to send as float32 "
            f"(limit {_MAX_EXACT_FLOAT32_INT})"
        )
