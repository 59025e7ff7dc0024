"""Attention over the paged KV cache: step metadata, the cache layout, and the backends.

- `metadata.py`: `AttentionMetadata`, built once per step (positions, slots, block tables).
- `kv_cache.py`: the paged K/V layout `[layers, 2, blocks, block size, kv heads, head dim]`.
- `backend.py`: `AttentionBackend` (rotate + store, attend) and `PerRegime`.
- `torch_backend.py` (`torch`, any device and dtype) and `native_backend.py` (`native`, the
  CPU kernels): the implementations the config key `attention_backend` chooses between.
"""

from __future__ import annotations

from dist_engine.attention.backend import AttentionBackend, PerRegime


def attention_backend(name: str) -> AttentionBackend:
    """A new backend of that name (see `ATTENTION_BACKENDS`)."""
    if name == "torch":
        from dist_engine.attention.torch_backend import TorchAttention

        return TorchAttention()
    if name == "native":
        from dist_engine.attention.native_backend import NativeAttention

        return NativeAttention()
    raise ValueError(f"unknown attention backend {name!r}; known: {list(ATTENTION_BACKENDS)}")


ATTENTION_BACKENDS = ("native", "torch")

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "PerRegime", "attention_backend"]
