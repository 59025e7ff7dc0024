"""GLM-4.5 (`model_type: glm4_moe`): GQA with q/k/v biases (none on o_proj), optional per-head
q/k norms, RoPE on the first `partial_rotary_factor` of each head (half by default), and
DeepSeek-V3's MoE: sigmoid router scores with `e_score_correction_bias` for selection only,
group-limited top-k, `norm_topk_prob`, `routed_scaling_factor`, shared experts, after
`first_k_dense_replace` dense layers."""

from __future__ import annotations

from typing import Any

from dist_engine.models.base import Architecture
from dist_engine.models.config import (
    ModelConfig,
    check_routing_groups,
    gqa_shape_of,
    num_experts_of,
    num_mtp_layers_of,
    rope_of,
)
from dist_engine.models.gqa_moe import build_gqa_moe
from moe import RoutingMethod

# transformers' Glm4MoeConfig defaults, for keys a config.json may leave out.
DEFAULTS = {
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "moe_intermediate_size": 1408,
    "intermediate_size": 10944,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "partial_rotary_factor": 0.5,
}


class Glm4Moe(Architecture):
    model_type = "glm4_moe"
    hf_class = "Glm4MoeForCausalLM"

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config key 'hidden_act' must be 'silu', got {act!r}")
        theta, scaling = rope_of(hf, default_theta=1e4)

        def get(key: str) -> Any:
            return DEFAULTS[key] if hf.get(key) is None else hf[key]

        rope_params = hf.get("rope_parameters") or {}
        partial = rope_params.get("partial_rotary_factor", get("partial_rotary_factor"))
        num_experts, top_k = num_experts_of_glm(hf), hf["num_experts_per_tok"]
        routing = RoutingMethod(
            scoring="sigmoid",
            num_groups=get("n_group"),
            topk_groups=get("topk_group"),
            routed_scaling_factor=float(get("routed_scaling_factor")),
            correction_bias=True,
        )
        check_routing_groups(num_experts, top_k, routing)
        num_layers, first_dense = hf["num_hidden_layers"], get("first_k_dense_replace")
        moe_size = get("moe_intermediate_size")
        return ModelConfig(
            model_type=self.model_type,
            **gqa_shape_of(hf),
            rope_theta=theta,
            rms_norm_eps=float(get("rms_norm_eps")),
            num_experts=num_experts,
            top_k=top_k,
            moe_intermediate_size=moe_size,
            intermediate_size=get("intermediate_size"),
            norm_topk_prob=bool(get("norm_topk_prob")),
            decoder_sparse_step=1,
            mlp_only_layers=tuple(range(min(first_dense, num_layers))),
            max_position_embeddings=get("max_position_embeddings"),
            use_qk_norm=bool(hf.get("use_qk_norm", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            attention_output_bias=False,
            rope_scaling=scaling,
            partial_rotary_factor=float(partial),
            routing=routing,
            router_in_float32=True,
            shared_expert_intermediate_size=moe_size * get("n_shared_experts"),
            num_extra_layers=num_mtp_layers_of(hf),
        )

    build = staticmethod(build_gqa_moe)

    def tiny_hf_config(self, common: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
        """Options (besides make_model's): n_group, topk_group, n_shared_experts,
        first_k_dense_replace, routed_scaling_factor, use_qk_norm, partial_rotary_factor."""
        rope = {**common["rope_parameters"]}
        rope["partial_rotary_factor"] = options.get("partial_rotary_factor", 0.5)
        config = {
            k: v for k, v in common.items() if k not in ("num_local_experts", "sliding_window")
        }
        return config | {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "rope_parameters": rope,
            "n_routed_experts": common["num_local_experts"],
            "rms_norm_eps": 1e-5,
            "attention_bias": True,
            "use_qk_norm": options.get("use_qk_norm", True),
            "n_group": options.get("n_group", 2),
            "topk_group": options.get("topk_group", 1),
            "n_shared_experts": options.get("n_shared_experts", 1),
            "first_k_dense_replace": options.get("first_k_dense_replace", 1),
            "routed_scaling_factor": options.get("routed_scaling_factor", 1.5),
            "norm_topk_prob": options["norm_topk_prob"],
            "moe_intermediate_size": options["moe_intermediate_size"],
            "intermediate_size": options["intermediate_size"],
        }


def num_experts_of_glm(hf: dict[str, Any]) -> int:
    """`n_routed_experts`, or `num_local_experts` (transformers' alias)."""
    return hf.get("n_routed_experts") or num_experts_of(hf)


ARCHITECTURE = Glm4Moe()
