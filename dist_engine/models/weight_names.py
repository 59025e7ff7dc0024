"""Hugging Face tensor names of the supported architectures, shared by writer and loader.

Two layouts exist for expert weights and both are read:

- per expert (what hub checkpoints hold and what transformers 5.x `save_pretrained` writes, since
  it converts back on save): Qwen3-MoE `mlp.experts.{e}.{gate,up,down}_proj.weight`, Mixtral
  `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` (w1 = gate, w3 = up, w2 = down);
- fused (transformers 5.x in-memory names): `mlp.experts.gate_up_proj [E, 2I, D]` (gate rows
  first, then up) and `mlp.experts.down_proj [E, D, I]`, router at `mlp.gate.weight`.

Shape legend: V = vocab, D = hidden, H = heads, Hkv = kv heads, Dh = head dim, E = experts,
I = expert intermediate size, F = dense MLP intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass

from dist_engine.models.config import ModelConfig


@dataclass(frozen=True)
class ExpertNames:
    """Where one layer's experts live in a checkpoint, in per-expert layout."""

    router: str
    gate: str  # format string with {e}
    up: str
    down: str
    fused_router: str
    fused_gate_up: str
    fused_down: str

    def per_expert(self, expert: int) -> tuple[str, str, str]:
        return (
            self.gate.format(e=expert),
            self.up.format(e=expert),
            self.down.format(e=expert),
        )


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def expert_names(config: ModelConfig, layer: int) -> ExpertNames:
    prefix = layer_prefix(layer)
    fused = prefix + "mlp."
    if config.model_type == "mixtral":
        moe = prefix + "block_sparse_moe."
        return ExpertNames(
            router=moe + "gate.weight",
            gate=moe + "experts.{e}.w1.weight",
            up=moe + "experts.{e}.w3.weight",
            down=moe + "experts.{e}.w2.weight",
            fused_router=fused + "gate.weight",
            fused_gate_up=fused + "experts.gate_up_proj",
            fused_down=fused + "experts.down_proj",
        )
    return ExpertNames(
        router=fused + "gate.weight",
        gate=fused + "experts.{e}.gate_proj.weight",
        up=fused + "experts.{e}.up_proj.weight",
        down=fused + "experts.{e}.down_proj.weight",
        fused_router=fused + "gate.weight",
        fused_gate_up=fused + "experts.gate_up_proj",
        fused_down=fused + "experts.down_proj",
    )


def expert_shapes(config: ModelConfig) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """Shapes of one expert's (gate [I, D], up [I, D], down [D, I])."""
    size, hidden = config.moe_intermediate_size, config.hidden_size
    return (size, hidden), (size, hidden), (hidden, size)


def dense_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor (attention, norms, embeddings, routers, dense MLPs) and its shape.

    Expert weights are left out: they are read per hosted expert, see `expert_names`. Routers
    are listed under their per-expert-layout name.
    """
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for layer in range(config.num_layers):
        prefix = layer_prefix(layer)
        attn = prefix + "self_attn."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        shapes[attn + "q_proj.weight"] = (q_size, hidden)
        shapes[attn + "k_proj.weight"] = (kv_size, hidden)
        shapes[attn + "v_proj.weight"] = (kv_size, hidden)
        shapes[attn + "o_proj.weight"] = (hidden, q_size)
        if config.attention_bias:
            shapes[attn + "q_proj.bias"] = (q_size,)
            shapes[attn + "k_proj.bias"] = (kv_size,)
            shapes[attn + "v_proj.bias"] = (kv_size,)
            shapes[attn + "o_proj.bias"] = (hidden,)
        if config.use_qk_norm:
            shapes[attn + "q_norm.weight"] = (head_dim,)
            shapes[attn + "k_norm.weight"] = (head_dim,)
        if config.is_moe_layer(layer):
            shapes[expert_names(config, layer).router] = (config.num_experts, hidden)
        else:
            size = config.intermediate_size
            shapes[prefix + "mlp.gate_proj.weight"] = (size, hidden)
            shapes[prefix + "mlp.up_proj.weight"] = (size, hidden)
            shapes[prefix + "mlp.down_proj.weight"] = (hidden, size)
    return shapes
