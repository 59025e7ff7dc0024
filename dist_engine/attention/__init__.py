"""Attention over the paged KV cache: step metadata, the cache layouts, and the backends.

- `metadata.py`: `AttentionMetadata`, built once per step (positions, slots, block tables).
- `kv_cache.py`: what a cache layout is (`KVSpec`) and the per-head K/V layout
  `[layers, 2, blocks, block size, kv heads, head dim]`; `latent_cache.py`: MLA's latent
  layout `[layers, blocks, block size, kv_lora_rank + rope dim]`.
- `backend.py`: `AttentionBackend` (GQA: rotate + store, attend) and `PerRegime`;
  `mla_backend.py`: `MLABackend` (store latents, attend).
- the implementations the config key `attention_backend` chooses between, per attention kind
  (`ATTENTION_BACKENDS`): for GQA `torch_backend.py` (any device and dtype) and
  `native_backend.py` (the CPU kernels); for MLA `mla_torch.py`.
"""

from __future__ import annotations

import importlib

from dist_engine.attention.backend import AttentionBackend, PerRegime
from dist_engine.attention.mla_backend import MLABackend

# attention kind -> backend name -> "module:class". A kind without `native` runs `torch`
# whatever the setting says, and the resolution says so (dist_engine/backends.py).
ATTENTION_BACKENDS: dict[str, dict[str, str]] = {
    "gqa": {
        "native": "dist_engine.attention.native_backend:NativeAttention",
        "torch": "dist_engine.attention.torch_backend:TorchAttention",
    },
    "mla": {
        "torch": "dist_engine.attention.mla_torch:TorchMLA",
    },
}


def attention_backend(name: str, kind: str = "gqa") -> AttentionBackend | MLABackend:
    """A new backend `name` for attention of `kind` (see `ATTENTION_BACKENDS`)."""
    if kind not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention kind {kind!r}; known: {list(ATTENTION_BACKENDS)}")
    backends = ATTENTION_BACKENDS[kind]
    if name not in backends:
        raise ValueError(
            f"no {name!r} attention backend for {kind} attention; known: {list(backends)}"
        )
    module, cls = backends[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def has_backend(kind: str, name: str) -> bool:
    return name in ATTENTION_BACKENDS.get(kind, {})


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "MLABackend",
    "PerRegime",
    "attention_backend",
    "has_backend",
]
