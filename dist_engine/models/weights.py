"""How an architecture names its tensors in a Hugging Face checkpoint, and where each goes.

An architecture states its own mapping (a `CheckpointLayout`): every non-expert tensor and its
shape, the alternative names a tensor may have, which model parameter (and which rows of it)
a checkpoint tensor fills, and where each layer's experts live. The loader (models/loader.py)
and the tiny-checkpoint writer (models/make_model.py) use nothing else, so they serve every
architecture alike.

Two layouts exist for expert weights and both are read:

- per expert (hub checkpoints, and what transformers 5.x `save_pretrained` writes, since it
  converts back on save): e.g. `mlp.experts.{e}.gate_proj.weight`;
- fused (transformers 5.x in-memory names): `mlp.experts.gate_up_proj [E, 2I, D]` (gate rows
  first, then up) and `mlp.experts.down_proj [E, D, I]`.

Shape legend: V = vocab, D = hidden, H = heads, Hkv = kv heads, Dh = head dim, E = experts,
I = expert intermediate size, F = dense MLP intermediate size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dist_engine.models.config import ModelConfig


@dataclass(frozen=True)
class ExpertNames:
    """Where one layer's experts live in a checkpoint, in either layout."""

    gate: str  # per-expert format strings with {e}
    up: str
    down: str
    fused_gate_up: str
    fused_down: str

    def per_expert(self, expert: int) -> tuple[str, str, str]:
        return (
            self.gate.format(e=expert),
            self.up.format(e=expert),
            self.down.format(e=expert),
        )


class CheckpointLayout:
    """The tensor names of one architecture. Subclasses state `expert_names`; the dense
    tensors of the common pre-norm GQA decoder are described here."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    # -- what the checkpoint holds ---------------------------------------------------------
    def dense_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every non-expert tensor (attention, norms, embeddings, routers, dense MLPs) and its
        shape, under its canonical name. Experts are read per hosted expert (`expert_names`)."""
        config = self.config
        hidden = config.hidden_size
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (config.vocab_size, hidden),
            "model.norm.weight": (hidden,),
        }
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, hidden)
        for layer in range(config.num_layers):
            prefix = layer_prefix(layer)
            shapes[prefix + "input_layernorm.weight"] = (hidden,)
            shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
            shapes.update(self.attention_tensor_shapes(layer))
            shapes.update(self.mlp_tensor_shapes(layer))
        return shapes

    def attention_tensor_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """Grouped-query attention: q/k/v/o projections (+ biases, + q/k norms)."""
        config = self.config
        hidden, head_dim = config.hidden_size, config.head_dim
        q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
        attn = layer_prefix(layer) + "self_attn."
        shapes = {
            attn + "q_proj.weight": (q_size, hidden),
            attn + "k_proj.weight": (kv_size, hidden),
            attn + "v_proj.weight": (kv_size, hidden),
            attn + "o_proj.weight": (hidden, q_size),
        }
        if config.attention_bias:
            shapes[attn + "q_proj.bias"] = (q_size,)
            shapes[attn + "k_proj.bias"] = (kv_size,)
            shapes[attn + "v_proj.bias"] = (kv_size,)
        if config.output_bias:
            shapes[attn + "o_proj.bias"] = (hidden,)
        if config.use_qk_norm:
            shapes[attn + "q_norm.weight"] = (head_dim,)
            shapes[attn + "k_norm.weight"] = (head_dim,)
        return shapes

    def mlp_tensor_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """An MoE layer's router (with its selection bias, when routing has one) and shared
        experts (with their gate), or a dense SwiGLU MLP."""
        config = self.config
        prefix, hidden = layer_prefix(layer), config.hidden_size
        if not config.is_moe_layer(layer):
            return _swiglu_shapes(prefix + "mlp.", config.intermediate_size, hidden)
        shapes = {self.router_name(layer): (config.num_experts, hidden)}
        if config.routing.correction_bias:
            shapes[prefix + "mlp.gate.e_score_correction_bias"] = (config.num_experts,)
        if config.shared_expert_intermediate_size:
            shared = prefix + "mlp." + self.shared_experts_name + "."
            shapes.update(_swiglu_shapes(shared, config.shared_expert_intermediate_size, hidden))
        if config.shared_expert_gate:
            shapes[prefix + "mlp.shared_expert_gate.weight"] = (1, hidden)
        return shapes

    # The shared experts' module name in checkpoints (DeepSeek, GLM; Qwen2-MoE: shared_expert).
    shared_experts_name = "shared_experts"

    def router_name(self, layer: int) -> str:
        return layer_prefix(layer) + "mlp.gate.weight"

    def expert_names(self, layer: int) -> ExpertNames:
        prefix = layer_prefix(layer) + "mlp.experts."
        return ExpertNames(
            gate=prefix + "{e}.gate_proj.weight",
            up=prefix + "{e}.up_proj.weight",
            down=prefix + "{e}.down_proj.weight",
            fused_gate_up=prefix + "gate_up_proj",
            fused_down=prefix + "down_proj",
        )

    def expert_shapes(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """Shapes of one expert's (gate [I, D], up [I, D], down [D, I])."""
        size, hidden = self.config.moe_intermediate_size, self.config.hidden_size
        return (size, hidden), (size, hidden), (hidden, size)

    # -- where it goes ----------------------------------------------------------------------
    def aliases(self, name: str) -> tuple[str, ...]:
        """Other names the tensor `name` may have in a checkpoint (tried in order)."""
        return ()

    def ignored(self, name: str) -> bool:
        """Whether a checkpoint tensor the model does not use is skipped rather than refused:
        the `num_extra_layers` past the last (DeepSeek-V3's and GLM-4.5's multi-token
        prediction modules, which serving without speculative decoding never runs)."""
        match = _LAYER.match(name)
        if match is None:
            return False
        return 0 <= int(match.group(1)) - self.config.num_layers < self.config.num_extra_layers

    def parameter_for(self, name: str) -> tuple[str, slice]:
        """The model parameter a checkpoint tensor fills, and which of its rows: HF's separate
        q/k/v projections go into rows of the fused `qkv_proj`; everything else fills a whole
        parameter of the same name."""
        match = _QKV_PART.match(name)
        if match is None:
            return name, slice(None)
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.self_attn.qkv_proj.{kind}", self.qkv_rows(part)

    def qkv_rows(self, part: str) -> slice:
        """Rows of the fused `qkv_proj` that hold HF's `{part}_proj`, part in q/k/v."""
        config = self.config
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        start = {"q": 0, "k": q_size, "v": q_size + kv_size}[part]
        return slice(start, start + (q_size if part == "q" else kv_size))


_QKV_PART = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _swiglu_shapes(prefix: str, size: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (size, hidden),
        prefix + "up_proj.weight": (size, hidden),
        prefix + "down_proj.weight": (hidden, size),
    }


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."
