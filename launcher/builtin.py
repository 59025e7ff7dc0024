"""The built-in job: a tiny Qwen3-MoE (made on first use, cached) and a handful of prompts."""

from __future__ import annotations

import os
from pathlib import Path

from dist_engine.kernels.build import cache_root
from dist_engine.models.make_model import make_tiny_checkpoint

BUILTIN_MODEL_NAME = "tiny-qwen3-moe-v2"  # v2: the tokenizer has a chat template
BUILTIN_MODEL = dict(
    arch="qwen3_moe",
    seed=0,
    vocab_size=2048,
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    num_experts=16,
    top_k=4,
    moe_intermediate_size=256,
)
BUILTIN_PROMPTS = [
    "Mixture-of-experts models route every token to a few experts.",
    "Data-parallel attention keeps a full copy of the attention weights on each rank.",
    "The quick brown fox jumps over the lazy dog.",
    "Wide expert parallelism spreads the experts over all ranks of the group.",
    "def forward(self, hidden_states):",
    "A vote keeps every rank on the same kind of step.",
    "0123456789",
    "Once upon a time",
]


def builtin_model() -> Path:
    """The built-in model's directory, written the first time it is asked for."""
    target = cache_root() / "models" / BUILTIN_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    settings = dict(BUILTIN_MODEL)
    make_tiny_checkpoint(settings.pop("arch"), partial, **settings)
    try:
        partial.rename(target)  # atomic: a concurrent first use keeps whichever came first
    except OSError:
        if not (target / "config.json").is_file():
            raise
    return target
