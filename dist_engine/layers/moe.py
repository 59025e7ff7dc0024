"""The sparse MLP of an MoE decoder layer: router, then the `moe.MoELayer` experts.

Shape legend: T = tokens in the flat batch, D = hidden, E = logical experts, K = top-k,
N = rows on the expert side, I = expert intermediate size.

The model code stays single-device: expert parallelism enters only through the
`ExpertParallelContext` handed to the model (placement, this rank, the EP process group), which
the `MoELayer` uses to dispatch tokens to the ranks hosting their experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dist_engine.layers.linear import Linear, empty_parameter
from moe import (
    DispatchMode,
    ExpertImpl,
    ExpertPlacement,
    LocalExperts,
    MoELayer,
    RoutingMethod,
    grouped_mm_weighted_sum,
)
from moe.experts import torch_weighted_sum
from moe.routing import SOFTMAX_TOPK


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


NATIVE_EXPERT_DTYPES = (torch.float32, torch.bfloat16)  # what csrc/grouped_swiglu.cpp takes


class NativeExperts:
    """The `native` expert backend: `kernels.compute.routed_swiglu` (an `moe.ExpertImpl`).

    The whole expert side in one call: a counting sort of the (row, choice) pairs by slot,
    per slot its rows gathered in chunks, two register-blocked GEMMs with silu between, every
    row's pairs summed in k order; no padding. float32, or bfloat16 (bf16 pair products summed
    in float32 where the processor has AVX512_BF16, else widened to float32), on the CPU;
    anything else goes through PyTorch's path (`moe.torch_weighted_sum`).
    """

    name = "native"

    def __init__(self, kernel: Callable[..., torch.Tensor]) -> None:
        self.kernel = kernel

    def __call__(
        self,
        experts: LocalExperts,
        hidden: torch.Tensor,
        local_slots: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        """hidden: [N, D]; local_slots, weights: [N, K] → [N, D]."""
        if (
            hidden.device.type != "cpu"
            or hidden.dtype not in NATIVE_EXPERT_DTYPES
            or experts.w13.dtype != hidden.dtype
        ):
            return torch_weighted_sum(experts, hidden, local_slots, weights)
        if hidden.stride(-1) != 1:
            hidden = hidden.contiguous()
        return self.kernel(
            hidden, local_slots.contiguous(), weights.float().contiguous(), experts.w13, experts.w2
        )


class MoEBlock(nn.Module):
    """Router → routing (`routing`: softmax top-k by default) → `MoELayer`, plus shared
    experts when given. HF names: `gate.weight` (+ `gate.e_score_correction_bias`), `experts`,
    `shared_experts` (+ `shared_expert_gate.weight`).

    Shared experts run on the rank that holds the token, on every token, and are added to
    the combined routed output: they are dense, so sending their rows over EP would buy
    nothing. `router_dtype`: the router's weight and logits (DeepSeek keeps them in float32
    whatever the model's dtype; None: the model's dtype).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        context: ExpertParallelContext,
        dtype: torch.dtype,
        device: torch.device | None = None,
        expert_impls: dict[DispatchMode, ExpertImpl | None] | None = None,
        *,
        routing: RoutingMethod = SOFTMAX_TOPK,
        router_dtype: torch.dtype | None = None,
        shared_experts: nn.Module | None = None,
        shared_expert_gate: bool = False,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.routing = routing
        self.gate = Linear(hidden_size, num_experts, False, router_dtype or dtype, device)
        if routing.correction_bias:
            self.gate.e_score_correction_bias = empty_parameter(
                num_experts, dtype=torch.float32, device=device
            )
        self.experts = MoELayer(
            num_experts,
            hidden_size,
            intermediate_size,
            context.resolve_placement(num_experts),
            rank=context.rank,
            group=context.group,
            dtype=dtype,
            ll_max_tokens_per_rank=context.ll_max_tokens_per_rank,
            device=device,
        )
        for mode, impl in (expert_impls or {}).items():
            self.experts.set_expert_impl(impl, mode)
        self.shared_experts = shared_experts
        # Qwen2-MoE: the shared expert's output scaled by sigmoid(x W_g), W_g [1, D].
        self.shared_expert_gate = None
        if shared_expert_gate:
            self.shared_expert_gate = Linear(hidden_size, 1, False, dtype, device)

    def forward(self, hidden: torch.Tensor, mode: DispatchMode) -> torch.Tensor:
        """hidden: [T, D] → [T, D]. Always enters the MoE layer, even with T = 0, because in
        EP the layer is a collective every rank must join."""
        logits = self.gate(hidden.to(self.gate.weight.dtype))
        bias = getattr(self.gate, "e_score_correction_bias", None)
        routing = self.routing.route(logits, self.top_k, self.renormalize, bias)
        out = self.experts.forward(hidden, routing.topk_weights, routing.topk_ids, mode)
        if self.shared_experts is not None:
            shared = self.shared_experts(hidden)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
            out = out + shared
        return out


def expert_impl(name: str) -> ExpertImpl | None:
    """The `moe.ExpertImpl` of an expert backend (None: PyTorch's own path)."""
    if name == "native":
        from dist_engine.kernels import compute

        return NativeExperts(compute.routed_swiglu())
    if name == "grouped_mm":
        return grouped_mm_weighted_sum
    if name == "torch":
        return None
    raise ValueError(f"unknown expert backend {name!r}")
