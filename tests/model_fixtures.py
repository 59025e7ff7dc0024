"""Helpers shared by the model, checkpoint and KV-cache tests (not collected as tests).

`PagedGreedyRunner` is a deliberately small stand-in for the real model runner: it hands out
shuffled (non-contiguous) KV blocks, prefills prompts — optionally in two chunks so the second
chunk attends to a cached prefix — and then decodes every sequence together in one batch.
"""

from __future__ import annotations

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
