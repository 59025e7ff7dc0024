"""Helpers shared by the model, checkpoint and KV-cache tests (not collected as tests).

`PagedGreedyRunner` is a deliberately small stand-in for the real model runner: it hands out
shuffled (non-contiguous) KV blocks, prefills prompts — optionally in two chunks so the second
chunk attends to a cached prefix — and then decodes every sequence together in one batch.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from dist_engine.attention.metadata import AttentionMetadata
from dist_engine.models.decoder import MoECausalLM
from moe import DispatchMode

TINY_SIZES = {
    "hidden_size": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "top_k": 2,
    "moe_intermediate_size": 32,
    "vocab_size": 384,
}


# Tiny block-FP8 releases (make_tiny_checkpoint(..., fp8=True)): widths of 128 and 256 (whole
# 128x128 blocks) beside 64, 80, 96, 136, 192, 200 and 320 (a partial last block).
FP8_SIZES = {
    "deepseek_v3": {
        "vocab_size": 384,
        "hidden_size": 128,
        "num_heads": 4,
        "num_experts": 8,
        "top_k": 2,
        "moe_intermediate_size": 96,
        "intermediate_size": 320,
        "q_lora_rank": 136,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "num_layers": 3,
    },
    "qwen3_moe": {
        "vocab_size": 384,
        "hidden_size": 128,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "top_k": 2,
        "moe_intermediate_size": 96,
        "intermediate_size": 200,
        "mlp_only_layers": [1],
        "num_layers": 3,
    },
}
FP8_SIZES["deepseek_v2"] = {**FP8_SIZES["deepseek_v3"], "q_lora_rank": None}


def blockwise_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The test's own reading of a block-FP8 weight [O, I]: block (i, j) of 128x128 (cut at the
    edges) times scale_inv[i, j], in float32, block by block."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            block = (slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1)))
            out[block] = weight[block].to(torch.float32) * scale_inv[i, j].to(torch.float32)
    return out


def write_dequantized_reference(fp8_dir: Path, out_dir: Path) -> Path:
    """The float32 checkpoint a block-FP8 release stands for (`blockwise_dequantize` of every
    FP8 weight, the rest widened to float32, no `quantization_config`), for transformers."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(fp8_dir / "model.safetensors"))
    dense = {
        name: (
            blockwise_dequantize(tensor, tensors[name + "_scale_inv"])
            if tensor.dtype == torch.float8_e4m3fn
            else tensor.to(torch.float32)
        )
        for name, tensor in tensors.items()
        if not name.endswith("_scale_inv")
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(dense, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (out_dir / "config.json").write_text(json.dumps({**config, "dtype": "float32"}, indent=2))
    return out_dir


def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers reference, loaded offline; fails if any weight was not in the files."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=dtype,
        output_loading_info=True,
        local_files_only=True,
        # The eager loop is the plainest reference and, unlike grouped_mm, supports float64.
        experts_implementation="eager",
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def hf_greedy(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy `generate`, never stopping early at EOS."""
    ids = torch.tensor([list(prompt)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


class PagedGreedyRunner:
    """Greedy generation with our model over the paged KV cache."""

    def __init__(
        self, model: MoECausalLM, num_blocks: int = 512, block_size: int = 4, seed: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.cache = model.new_kv_cache(num_blocks, block_size)
        model.attach_kv_cache(self.cache)
        # Shuffled so consecutive blocks of a sequence are scattered over the cache.
        self.free_blocks = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free_blocks)

    def _ensure_blocks(self, table: list[int], num_tokens: int) -> None:
        while len(table) * self.block_size < num_tokens:
            table.append(self.free_blocks.pop())

    def step(
        self,
        tables: list[list[int]],
        num_cached: list[int],
        new_tokens: list[list[int]],
        mode: DispatchMode,
    ) -> torch.Tensor:
        """Run one batch; returns the logits of each sequence's last new token, [B, V]."""
        for table, cached, tokens in zip(tables, num_cached, new_tokens, strict=True):
            self._ensure_blocks(table, cached + len(tokens))
        attn = AttentionMetadata.build(
            tables,
            num_cached,
            [len(t) for t in new_tokens],
            self.block_size,
            is_prefill=mode is DispatchMode.NORMAL,
        )
        input_ids = torch.tensor([t for tokens in new_tokens for t in tokens], dtype=torch.int64)
        hidden = self.model(input_ids, attn.positions, attn, mode)
        last_rows = attn.query_start_loc[1:] - 1
        return self.model.compute_logits(hidden[last_rows])

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        chunked: Sequence[bool] = (),
    ) -> list[list[int]]:
        """Prefill all prompts in one batch (first halves only for the `chunked` ones), then
        their second halves in a second batch, then decode everything together."""
        num_seqs = len(prompts)
        chunked = list(chunked) + [False] * (num_seqs - len(chunked))
        tables: list[list[int]] = [[] for _ in prompts]
        first = [
            list(p[: len(p) // 2]) if c else list(p) for p, c in zip(prompts, chunked, strict=True)
        ]
        logits = self.step(tables, [0] * num_seqs, first, DispatchMode.NORMAL)
        next_tokens = logits.argmax(-1).tolist()
        second = [b for b in range(num_seqs) if chunked[b]]
        if second:
            logits = self.step(
                [tables[b] for b in second],
                [len(first[b]) for b in second],
                [list(prompts[b][len(first[b]) :]) for b in second],
                DispatchMode.NORMAL,
            )
            for b, token in zip(second, logits.argmax(-1).tolist(), strict=True):
                next_tokens[b] = token
        outputs = [[t] for t in next_tokens]
        for _ in range(max_new_tokens - 1):
            num_cached = [len(p) + len(o) - 1 for p, o in zip(prompts, outputs, strict=True)]
            logits = self.step(
                tables, num_cached, [[o[-1]] for o in outputs], DispatchMode.LOW_LATENCY
            )
            for output, token in zip(outputs, logits.argmax(-1).tolist(), strict=True):
                output.append(token)
        return outputs


def random_prompts(
    num_prompts: int, vocab_size: int, min_len: int, max_len: int, seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(vocab_size) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_prompts)
    ]


def make_hot_experts(model_dir: str | Path, boosts: dict[int, float]) -> Path:
    """Raise the selection bias (`e_score_correction_bias`, DeepSeek-V3's router) of some
    experts in every MoE layer of a checkpoint in place, so they are chosen for most tokens: a
    skewed router, as a trained model's bias leaves a few experts hot. boosts: expert -> what
    is added to its bias."""
    from safetensors.torch import load_file, save_file

    model_dir = Path(model_dir)
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(path)
        names = [name for name in tensors if name.endswith("e_score_correction_bias")]
        for name in names:
            for expert, boost in boosts.items():
                tensors[name][expert] += boost
        if names:
            save_file(tensors, path, metadata={"format": "pt"})
    return model_dir
