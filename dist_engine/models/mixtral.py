"""Mixtral (`model_type: mixtral`): GQA without q/k norms, softmax top-k routing that always
renormalises, every layer MoE. Hub checkpoints name the MoE block `block_sparse_moe` with
experts `w1` (gate), `w3` (up), `w2` (down); the model names it `mlp`, as transformers 5.x
does in memory."""

from __future__ import annotations

from typing import Any

from dist_engine.models.base import Architecture
from dist_engine.models.config import (
    ModelConfig,
    check_default_rope_and_silu,
    gqa_shape_of,
    num_experts_of,
    refuse_sliding_window,
    rope_theta_of,
)
from dist_engine.models.gqa_moe import build_gqa_moe
from dist_engine.models.weights import CheckpointLayout, ExpertNames, layer_prefix


class MixtralLayout(CheckpointLayout):
    def router_name(self, layer: int) -> str:
        return layer_prefix(layer) + "block_sparse_moe.gate.weight"

    def expert_names(self, layer: int) -> ExpertNames:
        moe = layer_prefix(layer) + "block_sparse_moe.experts."
        fused = layer_prefix(layer) + "mlp.experts."
        return ExpertNames(
            gate=moe + "{e}.w1.weight",
            up=moe + "{e}.w3.weight",
            down=moe + "{e}.w2.weight",
            fused_gate_up=fused + "gate_up_proj",
            fused_down=fused + "down_proj",
        )

    def aliases(self, name: str) -> tuple[str, ...]:
        """The router is `mlp.gate` where transformers wrote the fused layout."""
        if ".block_sparse_moe.gate." in name:
            return (name.replace(".block_sparse_moe.", ".mlp."),)
        return ()

    def parameter_for(self, name: str) -> tuple[str, slice]:
        return super().parameter_for(name.replace(".block_sparse_moe.", ".mlp."))


class Mixtral(Architecture):
    model_type = "mixtral"
    hf_class = "MixtralForCausalLM"

    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        check_default_rope_and_silu(hf)
        refuse_sliding_window(hf.get("sliding_window"))
        return ModelConfig(
            model_type=self.model_type,
            **gqa_shape_of(hf),
            rope_theta=rope_theta_of(hf, default=1e6),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            num_experts=num_experts_of(hf),
            top_k=hf["num_experts_per_tok"],
            # Mixtral's `intermediate_size` is the expert size; it has no dense layers.
            moe_intermediate_size=hf.get("intermediate_size", 0),
            intermediate_size=0,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=(),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            use_qk_norm=False,
            attention_bias=False,
        )

    def layout(self, config: ModelConfig) -> CheckpointLayout:
        return MixtralLayout(config)

    build = staticmethod(build_gqa_moe)

    def tiny_hf_config(self, common: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
        return {
            **common,
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "rms_norm_eps": 1e-5,
            "intermediate_size": options["moe_intermediate_size"],
            "router_jitter_noise": 0.0,
        }


ARCHITECTURE = Mixtral()
