"""Grouped-query self-attention of one decoder layer (Qwen3-MoE and Mixtral).

Shape legend: T = tokens in the flat batch, D = hidden, H = query heads, Hkv = kv heads,
Dh = head dim, NB = blocks, BS = block size.
"""

from __future__ import annotations

import torch
from torch import nn

from dist_engine.attention_metadata import AttentionMetadata
from dist_engine.layers import Linear, RMSNorm, apply_rotary
from dist_engine.model_config import ModelConfig
from dist_engine.paged_attention import paged_attention, write_kv


class Attention(nn.Module):
    """q/k/v projections, Qwen3's per-head q/k RMSNorm (before RoPE), RoPE, paged attention,
    output projection. Parameter names follow HF (`q_proj`, ..., `q_norm`, `k_norm`)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(hidden, q_size, bias, dtype, device)
        self.k_proj = Linear(hidden, kv_size, bias, dtype, device)
        self.v_proj = Linear(hidden, kv_size, bias, dtype, device)
        self.o_proj = Linear(q_size, hidden, bias, dtype, device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        """hidden: [T, D]; cos, sin: [T, Dh]; caches: [NB, BS, Hkv, Dh] → [T, D]."""
        num_tokens = hidden.shape[0]
        query = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
        key = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        value = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        write_kv(key, value, key_cache, value_cache, attn.slot_mapping)
        out = paged_attention(query, key_cache, value_cache, attn)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
