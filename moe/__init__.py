"""Mixture-of-Experts: routing, local experts, expert placement and its load balancing (EPLB),
EP dispatch/combine.

Knows nothing of scheduling; never imports `scheduler`, `dist_engine` or `launcher`.
"""

from moe.dispatch import DispatchMeta, DispatchMode, combine, dispatch, run_local_experts
from moe.dispatch_common import ReceivedRouting
from moe.dispatch_low_latency import LowLatencyDispatchMeta
from moe.dispatch_normal import NormalDispatchMeta
from moe.eplb import (
    ExpertLoadWindow,
    RebalanceResult,
    balancedness,
    rank_loads,
    rebalance,
    rebalance_gain,
    worth_adopting,
)
from moe.exchange import Exchange, GroupExchange, Unjoined
from moe.experts import (
    ExpertImpl,
    LocalExperts,
    fill_expert,
    grouped_mm_weighted_sum,
    torch_weighted_sum,
)
from moe.layer import MoELayer, StagedPlacement, dense_reference_moe
from moe.placement import (
    ExpertPlacement,
    ExpertTransfer,
    ReshardMoves,
    SlotMoves,
    choose_replicas,
    keep_hosted_slots,
    plan_transfers,
    reshard_moves,
    shrink_placement,
    slot_moves,
)
from moe.routing import (
    SOFTMAX_TOPK,
    RoutingMethod,
    RoutingResult,
    sigmoid_grouped_topk,
    softmax_grouped_topk,
    softmax_topk,
)

__all__ = [
    "SOFTMAX_TOPK",
    "DispatchMeta",
    "DispatchMode",
    "Exchange",
    "ExpertImpl",
    "ExpertLoadWindow",
    "ExpertPlacement",
    "ExpertTransfer",
    "GroupExchange",
    "LocalExperts",
    "LowLatencyDispatchMeta",
    "MoELayer",
    "NormalDispatchMeta",
    "RebalanceResult",
    "ReceivedRouting",
    "ReshardMoves",
    "RoutingMethod",
    "RoutingResult",
    "SlotMoves",
    "StagedPlacement",
    "Unjoined",
    "balancedness",
    "choose_replicas",
    "combine",
    "dense_reference_moe",
    "dispatch",
    "fill_expert",
    "grouped_mm_weighted_sum",
    "keep_hosted_slots",
    "plan_transfers",
    "rank_loads",
    "rebalance",
    "rebalance_gain",
    "reshard_moves",
    "run_local_experts",
    "shrink_placement",
    "sigmoid_grouped_topk",
    "slot_moves",
    "softmax_grouped_topk",
    "softmax_topk",
    "torch_weighted_sum",
    "worth_adopting",
]
