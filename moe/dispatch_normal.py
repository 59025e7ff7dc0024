"""Normal-mode (prefill) EP dispatch and combine: exact-size uneven all-to-alls.

Shape legend: T = tokens on this rank, D = hidden, K = top-k, R = ranks in the EP group,
M = (token, destination rank) pairs this rank sends, N = rows this rank receives.

Protocol, identical on every rank (a rank with T = 0 takes part with empty sends):
  1. a token bound for several experts on one rank becomes ONE (token, rank) pair, carrying a
     K-wide row of local slots (-1 where that choice lives elsewhere) and weights;
  2. all_to_all_single of the per-destination pair counts (R int64s);
  3. ONE all_to_all_single with uneven splits of byte rows: each hidden row followed by its
     routing (pack_rows), so rows and metadata need no second collective;
  4. the caller runs its local experts, summing each row's weighted choices (one row back per pair);
  5. the reverse all_to_all_single, and index_add_ of the returned rows into token order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.dispatch_common import ReceivedRouting, pack_rows, split_by_rank, unpack_rows
from moe.exchange import Exchange


@dataclass(frozen=True, eq=False)
class NormalDispatchMeta:
    """What combine needs to route expert outputs home.

    pair_token:  [M] int64 — source token of each sent row; rows are grouped by destination rank.
    send_splits: rows sent to each rank (len R); recv_splits: rows received from each rank.
    """

    pair_token: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    num_tokens: int
    dtype: torch.dtype


def normal_dispatch(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    physical_ids: torch.Tensor,
    slots_per_rank: int,
    exchange: Exchange,
) -> tuple[torch.Tensor, ReceivedRouting, NormalDispatchMeta]:
    """Send each token once to every rank that hosts one of its chosen physical slots.

    hidden: [T, D]; topk_weights: [T, K]; physical_ids: [T, K] global physical slot ids.
    Returns (recv_hidden [N, D], recv_routing with [N, K] rows, meta for normal_combine).
    """
    num_ranks = exchange.size
    num_tokens, hidden_size = hidden.shape
    device = hidden.device
    dest_rank, local_slot = split_by_rank(physical_ids, slots_per_rank)

    goes_to = torch.zeros(num_tokens, num_ranks, dtype=torch.bool, device=device)
    goes_to.scatter_(1, dest_rank, True)
    # nonzero on the transpose yields pairs sorted by destination rank, then token: exactly the
    # contiguous-per-destination layout all_to_all_single expects.
    pair_rank, pair_token = goes_to.t().nonzero(as_tuple=True)
    on_pair_rank = dest_rank[pair_token] == pair_rank.unsqueeze(1)  # [M, K]
    send_slots = torch.where(on_pair_rank, local_slot[pair_token], -1)
    send_weights = torch.where(on_pair_rank, topk_weights[pair_token].float(), 0.0)

    send_counts = torch.bincount(pair_rank, minlength=num_ranks)
    recv_counts = torch.empty_like(send_counts)
    exchange.all_to_all_single(recv_counts, send_counts)
    # The only host sync: split sizes must be Python ints (NCCL needs them on host too).
    send_splits, recv_splits = (tuple(s) for s in torch.stack([send_counts, recv_counts]).tolist())
    num_recv = sum(recv_splits)

    # index_select, not hidden[pair_token]: the advanced-indexing gather is several times slower
    # on CPU (docs/benchmark_notes.md, "MoE layer").
    send = pack_rows(hidden.index_select(0, pair_token), send_slots, send_weights)  # [M, W]
    recv = send.new_empty(num_recv, send.shape[1])
    exchange.all_to_all_single(recv, send, list(recv_splits), list(send_splits))
    recv_hidden, recv_routing = unpack_rows(recv, hidden_size, hidden.dtype)
    meta = NormalDispatchMeta(
        pair_token=pair_token,
        send_splits=send_splits,
        recv_splits=recv_splits,
        num_tokens=num_tokens,
        dtype=hidden.dtype,
    )
    return recv_hidden, recv_routing, meta


def normal_combine(
    expert_out: torch.Tensor, meta: NormalDispatchMeta, exchange: Exchange
) -> torch.Tensor:
    """Return expert rows to their source ranks and sum them per token.

    expert_out: [N, D] — one already-weighted row per received row, in receive order.
    Returns [T, D] in the original token order and dtype; tokens sent nowhere (impossible when
    every token has K >= 1 choices) would stay zero.
    """
    hidden_size = expert_out.shape[1]
    assert expert_out.shape[0] == sum(meta.recv_splits), (expert_out.shape, meta.recv_splits)
    returned = expert_out.new_empty(sum(meta.send_splits), hidden_size)
    exchange.all_to_all_single(returned, expert_out, list(meta.send_splits), list(meta.recv_splits))
    # Accumulate in float32: a token's partial sums from several ranks meet here.
    out = torch.zeros(meta.num_tokens, hidden_size, dtype=torch.float32, device=expert_out.device)
    out.index_add_(0, meta.pair_token, returned.float())
    return out.to(meta.dtype)
