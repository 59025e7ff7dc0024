"""Routing functions against the transformers routers they reimplement (random inputs)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from moe import (
    RoutingMethod,
    RoutingResult,
    sigmoid_grouped_topk,
    softmax_grouped_topk,
    softmax_topk,
)

HIDDEN = 32
NUM_TOKENS = 64


def sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical per-token order, so top-k results compare as sets (tie order may differ)."""
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


def assert_same_routing(ours: RoutingResult, hf_weights: torch.Tensor, hf_ids: torch.Tensor):
    assert ours.topk_weights.dtype == torch.float32
    assert ours.topk_ids.dtype == torch.int64
    our_w, our_ids = sorted_by_id(ours.topk_weights, ours.topk_ids)
    hf_w, hf_ids = sorted_by_id(hf_weights.float(), hf_ids)
    torch.testing.assert_close(our_ids, hf_ids, rtol=0, atol=0)
    torch.testing.assert_close(our_w, hf_w, rtol=1e-6, atol=1e-7)


def random_router_input(router: torch.nn.Module, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random gate weight (large, so logits are well separated) and hidden; returns both inputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=gen)
    logits = hidden @ router.weight.detach().float().t()
    return hidden, logits


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_softmax_topk_matches_qwen3_moe(norm_topk_prob: bool, top_k: int) -> None:
    config = Qwen3MoeConfig(
        hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob
    )
    router = Qwen3MoeTopKRouter(config)
    hidden, logits = random_router_input(router, seed=top_k)
    _, hf_weights, hf_ids = router(hidden)
    ours = softmax_topk(logits, top_k, renormalize=norm_topk_prob)
    assert_same_routing(ours, hf_weights, hf_ids)
    if norm_topk_prob:
        torch.testing.assert_close(ours.topk_weights.sum(-1), torch.ones(NUM_TOKENS))


@pytest.mark.parametrize("top_k", [1, 2])
def test_softmax_topk_matches_mixtral(top_k: int) -> None:
    config = MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=top_k)
    router = MixtralTopKRouter(config)
    hidden, logits = random_router_input(router, seed=10 + top_k)
    _, hf_weights, hf_ids = router(hidden)
    assert_same_routing(softmax_topk(logits, top_k, renormalize=True), hf_weights, hf_ids)


