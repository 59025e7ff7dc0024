"""The sparse MLP of an MoE decoder layer: router, then the `moe.MoELayer` experts.

Shape legend: T = tokens in the flat batch, D = hidden, E = logical experts, K = top-k.

The model code stays single-device: expert parallelism enters only through the
`ExpertParallelContext` handed to the model (placement, this rank, the EP process group), which
the `MoELayer` uses to dispatch tokens to the ranks hosting their experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dist_engine.kernels import build as native
from dist_engine.layers.basic import Linear
from dist_engine.models.config import ModelConfig
from moe import DispatchMode, ExpertPlacement, MoELayer, softmax_topk


@dataclass(frozen=True)
class ExpertParallelContext:
    """Where this rank sits in the EP group. The default is a single process hosting all
    experts (`placement=None` means `ExpertPlacement.even(num_experts, 1)`)."""

    placement: ExpertPlacement | None = None
    rank: int = 0
    # A torch.distributed ProcessGroup or a moe.exchange.Exchange; None = single process.
    group: object | None = None
    ll_max_tokens_per_rank: int = 256

    def resolve_placement(self, num_experts: int) -> ExpertPlacement:
        if self.placement is None:
            return ExpertPlacement.even(num_experts, 1)
        if self.placement.num_experts != num_experts:
            raise ValueError(
                f"expert placement covers {self.placement.num_experts} experts but the model "
                f"has {num_experts}"
            )
        return self.placement


class MoEBlock(nn.Module):
    """Router Linear → softmax top-k → `MoELayer`. HF names: `gate.weight`, `experts`."""

    def __init__(
        self,
        config: ModelConfig,
        context: ExpertParallelContext,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.renormalize = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, False, dtype, device)
        self.experts = MoELayer(
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            context.resolve_placement(config.num_experts),
            rank=context.rank,
            group=context.group,
            dtype=dtype,
            ll_max_tokens_per_rank=context.ll_max_tokens_per_rank,
        )
        if dtype == torch.float32 and (device is None or torch.device(device).type == "cpu"):
            # The compiled SwiGLU expert kernel, where it builds (else the PyTorch paths).
            self.experts.experts.native_swiglu = native.swiglu_kernel()

    def forward(self, hidden: torch.Tensor, mode: DispatchMode) -> torch.Tensor:
        """hidden: [T, D] → [T, D]. Always enters the MoE layer, even with T = 0, because in
        EP the layer is a collective every rank must join."""
        routing = softmax_topk(self.gate(hidden), self.top_k, self.renormalize)
        return self.experts.forward(hidden, routing.topk_weights, routing.topk_ids, mode)
