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

    num_tokens = router_logits.shape[0]
    scores = router_logits.float().sigmoid()  # [T, E]
    scores_for_choice = scores + correction_bias.float()
    grouped = scores_for_choice.view(num_tokens, num_groups, group_size)
    group_scores = grouped.topk(min(2, group_size), dim=-1).values.sum(dim=-1)  # [T, G]
    group_ids = group_scores.topk(topk_groups, dim=-1).indices  # [T, topk_groups]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, group_ids, True)
    expert_mask = group_mask.repeat_interleave(group_size, dim=1)  # [T, E]
    masked = scores_for_choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = masked.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        # The epsilon matches the reference implementation (sigmoid scores are never all zero
        # in practice, but a zero denominator must not produce NaN).
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    topk_weights = topk_weights * routed_scaling_factor
    return RoutingResult(topk_weights=topk_weights, topk_ids=topk_ids)
