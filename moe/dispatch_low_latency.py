"""Low-latency (decode) EP dispatch and combine: fixed-capacity, static-shape all-to-alls.

Shape legend: T = tokens on this rank, C = capacity per rank (ll_max_tokens_per_rank),
D = hidden, K = top-k, R = ranks in the EP group.

Every rank sends one [R, C, W] byte buffer — each row a token's hidden state followed by its
routing (pack_rows) — with equal splits: no count exchange, no host sync, shapes independent
of the batch (CUDA-graph friendly). Token t of this
rank always sits at row t of each destination block; its routing row there holds the local slots
it needs on that rank, or -1 everywhere (and weight 0) if it needs nothing there, as do padding
rows t >= T. Every rank must use the same C, or the equal splits disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.dispatch_common import ReceivedRouting, pack_rows, split_by_rank, unpack_rows
from moe.exchange import Exchange


@dataclass(frozen=True, eq=False)
class LowLatencyDispatchMeta:
    """What combine needs: the number of real tokens and the buffer geometry."""

    num_tokens: int
    capacity: int
    num_ranks: int
    dtype: torch.dtype


def check_capacity(num_tokens: int, capacity: int) -> None:
    """Raise before any collective, so an over-full rank fails alone and fast."""
    if num_tokens > capacity:
        raise ValueError(
            f"low-latency dispatch got T={num_tokens} tokens but ll_max_tokens_per_rank "
            f"C={capacity}; the engine must size C >= max_num_seqs"
        )


def low_latency_dispatch(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    physical_ids: torch.Tensor,
    slots_per_rank: int,
    capacity: int,
    exchange: Exchange,
) -> tuple[torch.Tensor, ReceivedRouting, LowLatencyDispatchMeta]:
    """Scatter tokens into padded per-rank blocks and exchange them.

    hidden: [T, D]; topk_weights: [T, K]; physical_ids: [T, K] global physical slot ids; T <= C.
    Returns (recv_hidden [R * C, D], recv_routing with [R * C, K] rows, meta). Received block s
    (rows s*C .. s*C + C) comes from rank s.
    """
    num_tokens, hidden_size = hidden.shape
    check_capacity(num_tokens, capacity)
    num_ranks = exchange.size
    top_k = physical_ids.shape[1]
    device = hidden.device
    dest_rank, local_slot = split_by_rank(physical_ids, slots_per_rank)

    # Every block gets every token: the copy is what keeps shapes static; rows a rank does not
    # need carry slot -1 and are never computed there.
    send_hidden = hidden.new_zeros(num_ranks, capacity, hidden_size)
    send_hidden[:, :num_tokens] = hidden
    ranks = torch.arange(num_ranks, device=device).view(num_ranks, 1, 1)
    on_rank = dest_rank.unsqueeze(0) == ranks  # [R, T, K]
    send_slots = torch.full((num_ranks, capacity, top_k), -1, dtype=torch.int64, device=device)
    send_slots[:, :num_tokens] = torch.where(on_rank, local_slot.unsqueeze(0), -1)
    send_weights = torch.zeros(num_ranks, capacity, top_k, dtype=torch.float32, device=device)
    send_weights[:, :num_tokens] = torch.where(on_rank, topk_weights.float().unsqueeze(0), 0.0)

    send = pack_rows(send_hidden, send_slots, send_weights)  # [R, C, W]
    recv = torch.empty_like(send)
    exchange.all_to_all_single(recv, send)

    meta = LowLatencyDispatchMeta(
        num_tokens=num_tokens, capacity=capacity, num_ranks=num_ranks, dtype=hidden.dtype
    )
    recv_hidden, recv_routing = unpack_rows(
        recv.view(num_ranks * capacity, -1), hidden_size, hidden.dtype
    )
    return recv_hidden, recv_routing, meta


def low_latency_combine(
    expert_out: torch.Tensor, meta: LowLatencyDispatchMeta, exchange: Exchange
) -> torch.Tensor:
    """Send each block of weighted expert rows back and sum the R partial results per token.

    expert_out: [R * C, D], zero in rows with no local choice. Returns [T, D] in hidden's dtype.
    """
    hidden_size = expert_out.shape[1]
    assert expert_out.shape[0] == meta.num_ranks * meta.capacity, (expert_out.shape, meta)
    returned = torch.empty_like(expert_out)
    exchange.all_to_all_single(returned, expert_out)
    blocks = returned.view(meta.num_ranks, meta.capacity, hidden_size)[:, : meta.num_tokens]
    return blocks.float().sum(dim=0).to(meta.dtype)
