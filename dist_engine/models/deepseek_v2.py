"""DeepSeek-V2 and V2-Lite (`model_type: deepseek_v2`): MLA over a latent cache (rotary pairs
interleaved, as V2's complex-number RoPE pairs adjacent lanes), softmax router scores with a
greedy top-k, group-limited when `topk_method: group_limited_greedy` (`n_group`,
`topk_group`), `routed_scaling_factor`, shared experts, `first_k_dense_replace` and
`moe_layer_freq` dense layers, RoPE default or YaRN."""

from __future__ import annotations

from typing import Any

from dist_engine.models.base import Architecture
from dist_engine.models.config import ModelConfig
from dist_engine.models.deepseek_v3 import tiny_mla_config
from dist_engine.models.mla_moe import MLALayout, build_mla_moe, parse_mla_moe
from dist_engine.models.weights import CheckpointLayout
from moe import RoutingMethod

# transformers' DeepseekV2Config defaults, for keys a config.json may leave out.
DEFAULTS = {
    "first_k_dense_replace": 0,
    "moe_layer_freq": 1,
    "n_shared_experts": 0,
    "routed_scaling_factor": 1.0,
    "moe_intermediate_size": 1407,
    "intermediate_size": 11008,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
}
TOPK_METHODS = ("greedy", "group_limited_greedy")


class DeepseekV2(Architecture):
    model_type = "deepseek_v2"
    hf_class = "DeepseekV2ForCausalLM"

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        scoring = hf.get("scoring_func", "softmax")
        if scoring != "softmax":
            raise ValueError(f"config key 'scoring_func' must be 'softmax', got {scoring!r}")
        method = hf.get("topk_method") or "greedy"
        if method not in TOPK_METHODS:
            raise ValueError(
                f"config key 'topk_method' must be one of {list(TOPK_METHODS)}, got {method!r}"
            )
        if hf.get("norm_topk_prob"):
            # DeepSeek's own V2 code renormalises then; transformers' ignores the key. No
            # released V2 sets it, and guessing would change every routed weight.
            raise ValueError("config key 'norm_topk_prob' must be false for deepseek_v2")
        num_groups, topk_groups = 1, 1
        if method == "group_limited_greedy":
            for key in ("n_group", "topk_group"):
                if not isinstance(hf.get(key), int):
                    raise ValueError(
                        f"config key {key!r} must be an integer for topk_method "
                        f"'group_limited_greedy', got {hf.get(key)!r}"
                    )
            num_groups, topk_groups = hf["n_group"], hf["topk_group"]
        scaling = hf.get("routed_scaling_factor")
        routing = RoutingMethod(
            scoring="softmax",
            num_groups=num_groups,
            topk_groups=topk_groups,
            routed_scaling_factor=float(
                DEFAULTS["routed_scaling_factor"] if scaling is None else scaling
            ),
        )
        return parse_mla_moe(
            hf,
            self.model_type,
            routing,
            norm_topk_prob=False,
            rope_interleave=True,
            defaults=DEFAULTS,
        )

    def layout(self, config: ModelConfig) -> CheckpointLayout:
        return MLALayout(config)

    build = staticmethod(build_mla_moe)

    def tiny_hf_config(self, common: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
        """Options as deepseek_v3's, plus topk_method (greedy | group_limited_greedy)."""
        method = options.get("topk_method", "group_limited_greedy")
        return tiny_mla_config(self.model_type, self.hf_class, common, options) | {
            "topk_method": method,
            "n_group": options.get("n_group", 2) if method != "greedy" else None,
            "topk_group": options.get("topk_group", 1) if method != "greedy" else None,
            "routed_scaling_factor": options.get("routed_scaling_factor", 1.5),
            "norm_topk_prob": False,
            "scoring_func": "softmax",
        }


ARCHITECTURE = DeepseekV2()
