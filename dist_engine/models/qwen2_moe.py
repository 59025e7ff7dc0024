"""Qwen2-MoE (`model_type: qwen2_moe`; Qwen1.5-MoE ships under it too): GQA with q/k/v biases
(none on o_proj), softmax top-k routing (renormalised when `norm_topk_prob`), one shared expert
on every token scaled by `sigmoid(shared_expert_gate(x))`, dense layers by `mlp_only_layers`
and `decoder_sparse_step`."""

from __future__ import annotations

from typing import Any

from dist_engine.models.base import Architecture
from dist_engine.models.config import ModelConfig
from dist_engine.models.gqa_moe import build_gqa_moe, qwen_moe_config
from dist_engine.models.weights import CheckpointLayout


class Qwen2MoeLayout(CheckpointLayout):
    """The shared expert is `mlp.shared_expert` (singular) in checkpoints; the model's MoE
    block names it `shared_experts`, as DeepSeek's and GLM's checkpoints do."""

    shared_experts_name = "shared_expert"

    def parameter_for(self, name: str) -> tuple[str, slice]:
        return super().parameter_for(name.replace(".mlp.shared_expert.", ".mlp.shared_experts."))


class Qwen2Moe(Architecture):
    model_type = "qwen2_moe"
    hf_class = "Qwen2MoeForCausalLM"

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        shared_size = hf.get("shared_expert_intermediate_size", 5632)
        if not isinstance(shared_size, int) or isinstance(shared_size, bool) or shared_size < 1:
            raise ValueError(
                "config key 'shared_expert_intermediate_size' must be a positive integer, got "
                f"{shared_size!r}"
            )
        return qwen_moe_config(
            self.model_type,
            hf,
            use_qk_norm=False,
            attention_bias=bool(hf.get("qkv_bias", True)),
            attention_output_bias=False,
            shared_expert_intermediate_size=shared_size,
            shared_expert_gate=True,
        )

    def layout(self, config: ModelConfig) -> CheckpointLayout:
        return Qwen2MoeLayout(config)

    build = staticmethod(build_gqa_moe)

    def tiny_hf_config(self, common: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
        """Options (besides make_model's): shared_expert_intermediate_size."""
        config = {k: v for k, v in common.items() if k != "num_local_experts"}
        return config | {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "num_experts": common["num_local_experts"],
            "rms_norm_eps": 1e-6,
            "qkv_bias": True,
            "use_sliding_window": False,
            "decoder_sparse_step": 1,
            "moe_intermediate_size": options["moe_intermediate_size"],
            "shared_expert_intermediate_size": options.get("shared_expert_intermediate_size", 48),
            "intermediate_size": options["intermediate_size"],
            "mlp_only_layers": list(options["mlp_only_layers"]),
            "norm_topk_prob": options["norm_topk_prob"],
        }


ARCHITECTURE = Qwen2Moe()
