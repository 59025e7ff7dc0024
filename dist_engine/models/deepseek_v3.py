"""DeepSeek-V3 (`model_type: deepseek_v3`; DeepSeek-R1 ships under it too): MLA over
a latent cache, sigmoid router scores with `e_score_correction_bias` for selection only,
group-limited top-k (`n_group`, `topk_group`), `norm_topk_prob`, `routed_scaling_factor`,
shared experts, `first_k_dense_replace` dense layers, RoPE default or YaRN, interleaved pairs
unless `rope_interleave` is false."""

from __future__ import annotations

from typing import Any

from dist_engine.models.base import Architecture
from dist_engine.models.config import ModelConfig, num_mtp_layers_of
from dist_engine.models.mla_moe import MLALayout, build_mla_moe, parse_mla_moe
from dist_engine.models.weights import CheckpointLayout
from moe import RoutingMethod

# transformers' DeepseekV3Config defaults, for keys a config.json may leave out.
DEFAULTS = {
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "moe_intermediate_size": 2048,
    "intermediate_size": 18432,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
}


class DeepseekV3(Architecture):
    model_type = "deepseek_v3"
    hf_class = "DeepseekV3ForCausalLM"

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        scoring = hf.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(f"config key 'scoring_func' must be 'sigmoid', got {scoring!r}")
        method = hf.get("topk_method", "noaux_tc")
        if method != "noaux_tc":
            raise ValueError(f"config key 'topk_method' must be 'noaux_tc', got {method!r}")

        def get(key: str) -> Any:
            return DEFAULTS[key] if hf.get(key) is None else hf[key]

        routing = RoutingMethod(
            scoring="sigmoid",
            num_groups=get("n_group"),
            topk_groups=get("topk_group"),
            routed_scaling_factor=float(get("routed_scaling_factor")),
            correction_bias=True,
        )
        return parse_mla_moe(
            hf,
            self.model_type,
            routing,
            norm_topk_prob=bool(get("norm_topk_prob")),
            rope_interleave=bool(hf.get("rope_interleave", True)),
            defaults=DEFAULTS,
            num_extra_layers=num_mtp_layers_of(hf),
        )

    def layout(self, config: ModelConfig) -> CheckpointLayout:
        return MLALayout(config)

    build = staticmethod(build_mla_moe)

    def tiny_hf_config(self, common: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
        """Options (besides make_model's): q_lora_rank (None: full-rank q), kv_lora_rank,
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim, n_group, topk_group,
        n_shared_experts, first_k_dense_replace, routed_scaling_factor, rope_interleave,
        yarn (a dict of YaRN parameters, or None for default RoPE)."""
        return tiny_mla_config(self.model_type, self.hf_class, common, options) | {
            "n_group": options.get("n_group", 2),
            "topk_group": options.get("topk_group", 1),
            "routed_scaling_factor": options.get("routed_scaling_factor", 2.5),
            "norm_topk_prob": options["norm_topk_prob"],
            "rope_interleave": options.get("rope_interleave", True),
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
        }


def tiny_mla_config(
    model_type: str, hf_class: str, common: dict[str, Any], options: dict[str, Any]
) -> dict[str, Any]:
    """The keys DeepSeek-V2 and V3 tiny checkpoints share."""
    config = {
        key: value
        for key, value in common.items()
        if key not in ("head_dim", "num_local_experts", "num_key_value_heads", "sliding_window")
    }
    yarn = options.get("yarn")
    if yarn is not None:
        config["rope_parameters"] = {**common["rope_parameters"], "rope_type": "yarn", **yarn}
    return config | {
        "architectures": [hf_class],
        "model_type": model_type,
        "num_key_value_heads": common["num_attention_heads"],
        "n_routed_experts": common["num_local_experts"],
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "q_lora_rank": options.get("q_lora_rank", 24),
        "kv_lora_rank": options.get("kv_lora_rank", 32),
        "qk_nope_head_dim": options.get("qk_nope_head_dim", 16),
        "qk_rope_head_dim": options.get("qk_rope_head_dim", 8),
        "v_head_dim": options.get("v_head_dim", 16),
        "n_shared_experts": options.get("n_shared_experts", 1),
        "first_k_dense_replace": options.get("first_k_dense_replace", 1),
        "moe_layer_freq": 1,
        "moe_intermediate_size": options["moe_intermediate_size"],
        "intermediate_size": options["intermediate_size"],
    }


ARCHITECTURE = DeepseekV3()
