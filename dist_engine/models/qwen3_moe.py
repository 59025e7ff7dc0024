"""Qwen3-MoE (`model_type: qwen3_moe`): GQA with per-head q/k RMSNorm, softmax top-k routing
(renormalised when `norm_topk_prob`), dense SwiGLU layers by `mlp_only_layers` and
`decoder_sparse_step`."""

from __future__ import annotations

from typing import Any

from dist_engine.models.base import Architecture
from dist_engine.models.config import ModelConfig
from dist_engine.models.gqa_moe import build_gqa_moe, qwen_moe_config


class Qwen3Moe(Architecture):
    model_type = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        return qwen_moe_config(
            self.model_type,
            hf,
            use_qk_norm=True,
            attention_bias=bool(hf.get("attention_bias", False)),
        )

    build = staticmethod(build_gqa_moe)

    def tiny_hf_config(self, common: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
        return {
            **common,
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "use_sliding_window": False,
            "decoder_sparse_step": 1,
            "moe_intermediate_size": options["moe_intermediate_size"],
            "intermediate_size": options["intermediate_size"],
            "mlp_only_layers": list(options["mlp_only_layers"]),
            "norm_topk_prob": options["norm_topk_prob"],
        }


ARCHITECTURE = Qwen3Moe()