def test_softmax_topk_computes_in_float32_for_bf16_logits() -> None:
    """Against a plain-loop float64 softmax of the same bf16 values: float32 arithmetic stays
    within ~1e-7 of it, where a softmax computed in bf16 keeps 8 significant bits."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, 16, generator=gen) * 3).to(torch.bfloat16)
    ours = softmax_topk(logits, 2, renormalize=False)
    assert ours.topk_weights.dtype == torch.float32
    for row, values in enumerate(logits.tolist()):  # bf16 values are exact in a Python float
        exps = [math.exp(v - max(values)) for v in values]
        probs = [e / sum(exps) for e in exps]
        chosen = ours.topk_ids[row].tolist()
        others = [probs[e] for e in range(len(probs)) if e not in chosen]
        assert min(probs[e] for e in chosen) >= max(others), row  # the two largest (ties: any)
        weights = ours.topk_weights[row].tolist()
        for expert, weight in zip(chosen, weights, strict=True):
            assert abs(weight - probs[expert]) < 1e-6, (row, expert, weight, probs[expert])


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize(
    ("num_experts", "num_groups", "topk_groups", "top_k"),
    [(16, 4, 2, 4), (16, 8, 3, 2), (32, 8, 4, 8), (16, 1, 1, 4)],
)
def test_sigmoid_grouped_topk_matches_deepseek_v3(
    norm_topk_prob: bool, num_experts: int, num_groups: int, topk_groups: int, top_k: int
) -> None:
    config = DeepseekV3Config(
        hidden_size=HIDDEN,
        n_routed_experts=num_experts,
        n_group=num_groups,
        topk_group=topk_groups,
        num_experts_per_tok=top_k,
        routed_scaling_factor=2.5,
        norm_topk_prob=norm_topk_prob,
    )
    router = DeepseekV3TopkRouter(config)
    hidden, logits = random_router_input(router, seed=num_experts + top_k)
    # A bias comparable to the scores, so it really changes which experts are chosen.
    bias = torch.rand(num_experts, generator=torch.Generator().manual_seed(7)) * 0.5
    router.e_score_correction_bias.copy_(bias)
    _, hf_weights, hf_ids = router(hidden)
    ours = sigmoid_grouped_topk(
        logits, bias, top_k, num_groups, topk_groups, 2.5, renormalize=norm_topk_prob
    )
    assert_same_routing(ours, hf_weights, hf_ids)


@pytest.mark.parametrize(
    ("topk_method", "num_groups", "topk_groups", "top_k"),
    [("greedy", 1, 1, 6), ("group_limited_greedy", 4, 2, 4), ("group_limited_greedy", 8, 3, 6)],
)
def test_softmax_grouped_topk_matches_deepseek_v2(
    topk_method: str, num_groups: int, topk_groups: int, top_k: int
) -> None:
    config = DeepseekV2Config(
        hidden_size=HIDDEN,
        n_routed_experts=32,
        num_experts_per_tok=top_k,
        topk_method=topk_method,
        n_group=num_groups,
        topk_group=topk_groups,
        routed_scaling_factor=1.5,
    )
    router = DeepseekV2TopkRouter(config)
    hidden, logits = random_router_input(router, seed=top_k)
    _, hf_weights, hf_ids = router(hidden)
    ours = softmax_grouped_topk(logits, top_k, num_groups, topk_groups, 1.5)
    assert_same_routing(ours, hf_weights, hf_ids)
    method = RoutingMethod("softmax", num_groups, topk_groups, routed_scaling_factor=1.5)
    assert_same_routing(method.route(logits, top_k, renormalize=False), hf_weights, hf_ids)
    if num_groups > 1:  # the group limit really excluded experts softmax top-k would take
        plain = softmax_topk(logits, top_k, renormalize=False).topk_ids.sort(-1).values
        assert (plain != ours.topk_ids.sort(-1).values).any()


def test_sigmoid_grouped_topk_uses_bias_only_for_selection() -> None:
    logits = torch.zeros(1, 4)  # every score is sigmoid(0) = 0.5
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    result = sigmoid_grouped_topk(logits, bias, 1, 2, 1, 1.0, renormalize=False)
    assert result.topk_ids.tolist() == [[3]]
    assert result.topk_weights.tolist() == [[0.5]]


def test_routing_rejects_bad_arguments() -> None:
    logits = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=8\], got top_k=9"):
        softmax_topk(logits, 9, renormalize=True)
    with pytest.raises(ValueError, match=r"router_logits must be \[T, E\], got shape \(8,\)"):
        softmax_topk(logits[0], 2, renormalize=True)
    with pytest.raises(ValueError, match=r"num_groups=3 must be >= 1 and divide num_experts=8"):
        sigmoid_grouped_topk(logits, torch.zeros(8), 2, 3, 1, 1.0, True)
    with pytest.raises(ValueError, match=r"topk_groups=5 must be in \[1, num_groups=4\]"):
        sigmoid_grouped_topk(logits, torch.zeros(8), 2, 4, 5, 1.0, True)
    with pytest.raises(ValueError, match=r"top_k=5 exceeds .* topk_groups=2 groups of 2"):
        sigmoid_grouped_topk(logits, torch.zeros(8), 5, 4, 2, 1.0, True)
    with pytest.raises(ValueError, match=r"correction_bias must be \[E=8\], got shape \(7,\)"):
        sigmoid_grouped_topk(logits, torch.zeros(7), 2, 4, 2, 1.0, True)
    with pytest.raises(ValueError, match=r"top_k=5 exceeds .* topk_groups=1 groups of 4"):
        softmax_grouped_topk(logits, 5, 2, 1, 1.0)
    with pytest.raises(ValueError, match="never renormalises"):
        RoutingMethod("softmax", 2, 1).route(logits, 2, renormalize=True)
    with pytest.raises(ValueError, match="scoring must be 'softmax' or 'sigmoid'"):
        RoutingMethod("relu")


def test_routing_handles_zero_tokens() -> None:
    empty = torch.zeros(0, 8)
    assert softmax_topk(empty, 2, renormalize=True).topk_ids.shape == (0, 2)
    assert sigmoid_grouped_topk(empty, torch.zeros(8), 2, 4, 2, 1.0, True).topk_ids.shape == (0, 2)
    assert softmax_grouped_topk(empty, 2, 4, 2, 1.0).topk_ids.shape == (0, 2)
