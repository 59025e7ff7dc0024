"""The decoder DeepSeek-V2 and DeepSeek-V3 share: Multi-head Latent Attention over a latent
cache, and MoE layers with routed experts (dispatched over EP) plus shared experts (computed
where the token is), after `first_k_dense_replace` dense layers.

Their modules differ in how they read config.json (V3: sigmoid scores, a selection bias and
group-limited top-k; V2: softmax with group-limited greedy top-k) and both build their model
here. Tensor names are Hugging Face's; see `MLALayout`.

Shape legend: V = vocab, D = hidden, H = heads, Q = q_lora_rank, C = kv_lora_rank,
Dn/R/Dv = qk_nope/qk_rope/v head dims, E = routed experts, F = dense MLP size,
S = shared experts' size.
"""

from __future__ import annotations

from typing import Any

import torch

from dist_engine.attention.latent_cache import LatentKVSpec
from dist_engine.attention.mla_backend import MLABackend
from dist_engine.backends import LayerOps
from dist_engine.layers.mla import MLADims, MLAttention
from dist_engine.layers.mlp import DenseMLP
from dist_engine.layers.moe import ExpertParallelContext, MoEBlock
from dist_engine.layers.rotary import RotaryEmbedding
from dist_engine.models.config import (
    ModelConfig,
    check_routing_groups,
    eos_token_ids_of,
    num_experts_of,
    rope_of,
)
from dist_engine.models.decoder import DecoderLayer, MoECausalLM
from dist_engine.models.weights import CheckpointLayout, layer_prefix
from moe import RoutingMethod

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon, whatever
# rms_norm_eps says (so did DeepSeek's own code).
LATENT_NORM_EPS = 1e-6
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def parse_mla_moe(
    hf: dict[str, Any],
    model_type: str,
    routing: RoutingMethod,
    *,
    norm_topk_prob: bool,
    rope_interleave: bool,
    defaults: dict[str, Any],
    num_extra_layers: int = 0,
) -> ModelConfig:
    """The ModelConfig of a DeepSeek-style config.json; `defaults` are transformers' values
    for keys the file may omit (they differ between V2 and V3). The MLA sizes have no default:
    a guess would load the wrong shapes or, worse, the right ones with the wrong meaning."""
    for key in MLA_KEYS:
        if key not in hf:
            raise ValueError(f"config.json for {model_type} is missing the key {key!r}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config key 'hidden_act' must be 'silu', got {act!r}")
    mla = MLADims(*(hf[key] for key in MLA_KEYS))
    theta, scaling = rope_of(hf, default_theta=1e4)

    def get(key: str) -> Any:
        value = hf.get(key)
        return defaults[key] if value is None else value

    num_layers, num_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    first_dense, frequency = get("first_k_dense_replace"), get("moe_layer_freq")
    for key, value in (("first_k_dense_replace", first_dense), ("moe_layer_freq", frequency)):
        minimum = 1 if key == "moe_layer_freq" else 0
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"config key {key!r} must be an integer >= {minimum}, got {value!r}")
    dense_layers = [i for i in range(num_layers) if i < first_dense or i % frequency != 0]
    moe_size = hf.get("moe_intermediate_size", defaults["moe_intermediate_size"])
    num_shared = get("n_shared_experts")
    if not isinstance(num_shared, int) or isinstance(num_shared, bool) or num_shared < 0:
        raise ValueError(
            f"config key 'n_shared_experts' must be an integer >= 0, got {num_shared!r}"
        )
    num_experts, top_k = hf.get("n_routed_experts") or num_experts_of(hf), hf["num_experts_per_tok"]
    check_routing_groups(num_experts, top_k, routing)
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        # Every head has its own key and value, all expanded from one shared latent.
        num_kv_heads=num_heads,
        head_dim=mla.qk_head_dim,
        rope_theta=theta,
        rms_norm_eps=float(get("rms_norm_eps")),
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=moe_size,
        intermediate_size=get("intermediate_size"),
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=tuple(dense_layers),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        eos_token_ids=eos_token_ids_of(hf),
        max_position_embeddings=get("max_position_embeddings"),
        use_qk_norm=False,
        attention_bias=bool(hf.get("attention_bias", False)),
        rope_scaling=scaling,
        rope_interleave=rope_interleave,
        mla=mla,
        routing=routing,
        router_in_float32=True,
        shared_expert_intermediate_size=moe_size * num_shared,
        num_extra_layers=num_extra_layers,
    )


def softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)² when scaled."""
    assert config.mla is not None
    scale = config.mla.qk_head_dim**-0.5
    if config.rope_scaling is not None:
        scale *= config.rope_scaling.softmax_scale_factor()
    return scale


def build_mla_moe(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | None,
    ep_context: ExpertParallelContext,
    ops: LayerOps,
) -> MoECausalLM:
    mla, hidden, eps = config.mla, config.hidden_size, config.rms_norm_eps
    assert mla is not None and isinstance(ops.attention, MLABackend), ops.attention
    scale = softmax_scale(config)

    def make_layer(layer_idx: int) -> DecoderLayer:
        attention = MLAttention(
            hidden,
            config.num_heads,
            mla,
            softmax_scale=scale,
            interleaved_rope=config.rope_interleave,
            bias=config.attention_bias,
            eps=LATENT_NORM_EPS,
            backend=ops.attention,
            dtype=dtype,
            device=device,
            norm_kernel=ops.norm,
        )
        is_moe = config.is_moe_layer(layer_idx)
        if is_moe:
            shared = None
            if config.shared_expert_intermediate_size:
                size = config.shared_expert_intermediate_size
                shared = DenseMLP(hidden, size, dtype, device)
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
            )
        else:
            mlp = DenseMLP(hidden, config.intermediate_size, dtype, device)
        return DecoderLayer(attention, mlp, hidden, eps, dtype, device, ops.norm, is_moe)

    kv_spec = LatentKVSpec(
        config.num_layers,
        mla.kv_lora_rank,
        mla.qk_rope_head_dim,
        config.num_heads,
        mla.qk_head_dim,
        mla.v_head_dim,
    )
    rotary = RotaryEmbedding(mla.qk_rope_head_dim, config.rope_theta, device, config.rope_scaling)
    return MoECausalLM(config, make_layer, rotary, kv_spec, dtype, device, ops.norm)


class MLALayout(CheckpointLayout):
    """DeepSeek's attention tensors: MLA projections and norms (the MoE side is the common
    layout's). Every tensor fills the parameter of the same name."""

    def attention_tensor_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        config = self.config
        mla, hidden, num_heads = config.mla, config.hidden_size, config.num_heads
        assert mla is not None
        attn = layer_prefix(layer) + "self_attn."
        q_size = num_heads * mla.qk_head_dim
        shapes: dict[str, tuple[int, ...]] = {}
        if mla.q_lora_rank is None:
            shapes[attn + "q_proj.weight"] = (q_size, hidden)
        else:
            shapes[attn + "q_a_proj.weight"] = (mla.q_lora_rank, hidden)
            shapes[attn + "q_a_layernorm.weight"] = (mla.q_lora_rank,)
            shapes[attn + "q_b_proj.weight"] = (q_size, mla.q_lora_rank)
        latent_size = mla.kv_lora_rank + mla.qk_rope_head_dim
        shapes[attn + "kv_a_proj_with_mqa.weight"] = (latent_size, hidden)
        shapes[attn + "kv_a_layernorm.weight"] = (mla.kv_lora_rank,)
        up_size = num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        shapes[attn + "kv_b_proj.weight"] = (up_size, mla.kv_lora_rank)
        shapes[attn + "o_proj.weight"] = (hidden, num_heads * mla.v_head_dim)
        if config.attention_bias:
            if mla.q_lora_rank is not None:
                shapes[attn + "q_a_proj.bias"] = (mla.q_lora_rank,)
            shapes[attn + "kv_a_proj_with_mqa.bias"] = (latent_size,)
            shapes[attn + "o_proj.bias"] = (hidden,)
        return shapes

    def parameter_for(self, name: str) -> tuple[str, slice]:
        return name, slice(None)
