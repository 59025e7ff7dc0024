"""Router gating: turn router logits into top-k expert ids and combine weights.

Shape legend: T = tokens, E = logical experts, K = top-k, G = expert groups.

Pure functions on tensors (any device). Scores are computed in float32 whatever the logits'
dtype, because near-tied logits in bf16 would otherwise flip the top-k selection between the
reference and the serving path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class RoutingResult:
    """The router's decision for a batch of tokens.

    topk_weights: [T, K] float32 — combine weight of each chosen expert.
    topk_ids:     [T, K] int64   — logical expert ids, distinct within a row.
    """

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor

    def __post_init__(self) -> None:
        assert self.topk_weights.shape == self.topk_ids.shape, (
            self.topk_weights.shape,
            self.topk_ids.shape,
        )
        assert self.topk_weights.dtype == torch.float32, self.topk_weights.dtype
        assert self.topk_ids.dtype == torch.int64, self.topk_ids.dtype


def _check_logits(router_logits: torch.Tensor, top_k: int) -> int:
    """Validate `router_logits: [T, E]` and `top_k`; return E."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got top_k={top_k}")
    return num_experts


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> RoutingResult:
    """Softmax over all E experts, keep the top-k (Mixtral, Qwen2/3-MoE).

    router_logits: [T, E] any float dtype.
    renormalize: divide the k kept probabilities by their sum (Mixtral always; Qwen3-MoE when
        `norm_topk_prob` is set).
    Returns RoutingResult with topk_weights [T, K] float32, topk_ids [T, K] int64.
    """
    _check_logits(router_logits, top_k)
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return RoutingResult(topk_weights=topk_weights, topk_ids=topk_ids)


def sigmoid_grouped_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    routed_scaling_factor: float,
    renormalize: bool,
) -> RoutingResult:
    """DeepSeek-V3 routing: sigmoid scores, group-limited top-k with a selection-only bias.

    router_logits:   [T, E] any float dtype.
    correction_bias: [E] — added to the scores to *choose* experts (aux-loss-free balancing),
        never to the weights.
    Experts are split into `num_groups` contiguous groups of E / G; a group's score is the sum
    of its top-2 biased scores; only the `topk_groups` best groups are eligible. The weights are
    the unbiased sigmoid scores of the chosen experts, optionally renormalised to sum to one,
    then multiplied by `routed_scaling_factor`.
    Returns RoutingResult with topk_weights [T, K] float32, topk_ids [T, K] int64.
    """
    num_experts = _check_logits(router_logits, top_k)
    if correction_bias.shape != (num_experts,):
        raise ValueError(
            f"correction_bias must be [E={num_experts}], got shape {tuple(correction_bias.shape)}"
        )
    group_size = check_group_limits(num_experts, top_k, num_groups, topk_groups)
    num_tokens = router_logits.shape[0]
    scores = router_logits.float().sigmoid()  # [T, E]
    scores_for_choice = scores + correction_bias.float()
    grouped = scores_for_choice.view(num_tokens, num_groups, group_size)
    group_scores = grouped.topk(min(2, group_size), dim=-1).values.sum(dim=-1)  # [T, G]
    expert_mask = _group_mask(group_scores, topk_groups, group_size)  # [T, E]
    masked = scores_for_choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = masked.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        # The epsilon matches the reference implementation (sigmoid scores are never all zero
        # in practice, but a zero denominator must not produce NaN).
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    topk_weights = topk_weights * routed_scaling_factor
    return RoutingResult(topk_weights=topk_weights, topk_ids=topk_ids)


def softmax_grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    routed_scaling_factor: float,
) -> RoutingResult:
    """DeepSeek-V2 routing: softmax over all E experts, then a greedy top-k among the experts
    of the `topk_groups` best groups (`topk_method: group_limited_greedy`; with one group it is
    plain `greedy`). A group's score is its best expert's probability. The weights are the
    chosen probabilities (never renormalised) times `routed_scaling_factor`.

    router_logits: [T, E] any float dtype.
    Returns RoutingResult with topk_weights [T, K] float32, topk_ids [T, K] int64.
    """
    num_experts = _check_logits(router_logits, top_k)
    group_size = check_group_limits(num_experts, top_k, num_groups, topk_groups)
    num_tokens = router_logits.shape[0]
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    if num_groups > 1:
        group_scores = probs.view(num_tokens, num_groups, group_size).amax(dim=-1)  # [T, G]
        probs = probs.masked_fill(~_group_mask(group_scores, topk_groups, group_size), 0.0)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    return RoutingResult(topk_weights=topk_weights * routed_scaling_factor, topk_ids=topk_ids)


def check_group_limits(num_experts: int, top_k: int, num_groups: int, topk_groups: int) -> int:
    """Validate a group-limited selection (ValueError naming the values); return the group
    size E / G."""
    if num_groups < 1 or num_experts % num_groups != 0:
        raise ValueError(
            f"num_groups={num_groups} must be >= 1 and divide num_experts={num_experts}"
        )
    group_size = num_experts // num_groups
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups={topk_groups} must be in [1, num_groups={num_groups}]")
    if top_k > topk_groups * group_size:
        raise ValueError(
            f"top_k={top_k} exceeds the experts eligible in topk_groups={topk_groups} groups "
            f"of {group_size} (num_experts={num_experts}, num_groups={num_groups})"
        )
    return group_size


def _group_mask(group_scores: torch.Tensor, topk_groups: int, group_size: int) -> torch.Tensor:
    """group_scores: [T, G] → [T, E] bool, True for the experts of each token's best groups."""
    group_ids = group_scores.topk(topk_groups, dim=-1).indices  # [T, topk_groups]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, group_ids, True)
    return group_mask.repeat_interleave(group_size, dim=1)


@dataclass(frozen=True)
class RoutingMethod:
    """How an architecture turns router logits into top-k choices (its config's settings).

    scoring: "softmax" (Mixtral, Qwen, DeepSeek-V2) or "sigmoid" (DeepSeek-V3, GLM-4.5).
    num_groups, topk_groups: group-limited selection (1, 1: none).
    routed_scaling_factor: multiplies the routed experts' weights.
    correction_bias: sigmoid only — the router has a per-expert bias used to choose experts
        (`e_score_correction_bias`), never to weight them.
    """

    scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if self.correction_bias and self.scoring != "sigmoid":
            raise ValueError("a correction bias applies to sigmoid scoring only")

    def route(
        self,
        router_logits: torch.Tensor,
        top_k: int,
        renormalize: bool,
        correction_bias: torch.Tensor | None = None,
    ) -> RoutingResult:
        """router_logits: [T, E]; correction_bias: [E] (when `correction_bias` is set)."""
        if self.scoring == "sigmoid":
            if correction_bias is None:
                correction_bias = router_logits.new_zeros(router_logits.shape[1])
            return sigmoid_grouped_topk(
                router_logits,
                correction_bias,
                top_k,
                self.num_groups,
                self.topk_groups,
                self.routed_scaling_factor,
                renormalize,
            )
        if self.num_groups == 1 and self.routed_scaling_factor == 1.0:
            return softmax_topk(router_logits, top_k, renormalize)
        if renormalize:
            raise ValueError("group-limited softmax routing never renormalises (DeepSeek-V2)")
        return softmax_grouped_topk(
            router_logits, top_k, self.num_groups, self.topk_groups, self.routed_scaling_factor
        )


SOFTMAX_TOPK = RoutingMethod()
"""Softmax over all experts, top-k (the routing of Mixtral and Qwen-MoE)."""
