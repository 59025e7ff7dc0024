"""What an MLA attention backend does: Multi-head Latent Attention over the latent cache of
attention/latent_cache.py.

Shape legend: T = tokens in the flat batch, H = heads, Dn = qk_nope_head_dim,
R = qk_rope_head_dim, Dv = v_head_dim, C = kv_lora_rank, NB = blocks, BS = block size.

The layer (layers/mla.py) projects and rotates; a backend stores each token's latent and rope
key (`store`) and attends (`attend`), given `kv_up`, the layer's `kv_b_proj` weight viewed per
head as `[H, Dn + Dv, C]`: rows `[:Dn]` of head h expand a latent into h's key (the "key
half"), rows `[Dn:]` into its value (the "value half"). How it attends — expanding the cached
latents into per-head K/V, or absorbing the key half into the query and the value half into
the output so scores are taken against the latents themselves — is the backend's choice, per
regime. Backends are chosen by `attention_backend` and registered per attention kind in
`attention.ATTENTION_BACKENDS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from dist_engine.attention.metadata import AttentionMetadata


class MLABackend(ABC):
    name: str

    @abstractmethod
    def store(
        self,
        latent: torch.Tensor,
        rope_key: torch.Tensor,
        cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> None:
        """Write latent [T, C] (normalised) and the rotated rope_key [T, R] to the slots
        `attn.slot_mapping` of cache [NB, BS, C + R]."""

    @abstractmethod
    def attend(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        cache: torch.Tensor,
        kv_up: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of q_nope [T, H, Dn] and the rotated q_rope [T, H, R] over each
        sequence's cached context (this step's entries included), kv_up [H, Dn + Dv, C],
        softmax scale `scale` → [T, H, Dv]."""
