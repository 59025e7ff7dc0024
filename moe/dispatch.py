"""EP dispatch/combine entry points, chosen by mode, and the expert-side compute between them.

Shape legend: T = tokens on this rank, D = hidden, K = top-k, N = rows received by this rank.

The mode is the step kind (prefill → NORMAL, decode → LOW_LATENCY). The vote makes it identical
on every rank; a rank in the other mode would post collectives of different sizes and the group
would fail or hang until its timeout.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from moe.dispatch_common import ReceivedRouting, check_slot_count
from moe.dispatch_low_latency import (
    LowLatencyDispatchMeta,
    low_latency_combine,
    low_latency_dispatch,
)
from moe.dispatch_normal import NormalDispatchMeta, normal_combine, normal_dispatch
from moe.exchange import Exchange, as_exchange
from moe.experts import ExpertImpl, LocalExperts

DispatchMeta = NormalDispatchMeta | LowLatencyDispatchMeta


class DispatchMode(enum.Enum):
    NORMAL = "normal"  # prefill: exact-size uneven all-to-alls after a count exchange
    LOW_LATENCY = "low_latency"  # decode: fixed-capacity padded buffers, no count exchange


def dispatch(
    mode: DispatchMode,
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    physical_ids: torch.Tensor,
    slots_per_rank: int,
    group: dist.ProcessGroup | Exchange,
    ll_max_tokens_per_rank: int,
) -> tuple[torch.Tensor, ReceivedRouting, DispatchMeta]:
    """Send tokens to the ranks hosting their chosen slots.

    hidden: [T, D]; topk_weights: [T, K]; physical_ids: [T, K] global physical slot ids.
    group: the EP group, a process group or any `moe.exchange.Exchange`.
    Returns (recv_hidden [N, D], recv_routing with [N, K] rows, meta for `combine`).
    """
    check_slot_count(slots_per_rank)
    exchange = as_exchange(group)
    if mode is DispatchMode.NORMAL:
        return normal_dispatch(hidden, topk_weights, physical_ids, slots_per_rank, exchange)
    if mode is DispatchMode.LOW_LATENCY:
        return low_latency_dispatch(
            hidden, topk_weights, physical_ids, slots_per_rank, ll_max_tokens_per_rank, exchange
        )
    raise ValueError(f"unknown dispatch mode {mode!r}; expected one of {list(DispatchMode)}")


def combine(
    expert_out: torch.Tensor, meta: DispatchMeta, group: dist.ProcessGroup | Exchange
) -> torch.Tensor:
    """expert_out: [N, D] from `run_local_experts` → [T, D] summed per token, original order."""
    exchange = as_exchange(group)
    if isinstance(meta, NormalDispatchMeta):
        return normal_combine(expert_out, meta, exchange)
    return low_latency_combine(expert_out, meta, exchange)


def run_local_experts(
    experts: LocalExperts,
    hidden: torch.Tensor,
    routing: ReceivedRouting,
    impl: ExpertImpl | None = None,
) -> torch.Tensor:
    """Compute every (row, k) choice this rank serves and sum them per row.

    hidden: [N, D]; routing rows [N, K] with -1 for choices served elsewhere (or padding).
    Only valid choices are computed. Returns [N, D] (zero rows where nothing is served), each
    row already weighted, so one row per (token, rank) pair travels back. `impl`: see
    `LocalExperts.weighted_sum`.
    """
    return experts.weighted_sum(hidden, routing.local_slots, routing.weights, impl)
