"""Multi-head Latent Attention (DeepSeek-V2/V3) of one decoder layer over the latent cache.

Shape legend: T = tokens in the flat batch, D = hidden, H = heads, Q = q_lora_rank,
C = kv_lora_rank, Dn = qk_nope_head_dim, R = qk_rope_head_dim, Dv = v_head_dim.

Each token's keys and values are a function of one latent vector `c = norm(x W_a)[:C]` plus a
rotary key part shared by all heads (`x W_a [C:]`, rotated): head h's key is
`[c W_uk_h | rope_key]` and its value `c W_uv_h`, with `W_uk`, `W_uv` the two halves of
`kv_b_proj`. Only `[c | rope_key]` is cached (attention/latent_cache.py); the attention backend
(attention/mla_backend.py) decides whether to expand it or absorb `kv_b_proj` into the query
and output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dist_engine.attention.metadata import StepMetadata
from dist_engine.attention.mla_backend import MLABackend
from dist_engine.layers.linear import Linear
from dist_engine.layers.norm import NormKernel, RMSNorm
from dist_engine.layers.rotary import apply_rotary, apply_rotary_interleaved


@dataclass(frozen=True)
class MLADims:
    """The sizes of an MLA layer, in config.json's names."""

    q_lora_rank: int | None  # None: a full-rank q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        sizes = {
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
        }
        if self.q_lora_rank is not None:
            sizes["q_lora_rank"] = self.q_lora_rank
        for key, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config key {key!r} must be a positive integer, got {value!r}")
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError(
                f"config key 'qk_rope_head_dim' must be even for RoPE, got {self.qk_rope_head_dim}"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MLAttention(nn.Module):
    """q (full rank, or `q_a_proj` → `q_a_layernorm` → `q_b_proj`), the latent and rope key
    (`kv_a_proj_with_mqa` → `kv_a_layernorm` on the latent), RoPE on the rope parts, the cache
    write and attention through the backend, `o_proj`. Parameter names are HF's."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        dims: MLADims,
        *,
        softmax_scale: float,
        interleaved_rope: bool,
        bias: bool,
        eps: float,
        backend: MLABackend,
        dtype: torch.dtype,
        device: torch.device | None = None,
        norm_kernel: NormKernel | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.dims = dims
        self.scale = softmax_scale
        self.rotate = apply_rotary_interleaved if interleaved_rope else apply_rotary
        q_size = num_heads * dims.qk_head_dim
        if dims.q_lora_rank is None:
            self.q_proj = Linear(hidden_size, q_size, False, dtype, device)
        else:
            self.q_a_proj = Linear(hidden_size, dims.q_lora_rank, bias, dtype, device)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, eps, dtype, device, norm_kernel)
            self.q_b_proj = Linear(dims.q_lora_rank, q_size, False, dtype, device)
        latent_size = dims.kv_lora_rank + dims.qk_rope_head_dim
        self.kv_a_proj_with_mqa = Linear(hidden_size, latent_size, bias, dtype, device)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, eps, dtype, device, norm_kernel)
        up_size = num_heads * (dims.qk_nope_head_dim + dims.v_head_dim)
        self.kv_b_proj = Linear(dims.kv_lora_rank, up_size, False, dtype, device)
        self.kv_b_proj.keep_layout = True  # viewed per head in `forward`, never called
        self.o_proj = Linear(num_heads * dims.v_head_dim, hidden_size, bias, dtype, device)
        self.backend = backend

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: StepMetadata,
        kv_cache: tuple[torch.Tensor],
    ) -> torch.Tensor:
        """hidden: [T, D]; cos, sin: [T, R]; kv_cache: this layer's (entries [NB, BS, C + R],)
        → [T, D]."""
        dims, num_tokens = self.dims, hidden.shape[0]
        if dims.q_lora_rank is None:
            query = self.q_proj(hidden)
        else:
            query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        query = query.view(num_tokens, self.num_heads, dims.qk_head_dim)
        q_nope, q_rope = query.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
        latent, rope_key = self.kv_a_proj_with_mqa(hidden).split(
            [dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent)
        q_rope = self.rotate(q_rope, cos, sin)
        rope_key = self.rotate(rope_key.unsqueeze(1), cos, sin).squeeze(1)
        (cache,) = kv_cache
        kv_up = self.kv_b_proj.weight.view(self.num_heads, -1, dims.kv_lora_rank)
        outs = []
        for part, rows in attn.parts():  # one part, or a mixed step's prompt and decode rows
            self.backend.store(latent[rows], rope_key[rows], cache, part)
            outs.append(
                self.backend.attend(q_nope[rows], q_rope[rows], cache, kv_up, part, self.scale)
            )
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * dims.v_head_dim))
