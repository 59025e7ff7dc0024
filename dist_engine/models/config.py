"""Model architecture settings in the names this project uses, and the helpers that read
them from a Hugging Face `config.json`.

Each architecture's module (models/qwen3_moe.py, ...) parses its own `model_type` into a
`ModelConfig`; the model registry picks the module. Both spellings that exist in the wild are
accepted where they differ: `num_experts` (Qwen hub checkpoints) or `num_local_experts` (what
transformers 5.x writes), and a top-level `rope_theta` (transformers 4.x) or
`rope_parameters: {"rope_theta": ...}` (5.x).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dist_engine.layers.mla import MLADims
from dist_engine.layers.rotary import YarnScaling
from dist_engine.models.block_fp8 import BlockFP8Format
from moe import SOFTMAX_TOPK, RoutingMethod
from moe.routing import check_group_limits

# Keys every supported architecture must state; the others have HF defaults.
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_experts_per_tok",
)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one MoE causal LM, in the names this project uses."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    # Size of the dense MLP in layers that have one (Qwen3-MoE `mlp_only_layers`); Mixtral has none.
    intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    # Qwen3 normalises each head of q and k (RMSNorm over the head dim) before RoPE.
    use_qk_norm: bool
    attention_bias: bool
    # -- what only some architectures have (the defaults: absent) ----------------------------
    # YaRN context extension (None: default RoPE); pairs rotated interleaved (DeepSeek).
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = False
    # The share of each head's dims that RoPE rotates (GLM-4.5: the first half).
    partial_rotary_factor: float = 1.0
    # Whether o_proj has a bias; None: as attention_bias (Qwen2-MoE, GLM-4.5: only q/k/v do).
    attention_output_bias: bool | None = None
    # Multi-head Latent Attention sizes (DeepSeek); None: grouped-query attention.
    mla: MLADims | None = None
    routing: RoutingMethod = SOFTMAX_TOPK
    # The router's weight and logits in float32 whatever the model's dtype (DeepSeek, GLM).
    router_in_float32: bool = False
    # Size of the shared experts' MLP, all of them together (0: none); Qwen2-MoE scales its
    # shared expert's output by sigmoid(shared_expert_gate(x)).
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # Layers a checkpoint may hold past num_layers (multi-token prediction, DeepSeek-V3 and
    # GLM-4.5): skipped when loading, as transformers does.
    num_extra_layers: int = 0
    # How the checkpoint stores its linear weights: None, as plain floats; or block-quantized
    # FP8 (`quantization_config`), dequantized to the run dtype as they load.
    quantization: BlockFP8Format | None = None

    def __post_init__(self) -> None:
        positive = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.moe_intermediate_size,
            "decoder_sparse_step": self.decoder_sparse_step,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for key, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config key {key!r} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0 and self.mla is None:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 != 0:
            raise ValueError(
                f"config key 'partial_rotary_factor' ({self.partial_rotary_factor}) must be in "
                f"(0, 1] and rotate an even number of head_dim's {self.head_dim} dims"
            )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) exceeds the number of experts "
                f"({self.num_experts})"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"config key 'rope_theta' must be positive, got {self.rope_theta!r}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"config key 'rms_norm_eps' must be positive, got {self.rms_norm_eps}")
        bad_layers = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad_layers:
            raise ValueError(
                f"mlp_only_layers {list(self.mlp_only_layers)} has layers {bad_layers} outside "
                f"[0, {self.num_layers})"
            )
        if any(not self.is_moe_layer(i) for i in range(self.num_layers)) and (
            self.intermediate_size <= 0
        ):
            raise ValueError(
                f"config has dense MLP layers but intermediate_size is {self.intermediate_size}"
            )

    @property
    def rotary_dim(self) -> int:
        """The dims of each (GQA) head that RoPE rotates: the first ones."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def output_bias(self) -> bool:
        return (
            self.attention_bias
            if self.attention_output_bias is None
            else self.attention_output_bias
        )

    @property
    def attention_kind(self) -> str:
        """Which attention the layers run, and so which backends and cache layout apply."""
        return "gqa" if self.mla is None else "mla"

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen3-MoE's rule: sparse unless listed in mlp_only_layers or off the sparse step."""
        if layer_idx in self.mlp_only_layers:
            return False
        return (layer_idx + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layer_indices(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The JSON object in `<model_dir>/config.json`; errors name the file and the problem."""
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {str(model_dir)!r}")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(hf, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(hf).__name__}")
    return hf


def require_keys(hf: dict[str, Any], keys: tuple[str, ...]) -> None:
    model_type = hf.get("model_type")
    for key in keys:
        if key not in hf:
            raise ValueError(f"config.json for {model_type} is missing the key {key!r}")


def num_experts_of(hf: dict[str, Any]) -> int:
    """`num_experts` (Qwen hub checkpoints) or `num_local_experts` (transformers 5.x)."""
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if num_experts is None:
        raise ValueError(
            f"config.json for {hf.get('model_type')} names neither 'num_experts' nor "
            "'num_local_experts'"
        )
    return num_experts


def num_mtp_layers_of(hf: dict[str, Any]) -> int:
    """The multi-token-prediction layers a checkpoint may carry past the last layer
    (`num_nextn_predict_layers`; transformers' default is 1)."""
    value = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1))
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(
            f"config key 'num_nextn_predict_layers' must be an integer >= 0, got {value!r}"
        )
    return value


def head_dim_of(hf: dict[str, Any]) -> int:
    return hf.get("head_dim") or _int(hf, "hidden_size") // _int(hf, "num_attention_heads")


def rope_theta_of(hf: dict[str, Any], default: float) -> float:
    """A top-level `rope_theta` (transformers 4.x) or `rope_parameters.rope_theta` (5.x)."""
    return float(_rope_theta(hf, default))


def rope_of(hf: dict[str, Any], default_theta: float) -> tuple[float, YarnScaling | None]:
    """(theta, YaRN scaling or None) from either spelling: transformers 4.x writes a top-level
    `rope_theta` and `rope_scaling: {"type": ...}`, 5.x `rope_parameters: {"rope_type": ...,
    "rope_theta": ...}`. Types other than default and yarn raise, naming the key."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or {}
    if not isinstance(params, dict):
        raise ValueError(f"config key {key!r} must be an object, got {params!r}")
    theta = float(_rope_theta({**hf, "rope_parameters": params}, default_theta))
    type_key = "rope_type" if "rope_type" in params else "type"
    rope_type = params.get(type_key, "default")
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ValueError(
            f"config key '{key}.{type_key}' is {rope_type!r}; supported: 'default', 'yarn'"
        )
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 1:
        raise ValueError(f"config key '{key}.factor' must be a number >= 1, got {factor!r}")
    original = params.get(
        "original_max_position_embeddings",
        hf.get("original_max_position_embeddings", hf.get("max_position_embeddings")),
    )
    if not isinstance(original, int) or original < 1:
        raise ValueError(
            f"config key '{key}.original_max_position_embeddings' must be a positive integer, "
            f"got {original!r}"
        )
    numbers = {}
    for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
        value = params.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise ValueError(f"config key '{key}.{name}' must be a number, got {value!r}")
        numbers[name] = None if value is None else float(value)
    scaling = YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=original,
        # transformers takes 32 and 1 for missing (and zero) betas.
        beta_fast=numbers["beta_fast"] or 32.0,
        beta_slow=numbers["beta_slow"] or 1.0,
        mscale=numbers["mscale"],
        mscale_all_dim=numbers["mscale_all_dim"],
        attention_factor=numbers["attention_factor"],
        truncate=bool(params.get("truncate", True)),
    )
    return theta, scaling


def gqa_shape_of(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields every GQA architecture reads alike from `config.json`: vocabulary,
    widths, layer and head counts (kv heads default to the query heads), head dim, tied
    embeddings and EOS ids."""
    num_heads = hf["num_attention_heads"]
    return {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": num_heads,
        "num_kv_heads": hf.get("num_key_value_heads", num_heads),
        "head_dim": head_dim_of(hf),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "eos_token_ids": eos_token_ids_of(hf),
    }


def eos_token_ids_of(hf: dict[str, Any]) -> tuple[int, ...]:
    return _eos_ids(hf.get("eos_token_id"))


def check_default_rope_and_silu(hf: dict[str, Any]) -> None:
    """Refuse settings that would silently change the math if ignored."""
    params = hf.get("rope_parameters") or {}
    rope_type = params.get("rope_type", "default")
    scaling = hf.get("rope_scaling")
    if rope_type != "default" or scaling:
        raise ValueError(
            f"only default RoPE is supported; got rope_parameters={params!r}, "
            f"rope_scaling={scaling!r}"
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config key 'hidden_act' must be 'silu', got {act!r}")


def refuse_sliding_window(window: object) -> None:
    if window is not None:
        raise ValueError(f"sliding-window attention is not supported; got sliding_window={window}")


def _int(hf: dict[str, Any], key: str) -> int:
    value = hf[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config key {key!r} must be a positive integer, got {value!r}")
    return value


def _rope_theta(hf: dict[str, Any], default: float) -> float:
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", default))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise ValueError(f"config key 'rope_theta' must be a number, got {theta!r}")
    return theta


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ValueError(f"config key 'eos_token_id' must be an int or a list of ints, got {value!r}")


def check_routing_groups(num_experts: int, top_k: int, routing: RoutingMethod) -> None:
    """Grouped routing's `n_group` / `topk_group` against the experts, as an error naming the
    config keys (DeepSeek-V3/V2, GLM-4.5)."""
    try:
        check_group_limits(num_experts, top_k, routing.num_groups, routing.topk_groups)
    except ValueError as error:
        raise ValueError(
            f"config keys 'n_group' and 'topk_group' do not fit the experts: {error}"
        ) from None
