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

from dist_engine.attention.backend import AttentionBackend, PerRegime
from dist_engine.attention.mla_backend import MLABackend
from scheduler.registry import Lazy, Registry

# attention kind -> backend name -> its class, imported when chosen. A kind without `native`
# runs `torch` whatever the setting says, and the resolution says so (dist_engine/backends.py).
ATTENTION_BACKENDS: dict[str, Registry[type]] = {
    "gqa": Registry(
        "GQA attention backend",
        {
            "native": Lazy("dist_engine.attention.native_backend:NativeAttention"),
            "torch": Lazy("dist_engine.attention.torch_backend:TorchAttention"),
        },
    ),
    "mla": Registry(
        "MLA attention backend", {"torch": Lazy("dist_engine.attention.mla_torch:TorchMLA")}
    ),
}


def attention_backend(name: str, kind: str = "gqa") -> AttentionBackend | MLABackend:
    """A new backend `name` for attention of `kind` (see `ATTENTION_BACKENDS`)."""
    if kind not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention kind {kind!r}; known: {list(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[kind].get(name)()


def has_backend(kind: str, name: str) -> bool:
    return kind in ATTENTION_BACKENDS and name in ATTENTION_BACKENDS[kind]


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "MLABackend",
    "PerRegime",
    "attention_backend",
    "has_backend",
]
