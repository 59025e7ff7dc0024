"""What an attention backend does, and how a step picks one per regime.

Shape legend: T = tokens in the flat batch, H = query heads, Hkv = kv heads, Dh = head dim,
NB = blocks, BS = block size.

A backend owns the two operations of paged attention over the K/V layout of
attention/kv_cache.py: rotate q/k and store the step's K/V in the cache (`rotate_and_store`),
then attend over each sequence's cached context (`attend`). Backends are chosen by the config
key `attention_backend` (dist_engine/backends.py), separately for decode and prefill steps,
and registered in `attention.ATTENTION_BACKENDS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from dist_engine.attention.kv_cache import write_kv
from dist_engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def rotate_and_store(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        """Rotary on query [T, H, Dh] and key [T, Hkv, Dh] (cos, sin: [T, Dh]); the rotated
        keys and value [T, Hkv, Dh] go to the cache slots `attn.slot_mapping` of key_cache,
        value_cache [NB, BS, Hkv, Dh]. Returns the rotated query [T, H, Dh]."""

    def store(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> None:
        """The cache write alone, for keys the layer rotated itself (partial rotary): key,
        value [T, Hkv, Dh] → slots `attn.slot_mapping` of key_cache, value_cache."""
        write_kv(key, value, key_cache, value_cache, attn.slot_mapping)

    @abstractmethod
    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        """Causal attention of the rotated query [T, H, Dh] over each sequence's context in
        the cache (this step's K/V included) → [T, H, Dh]."""


class PerRegime(AttentionBackend):
    """One backend for decode steps and another for prefill steps (`attn.is_prefill`)."""

    def __init__(self, decode: AttentionBackend, prefill: AttentionBackend) -> None:
        self.decode = decode
        self.prefill = prefill
        self.name = decode.name if decode.name == prefill.name else "per-regime"

    def _for(self, attn: AttentionMetadata) -> AttentionBackend:
        return self.prefill if attn.is_prefill else self.decode

    def rotate_and_store(self, query, key, value, cos, sin, key_cache, value_cache, attn):
        return self._for(attn).rotate_and_store(
            query, key, value, cos, sin, key_cache, value_cache, attn
        )

    def store(self, key, value, key_cache, value_cache, attn):
        self._for(attn).store(key, value, key_cache, value_cache, attn)

    def attend(self, query, key_cache, value_cache, attn):
        return self._for(attn).attend(query, key_cache, value_cache, attn)
