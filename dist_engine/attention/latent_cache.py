"""MLA's paged latent cache: one vector per token per layer, shared by every head.

Shape legend: L = layers, NB = blocks, BS = block size, C = kv_lora_rank (the compressed
latent), R = qk_rope_head_dim (the decoupled rotary key), H = heads.

A DeepSeek-V3 layer caches `C + R = 512 + 64` values per token where per-head K and V would
take `H * (qk_head_dim + v_head_dim) = 128 * (192 + 128)`: 71x less. Row `[:C]` of an entry is
the normalised latent (`kv_a_layernorm` applied), `[C:]` the rotated key part. Slots are
addressed as in attention/kv_cache.py (block 0 reserved, `block * BS + offset`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dist_engine.attention.kv_cache import KVSpec, PagedCache, check_pool_size


@dataclass(frozen=True)
class LatentKVSpec(KVSpec):
    """The cache an MLA architecture needs; the head sizes only state what an expanded
    per-head cache would cost for comparison."""

    num_layers: int
    kv_lora_rank: int
    rope_dim: int
    num_heads: int
    qk_head_dim: int
    v_head_dim: int

    @property
    def entry_size(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def values_per_token_per_layer(self) -> int:
        return self.entry_size

    def expanded_values_per_token_per_layer(self) -> int:
        return self.num_heads * (self.qk_head_dim + self.v_head_dim)

    def describe_layout(self) -> str:
        return f"(latent {self.kv_lora_rank} + rope key {self.rope_dim})"

    def allocate(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> LatentKVCache:
        return LatentKVCache(
            self.num_layers, num_blocks, block_size, self.entry_size, dtype, device
        )

    def check(self, cache: PagedCache, dtype: torch.dtype) -> None:
        expected = (self.num_layers, self.entry_size)
        if not isinstance(cache, LatentKVCache):
            raise ValueError(
                f"the model needs a latent cache (layers, entry)={expected}, got "
                f"{type(cache).__name__}"
            )
        storage = cache.storage
        actual = (storage.shape[0], storage.shape[3])
        if actual != expected or storage.dtype != dtype:
            raise ValueError(
                f"latent cache (layers, entry)={actual} dtype={storage.dtype} does not match "
                f"the model's {expected} dtype={dtype}"
            )


class LatentKVCache(PagedCache):
    """`[L, NB, BS, C + R]`, zeroed so never-written slots read as finite values."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        entry_size: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        check_pool_size(num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.storage = torch.zeros(
            num_layers, num_blocks, block_size, entry_size, dtype=dtype, device=device
        )

    def layer(self, layer_idx: int) -> tuple[torch.Tensor]:
        """(entries,) of one layer: a `[NB, BS, C + R]` view into the shared storage."""
        return (self.storage[layer_idx],)
