"""The decoder the grouped-query-attention architectures share (Qwen3-MoE, Mixtral, Qwen2-MoE,
GLM-4.5): GQA (optionally with per-head q/k norms, biases, partial rotary) and MoE layers
routed as the config says (optionally with shared experts, and dense SwiGLU layers between).

Their modules differ only in how they read config.json and name tensors; all build their
model here.
"""

from __future__ import annotations

import torch

from dist_engine.attention.kv_cache import PagedKVSpec
from dist_engine.backends import LayerOps
from dist_engine.layers.attention import GQAttention
from dist_engine.layers.mlp import DenseMLP
from dist_engine.layers.moe import ExpertParallelContext, MoEBlock
from dist_engine.layers.rotary import RotaryEmbedding
from dist_engine.models.config import ModelConfig
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
