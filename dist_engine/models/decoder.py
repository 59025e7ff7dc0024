"""The MoE causal LM (Qwen3-MoE, Mixtral) for one device, over a flat batch and a paged cache.

Shape legend: T = tokens in the flat batch (sequences concatenated, no padding), N = rows that
need logits, D = hidden, V = vocab, Dh = head dim.

Module and parameter names mirror Hugging Face's (`model.layers.{i}.self_attn.o_proj.weight`,
...) so the loader maps checkpoint names with few exceptions (the fused `qkv_proj`, Mixtral's
`block_sparse_moe`). Expert weights live inside each
layer's `moe.MoELayer` and are filled through `MoELayer.load_expert`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dist_engine.attention.kv_cache import KVCache
from dist_engine.attention.metadata import AttentionMetadata
from dist_engine.layers.attention import Attention
from dist_engine.layers.basic import DenseMLP, Linear, RMSNorm, RotaryEmbedding, empty_parameter
from dist_engine.layers.moe import ExpertParallelContext, MoEBlock
from dist_engine.models.config import ModelConfig
from moe import DispatchMode

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        context: ExpertParallelContext,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, dtype, device)
        self.mlp: MoEBlock | DenseMLP
        if config.is_moe_layer(layer_idx):
            self.mlp = MoEBlock(config, context, dtype, device)
        else:
            self.mlp = DenseMLP(hidden, config.intermediate_size, dtype, device)
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv: tuple[torch.Tensor, torch.Tensor],
        mode: DispatchMode,
    ) -> torch.Tensor:
        attn_out = self.self_attn(self.input_layernorm(hidden), cos, sin, attn, *kv)
        hidden = hidden + attn_out
        normed = self.post_attention_layernorm(hidden)
        if isinstance(self.mlp, MoEBlock):
            return hidden + self.mlp(normed, mode)
        return hidden + self.mlp(normed)


class DecoderStack(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(
        self,
        config: ModelConfig,
        context: ExpertParallelContext,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = empty_parameter(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, context, dtype, device) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class MoECausalLM(nn.Module):
    """One rank's copy of the model. Expert parallelism comes in through `ep_context`; with the
    default, all experts are local and the model runs in a single process.

    Use `load_model` (dist_engine.models.loader) to build one from a checkpoint; a fresh instance
    holds uninitialised weights. Attach a `KVCache` before the first forward.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        ep_context: ExpertParallelContext | None = None,
    ) -> None:
        super().__init__()
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        device = torch.device(device) if device is not None else None
        self.config = config
        self.dtype = dtype
        self.ep_context = ep_context or ExpertParallelContext()
        self.model = DecoderStack(config, self.ep_context, dtype, device)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, device)
        if config.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device)
        self.kv_cache: KVCache | None = None
        if device is not None:
            # MoELayer takes no device argument; its expert weights are created on the CPU.
            self.to(device)

    def attach_kv_cache(self, kv_cache: KVCache) -> None:
        """Use `kv_cache` for every following forward (it must match the model's shape)."""
        expected = (self.config.num_layers, self.config.num_kv_heads, self.config.head_dim)
        storage = kv_cache.storage
        actual = (storage.shape[0], storage.shape[4], storage.shape[5])
        if actual != expected or storage.dtype != self.dtype:
            raise ValueError(
                f"KV cache (layers, kv_heads, head_dim)={actual} dtype={storage.dtype} does not "
                f"match the model's {expected} dtype={self.dtype}"
            )
        self.kv_cache = kv_cache

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        mode: DispatchMode,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 → final-normed hidden states [T, D].

        Writes the step's K/V into the attached cache at `attn.slot_mapping`. T = 0 is a valid
        placeholder forward: it still enters every MoE layer (an EP collective).
        """
        if self.kv_cache is None:
            raise RuntimeError("attach a KVCache (attach_kv_cache) before calling forward")
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(
                f"input_ids and positions must both be [T]; got {tuple(input_ids.shape)} and "
                f"{tuple(positions.shape)}"
            )
        if input_ids.shape[0] != attn.num_tokens:
            raise ValueError(
                f"batch has {input_ids.shape[0]} tokens but the attention metadata describes "
                f"{attn.num_tokens}"
            )
        hidden = F.embedding(input_ids, self.model.embed_tokens.weight)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        for layer_idx, layer in enumerate(self.model.layers):
            hidden = layer(hidden, cos, sin, attn, self.kv_cache.layer(layer_idx), mode)
        return self.model.norm(hidden)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] (rows of `forward`'s output that need a token) → logits [N, V],
        in float32 (float64 for a float64 model) so sampling never works on bf16 logits."""
        logits = F.linear(hidden, self.lm_head.weight)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))
