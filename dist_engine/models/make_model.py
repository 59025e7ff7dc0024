"""Write tiny random Hugging Face-format MoE checkpoints (no hub, no transformers needed).

The directory holds `config.json` with the keys transformers 5.x writes, the weights in the
per-expert layout hub checkpoints use (one `model.safetensors`, or shards plus
`model.safetensors.index.json`), and a byte-level BPE `tokenizer.json` with a chat template.
With `fp8`, the checkpoint is a block-FP8 release in DeepSeek-V3's and Qwen3's format (see
`to_block_fp8_release`).

CLI: `lockstep make-model --arch ARCH --out DIR [--seed N] [--hidden-size ...] [--fp8]`, ARCH
any registered model_type (models/registry.py).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dist_engine.models import block_fp8
from dist_engine.models.config import ModelConfig
from dist_engine.models.registry import (
    BLOCK_FP8_MODEL_TYPES,
    get_architecture,
    parse_config,
    supported_model_types,
)

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
EOS_TOKEN = "<|endoftext|>"
CORRECTION_BIAS_STD = 0.1
CHAT_START_TOKEN = "<|im_start|>"
CHAT_END_TOKEN = "<|im_end|>"
# ChatML, the format of Qwen's chat models: one turn per message, then the assistant's opening.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A few lines of text so the BPE merges are real merges rather than an empty table.
_TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture-of-experts models route every token to a few experts.",
    "Data-parallel attention keeps a full copy of the attention weights on each rank.",
    "Wide expert parallelism spreads the experts over all ranks of the group.",
    "def forward(self, hidden_states): return self.experts(hidden_states)",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \"",
]


def make_tiny_checkpoint(
    arch: str,
    out_dir: str | Path,
    seed: int = 0,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    intermediate_size: int = 96,
    mlp_only_layers: Sequence[int] = (),
    norm_topk_prob: bool = True,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.1,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 4096,
    dtype: str = "float32",
    num_shards: int = 1,
    write_tokenizer: bool = True,
    fp8: bool = False,
    scale_dtype: str = "float32",
    **arch_options: Any,
) -> Path:
    """Write a random checkpoint of `arch` (any registered model_type) to `out_dir`.

    fp8: write it as a block-FP8 release (arch in `BLOCK_FP8_MODEL_TYPES`): the linear weights
    float8_e4m3fn with `weight_scale_inv` in `scale_dtype`, the other tensors in `dtype` (the
    releases use bfloat16), `quantization_config` in config.json.

    `initializer_range` defaults well above HF's 0.02 so that greedy logits are not near-tied
    (near ties make parity tests flaky). Norm weights are 1 + noise so tests see them applied.
    Options an architecture does not have are ignored (Mixtral: `intermediate_size`,
    `mlp_only_layers`, `norm_topk_prob`); `arch_options` are passed to the architecture's
    `tiny_hf_config`. Returns the directory.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if initializer_range <= 0:
        raise ValueError(f"initializer_range must be positive, got {initializer_range}")
    if fp8 and arch not in BLOCK_FP8_MODEL_TYPES:
        raise ValueError(
            f"fp8 checkpoints are written for {list(BLOCK_FP8_MODEL_TYPES)}, not {arch!r}"
        )
    if scale_dtype not in DTYPES:
        raise ValueError(f"scale_dtype must be one of {list(DTYPES)}, got {scale_dtype!r}")
    architecture = get_architecture(arch)
    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "initializer_range": initializer_range,
        "max_position_embeddings": max_position_embeddings,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "num_experts_per_tok": top_k,
        "num_local_experts": num_experts,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": 0 if write_tokenizer else None,
        "pad_token_id": None,
        "dtype": dtype,
        "use_cache": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "transformers_version": "5.24.0",
    }
    options = {
        "moe_intermediate_size": moe_intermediate_size,
        "intermediate_size": intermediate_size,
        "mlp_only_layers": list(mlp_only_layers),
        "norm_topk_prob": norm_topk_prob,
        **arch_options,
    }
    hf_config = architecture.tiny_hf_config(common, options)
    if fp8:
        hf_config["quantization_config"] = release_quantization_config(parse_config(hf_config))
    config = parse_config(hf_config)  # validates the sizes before any work
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if fp8:
        drawn = iter_random_weights(config, seed, initializer_range, torch.float32)
        tensors = to_block_fp8_release(config, drawn, DTYPES[dtype], DTYPES[scale_dtype])
    else:
        tensors = random_weights(config, seed, initializer_range, DTYPES[dtype])
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    save_safetensors(tensors, out, num_shards)
    if write_tokenizer:
        write_byte_level_tokenizer(out, vocab_size)
    return out


