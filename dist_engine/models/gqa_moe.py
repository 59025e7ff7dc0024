"""The decoder the grouped-query-attention architectures share (Qwen3-MoE, Mixtral, Qwen2-MoE,
GLM-4.5): GQA (optionally with per-head q/k norms, biases, partial rotary) and MoE layers
routed as the config says (optionally with shared experts, and dense SwiGLU layers between).

Their modules differ only in how they read config.json and name tensors; all build their
model here.
"""

from __future__ import annotations

from typing import Any

import torch

from dist_engine.attention.kv_cache import PagedKVSpec
from dist_engine.backends import LayerOps
from dist_engine.layers.attention import GQAttention
from dist_engine.layers.mlp import DenseMLP
from dist_engine.layers.moe import ExpertParallelContext, MoEBlock
from dist_engine.layers.rotary import RotaryEmbedding
from dist_engine.models.config import (
    ModelConfig,
    check_default_rope_and_silu,
    gqa_shape_of,
    num_experts_of,
    refuse_sliding_window,
    rope_theta_of,
)
from dist_engine.models.decoder import DecoderLayer, MoECausalLM


def build_gqa_moe(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | None,
    ep_context: ExpertParallelContext,
    ops: LayerOps,
) -> MoECausalLM:
    hidden, eps = config.hidden_size, config.rms_norm_eps

    def make_layer(layer_idx: int) -> DecoderLayer:
        attention = GQAttention(
            hidden,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            bias=config.attention_bias,
            qk_norm_eps=eps if config.use_qk_norm else None,
            backend=ops.attention,
            dtype=dtype,
            device=device,
            norm_kernel=ops.norm,
            output_bias=config.output_bias,
            rotary_dim=config.rotary_dim,
        )
        is_moe = config.is_moe_layer(layer_idx)
        if is_moe:
            shared_size, shared = config.shared_expert_intermediate_size, None
            if shared_size:
                shared = DenseMLP(hidden, shared_size, dtype, device)
            mlp = MoEBlock(
                hidden,
                config.num_experts,
                config.top_k,
                config.moe_intermediate_size,
                config.norm_topk_prob,
                ep_context,
                dtype,
                device,
                ops.experts,
                routing=config.routing,
                router_dtype=torch.float32 if config.router_in_float32 else None,
                shared_experts=shared,
                shared_expert_gate=config.shared_expert_gate,
            )
        else:
            mlp = DenseMLP(hidden, config.intermediate_size, dtype, device)
        return DecoderLayer(attention, mlp, hidden, eps, dtype, device, ops.norm, is_moe)

    return MoECausalLM(
        config,
        make_layer,
        RotaryEmbedding(config.rotary_dim, config.rope_theta, device, config.rope_scaling),
        PagedKVSpec(config.num_layers, config.num_kv_heads, config.head_dim),
        dtype,
        device,
        ops.norm,
    )


def qwen_moe_config(model_type: str, hf: dict[str, Any], **fields: Any) -> ModelConfig:
    """The config keys Qwen2-MoE and Qwen3-MoE read alike (sliding window only when
    `use_sliding_window`, dense layers by `mlp_only_layers` and `decoder_sparse_step`, rope
    theta 1e4, eps 1e-6); `fields` are the architecture's own (attention norms and biases,
    shared experts)."""
    check_default_rope_and_silu(hf)
    refuse_sliding_window(hf.get("sliding_window") if hf.get("use_sliding_window") else None)
    mlp_only_layers = hf.get("mlp_only_layers") or []
    if not isinstance(mlp_only_layers, list):
        raise ValueError(f"config key 'mlp_only_layers' must be a list, got {mlp_only_layers!r}")
    return ModelConfig(
        model_type=model_type,
        **gqa_shape_of(hf),
        rope_theta=rope_theta_of(hf, default=1e4),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        num_experts=num_experts_of(hf),
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf.get("moe_intermediate_size", 0),
        intermediate_size=hf.get("intermediate_size", 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(mlp_only_layers),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        **fields,
    )
