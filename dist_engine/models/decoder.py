"""The decoder every supported architecture shares, over a flat batch and a paged cache.

Shape legend: T = tokens in the flat batch (sequences concatenated, no padding), N = rows that
need logits, D = hidden, V = vocab, Dh = head dim.

Embeddings → pre-norm decoder layers (`x + attn(norm(x))`, then `h + mlp(norm(h))`) → final
norm → LM head. What differs between architectures is what goes inside a layer (which
attention, which MLP per layer, which norms) and how tensors are named; each architecture's
module (models/qwen3_moe.py, ...) builds its layers from the pieces in dist_engine/layers and
states its checkpoint layout (models/weights.py).

Module and parameter names mirror Hugging Face's (`model.layers.{i}.self_attn.o_proj.weight`,
...) so checkpoints map with few exceptions, which the layout states. Expert weights live
inside each MoE layer's `moe.MoELayer` and are filled through `MoELayer.load_expert`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dist_engine.attention.kv_cache import KVSpec, PagedCache
from dist_engine.attention.metadata import StepMetadata
from dist_engine.layers.linear import Linear, LinearKernel, empty_parameter, linear, pack_weight
from dist_engine.layers.norm import NormKernel, RMSNorm
from dist_engine.layers.rotary import RotaryEmbedding
from dist_engine.models.config import ModelConfig
from moe import DispatchMode

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h)).

    `mlp` is a dense MLP (`mlp(x)`) or an MoE block (`mlp(x, mode)`, `takes_mode = True`):
    the MoE block must know the step's dispatch mode.
    """

    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device | None,
        norm_kernel: NormKernel | None,
        mlp_takes_mode: bool,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.mlp_takes_mode = mlp_takes_mode
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype, device, norm_kernel)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype, device, norm_kernel)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: StepMetadata,
        kv_cache: tuple[torch.Tensor, ...],
        mode: DispatchMode,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attn, kv_cache)
        normed = self.post_attention_layernorm(hidden)
        if self.mlp_takes_mode:
            return hidden + self.mlp(normed, mode)
        return hidden + self.mlp(normed)


class DecoderStack(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(
        self,
        config: ModelConfig,
        layers: list[DecoderLayer],
        dtype: torch.dtype,
        device: torch.device | None,
        norm_kernel: NormKernel | None,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = empty_parameter(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, norm_kernel)


class MoECausalLM(nn.Module):
    """One rank's copy of a model. Expert parallelism comes in through the MoE layers'
    `ExpertParallelContext`; the model code itself is single-device.

    Build one with `models.load_model` (from a checkpoint) or `models.build_model` (empty
    weights); attach a KV cache (`new_kv_cache`, `attach_kv_cache`) before the first forward.
    """

    def __init__(
        self,
        config: ModelConfig,
        make_layer: Callable[[int], DecoderLayer],
        rotary: RotaryEmbedding,
        kv_spec: KVSpec,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        norm_kernel: NormKernel | None = None,
    ) -> None:
        super().__init__()
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        device = torch.device(device) if device is not None else None
        self.config = config
        self.dtype = dtype
        self.kv_spec = kv_spec
        layers = [make_layer(i) for i in range(config.num_layers)]
        self.model = DecoderStack(config, layers, dtype, device, norm_kernel)
        self.rotary = rotary
        if config.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device)
        self.kv_cache: PagedCache | None = None
        self.linear_kernel: LinearKernel | None = None  # the LM head's (use_linear_kernel)
        self.lm_head_packed: torch.Tensor | None = None  # a tied head's packed copy
        if device is not None:
            # The parameters are on `device` already; the MoE layers' small buffers (replica
            # maps, counters) are made on the CPU and follow here.
            self.to(device)

    def use_linear_kernel(self, kernel: LinearKernel | None) -> None:
        """Every dense linear of the model, and the LM head (tied or not), runs through
        `kernel` where it serves (None: PyTorch's `F.linear` everywhere). A kernel that wants
        weights stored [in, out] gets them in every `Linear` (a tied LM head stays the
        embedding's [vocab, hidden] rows: a lookup reads those)."""
        self.linear_kernel = kernel
        for module in self.modules():
            if isinstance(module, Linear):
                module.kernel = kernel
                if kernel is not None and kernel.weights_in_out:
                    module.store_in_out()

    def pack_linears(self) -> None:
        """Once the weights are loaded, where the linear kernel reads packed weights
        (`onednn_packed`): every dense linear and the LM head keep a packed copy of theirs
        (the plain weights stay: the other regime, and a tied head's lookups, read them)."""
        if self.linear_kernel is None or not self.linear_kernel.packs:
            return
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if not isinstance(self.lm_head, Linear):  # tied: the embedding's rows
            self.lm_head_packed = pack_weight(self.lm_head.weight)

    def new_kv_cache(
        self, num_blocks: int, block_size: int, device: torch.device | str | None = None
    ) -> PagedCache:
        """A paged cache in this model's layout (`kv_spec`) and dtype."""
        return self.kv_spec.allocate(num_blocks, block_size, self.dtype, device)

    def attach_kv_cache(self, kv_cache: PagedCache) -> None:
        """Use `kv_cache` for every following forward (it must match the model's layout)."""
        self.kv_spec.check(kv_cache, self.dtype)
        self.kv_cache = kv_cache

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: StepMetadata,
        mode: DispatchMode,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 → final-normed hidden states [T, D].

        Writes the step's K/V into the attached cache at `attn.slot_mapping`. T = 0 is a valid
        placeholder forward: it still enters every MoE layer (an EP collective).
        """
        if self.kv_cache is None:
            raise RuntimeError("attach a KV cache (attach_kv_cache) before calling forward")
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
        head = self.lm_head
        packed = head.packed if isinstance(head, Linear) else self.lm_head_packed
        logits = linear(hidden, head.weight, kernel=self.linear_kernel, packed=packed)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))