def random_weights(
    config: ModelConfig, seed: int, std: float, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, drawn from one seeded generator in a fixed order."""
    return dict(iter_random_weights(config, seed, std, dtype))


def iter_random_weights(
    config: ModelConfig, seed: int, std: float, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """`random_weights` one tensor at a time, so a caller converting each (to FP8, say) never
    holds the whole model in `dtype`."""
    generator = torch.Generator().manual_seed(seed)
    layout = get_architecture(config.model_type).layout(config)

    def draw(shape: tuple[int, ...], scale: float, offset: float = 0.0) -> torch.Tensor:
        values = torch.randn(shape, generator=generator, dtype=torch.float64)
        return (offset + scale * values).to(dtype)

    def draw_dense(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("e_score_correction_bias"):
            # Random init leaves the selection bias at zero, which would leave the path that
            # chooses experts by biased scores untested: draw it on the scale of the sigmoid
            # scores' spread, so it changes many tokens' choices.
            return draw(shape, CORRECTION_BIAS_STD)
        if len(shape) == 1 and "proj" not in name:  # norm weights
            return draw(shape, 0.1, offset=1.0)
        return draw(shape, std)

    for name, shape in layout.dense_tensor_shapes().items():
        yield name, draw_dense(name, shape)
    for layer in config.moe_layer_indices:
        names = layout.expert_names(layer)
        for expert in range(config.num_experts):
            for name, shape in zip(names.per_expert(expert), layout.expert_shapes(), strict=True):
                yield name, draw(shape, std)


def release_quantization_config(config: ModelConfig) -> dict[str, Any]:
    """config.json's `quantization_config` as the block-FP8 releases of `config`'s
    architecture write it: DeepSeek-V3's has the four keys; Qwen3-MoE's (e.g.
    Qwen3-30B-A3B-FP8) also lists the modules it left unquantized."""
    if config.model_type != "qwen3_moe":
        return block_fp8.release_quantization_config()
    skipped = ["lm_head"]
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        router = [prefix + "mlp.gate"] if config.is_moe_layer(layer) else []
        skipped += [prefix + "input_layernorm", *router, prefix + "post_attention_layernorm"]
    return block_fp8.release_quantization_config(modules_to_not_convert=skipped)


def to_block_fp8_release(
    config: ModelConfig,
    tensors: Iterator[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
    scale_dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as a block-FP8 release stores them: every 2-D linear weight
    but the embeddings, `lm_head` and the routers quantized per 128x128 block
    (`block_fp8.quantize`) with its `weight_scale_inv` in `scale_dtype` (DeepSeek-V3: float32;
    Qwen3's dense FP8 releases: bfloat16); the rest in `dtype`, except the selection bias,
    which DeepSeek-V3's release keeps in float32."""
    layout = get_architecture(config.model_type).layout(config)
    unquantized = {"model.embed_tokens.weight", "lm_head.weight"}
    unquantized |= {layout.router_name(layer) for layer in config.moe_layer_indices}
    items = tensors.items() if isinstance(tensors, dict) else tensors
    out: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        if tensor.dim() == 2 and name.endswith(".weight") and name not in unquantized:
            out[name], scale_inv = block_fp8.quantize(tensor)
            out[name + block_fp8.SCALE_SUFFIX] = scale_inv.to(scale_dtype)
        elif name.endswith("e_score_correction_bias"):
            out[name] = tensor.to(torch.float32)
        else:
            out[name] = tensor.to(dtype)
    return out


def save_safetensors(tensors: dict[str, torch.Tensor], out: Path, num_shards: int) -> None:
    """One `model.safetensors`, or `num_shards` files plus the HF index, split in name order."""
    names = sorted(tensors)
    if num_shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    if num_shards > len(names):
        raise ValueError(f"num_shards ({num_shards}) exceeds the number of tensors ({len(names)})")
    weight_map: dict[str, str] = {}
    per_shard = -(-len(names) // num_shards)
    for shard in range(num_shards):
        file_name = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = names[shard * per_shard : (shard + 1) * per_shard]
        save_file({n: tensors[n] for n in chunk}, str(out / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file_name))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_byte_level_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer whose ids all fall inside the model's vocabulary, with a
    ChatML chat template.

    The special tokens come first (the trainer puts them there): end-of-text is id 0, then
    ``<|im_start|>`` and ``<|im_end|>``; the 256 byte symbols follow, then as many merges as the
    vocabulary leaves room for. ``tokenizer_config.json`` carries the chat template, as Hugging
    Face checkpoints do; ``generation_config.json`` lists both end tokens as EOS, so a chat
    reply ends at ``<|im_end|>`` (config.json keeps end-of-text alone).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special_tokens = [EOS_TOKEN, CHAT_START_TOKEN, CHAT_END_TOKEN]
    minimum = 256 + len(special_tokens)
    if vocab_size < minimum:
        raise ValueError(
            f"a byte-level tokenizer needs vocab_size >= {minimum}, got {vocab_size}; "
            "pass write_tokenizer=False for smaller vocabularies"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TOKENIZER_CORPUS, trainer=trainer)
    assert tokenizer.get_vocab_size() <= vocab_size
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    eos_ids = [tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(CHAT_END_TOKEN)]
    generation_config = {"eos_token_id": eos_ids, "transformers_version": "5.24.0"}
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """`lockstep make-model`: write a tiny random checkpoint and print its directory."""
    parser = argparse.ArgumentParser(
        prog="lockstep make-model", description="Write a tiny random HF-format MoE checkpoint."
    )
    parser.add_argument("--arch", required=True, choices=list(supported_model_types()))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--moe-intermediate-size", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="tensor dtype (default float32; with --fp8, of the unquantized tensors: bfloat16)",
    )
    parser.add_argument("--initializer-range", type=float, default=0.1)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="write a block-FP8 release (float8_e4m3fn linear weights, 128x128 weight_scale_inv; "
        f"for {', '.join(BLOCK_FP8_MODEL_TYPES)})",
    )
    args = parser.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.fp8 else "float32")
    out = make_tiny_checkpoint(
        args.arch,
        args.out,
        seed=args.seed,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        num_experts=args.num_experts,
        top_k=args.top_k,
        moe_intermediate_size=args.moe_intermediate_size,
        initializer_range=args.initializer_range,
        dtype=dtype,
        num_shards=args.shards,
        fp8=args.fp8,
    )
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
