"""Grouped-query self-attention of one decoder layer (Qwen3-MoE and Mixtral).

Shape legend: T = tokens in the flat batch, D = hidden, H = query heads, Hkv = kv heads,
Dh = head dim, NB = blocks, BS = block size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dist_engine.attention.metadata import AttentionMetadata
from dist_engine.attention.torch_backend import paged_attention, write_kv
from dist_engine.kernels import build as native
from dist_engine.layers.basic import Linear, RMSNorm, apply_rotary
from dist_engine.models.config import ModelConfig


class Attention(nn.Module):
    """q/k/v projections, Qwen3's per-head q/k RMSNorm (before RoPE), RoPE, paged attention,
    output projection.

    q, k and v are one fused projection (`qkv_proj`, rows [q | k | v]): one GEMM per layer
    instead of three, which matters for decode-sized batches where each GEMM call costs more in
    overhead than in FLOPs. The checkpoint keeps HF's separate `q_proj`/`k_proj`/`v_proj`
    tensors; the loader copies each into its rows (`qkv_rows`). Other names follow HF
    (`o_proj`, `q_norm`, `k_norm`).
    """

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(hidden, q_size + 2 * kv_size, bias, dtype, device)
        self.o_proj = Linear(q_size, hidden, bias, dtype, device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
        # Rotary + KV write in one pass on the CPU for float32 (dist_engine.native).
        self.rope_write_kv: Callable[..., torch.Tensor] | None = None
        if dtype == torch.float32 and (device is None or torch.device(device).type == "cpu"):
            self.rope_write_kv = native.rope_kernel()

    def qkv_rows(self, part: str) -> slice:
        """Rows of `qkv_proj` (weight and bias) that hold HF's `{part}_proj`, part in q/k/v."""
        index = "qkv".index(part)
        start = sum(self.split_sizes[:index])
        return slice(start, start + self.split_sizes[index])

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
        query, key, value = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        kernel = self.rope_write_kv
        if (
            kernel is not None
            and query.dtype == torch.float32
            and query.device.type == "cpu"
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
        ):
            query = kernel(query, key, value, cos, sin, attn.slot_mapping, key_cache, value_cache)
        else:
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
            write_kv(key, value, key_cache, value_cache, attn.slot_mapping)
        out = paged_attention(query, key_cache, value_cache, attn)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
