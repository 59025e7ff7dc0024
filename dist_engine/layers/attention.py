"""Grouped-query self-attention of one decoder layer over the paged KV cache.

Shape legend: T = tokens in the flat batch, D = hidden, H = query heads, Hkv = kv heads,
Dh = head dim, NB = blocks, BS = block size.
"""

from __future__ import annotations

import torch
from torch import nn

from dist_engine.attention import AttentionBackend
from dist_engine.attention.metadata import StepMetadata
from dist_engine.layers.linear import Linear
from dist_engine.layers.norm import NormKernel, RMSNorm
from dist_engine.layers.rotary import apply_rotary


class GQAttention(nn.Module):
    """q/k/v projections, optional per-head q/k RMSNorm before RoPE (Qwen3), RoPE and the cache
    write and attention through the backend, output projection.

    q, k and v are one fused projection (`qkv_proj`, rows [q | k | v]): one GEMM per layer
    instead of three, which matters for decode-sized batches where each GEMM call costs more in
    overhead than in FLOPs. The checkpoint keeps HF's separate `q_proj`/`k_proj`/`v_proj`
    tensors; the loader copies each into its rows (`qkv_rows`). Other names follow HF
    (`o_proj`, `q_norm`, `k_norm`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool,
        qk_norm_eps: float | None,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | None = None,
        norm_kernel: NormKernel | None = None,
        output_bias: bool | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        """bias: on q/k/v (and o_proj unless `output_bias` says otherwise); rotary_dim: the
        leading dims of each head RoPE rotates (None: all)."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(hidden_size, q_size + 2 * kv_size, bias, dtype, device)
        output_bias = bias if output_bias is None else output_bias
        self.o_proj = Linear(q_size, hidden_size, output_bias, dtype, device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype, device, norm_kernel)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype, device, norm_kernel)
        self.backend = backend

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
        attn: StepMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """hidden: [T, D]; cos, sin: [T, rotary_dim]; kv_cache: this layer's (K, V), each
        [NB, BS, Hkv, Dh] → [T, D]."""
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        key_cache, value_cache = kv_cache
        outs = []
        for part, rows in attn.parts():  # one part, or a mixed step's prompt and decode rows
            q, k, v, c, s = query[rows], key[rows], value[rows], cos[rows], sin[rows]
            if self.rotary_dim == self.head_dim:
                q = self.backend.rotate_and_store(q, k, v, c, s, key_cache, value_cache, part)
            else:
                # Partial rotary (GLM-4.5): the backends rotate whole heads, so rotate here.
                q, k = _rotate_leading(q, c, s), _rotate_leading(k, c, s)
                self.backend.store(k, v, key_cache, value_cache, part)
            outs.append(self.backend.attend(q, key_cache, value_cache, part))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


def _rotate_leading(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, Dh]; cos, sin: [T, R] → x with its first R dims rotated (pairs (i, i + R/2)),
    the rest as they were."""
    rotary_dim = cos.shape[-1]
    return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
