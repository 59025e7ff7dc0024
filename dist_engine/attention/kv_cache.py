"""The paged KV cache of one rank: per layer, K and V as `[NB, BS, Hkv, Dh]` block arrays.

Shape legend: L = layers, NB = blocks, BS = block size (tokens per block), Hkv = kv heads,
Dh = head dim, T = tokens in the flat batch.

Token position `p` of a sequence lives in block `block_table[p // BS]` at offset `p % BS`, i.e.
at flat slot `block_table[p // BS] * BS + p % BS` of the `[NB * BS, Hkv, Dh]` view. Block 0 is
reserved by the scheduler (never handed to a sequence), which lets padding rows of block tables
point at it harmlessly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

# Block 0 is never allocated to a sequence (see the module docstring).
NUM_RESERVED_BLOCKS = 1


class PagedKVShape(Protocol):
    """What sizes the cache: a `PagedKVSpec`, or a `ModelConfig` (same attribute names)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class PagedKVSpec:
    """The cache an architecture with per-head K and V needs (its `MoECausalLM.kv_spec`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def values_per_token(self) -> int:
        """Cached values per token over all layers (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def allocate(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> KVCache:
        return KVCache(
            self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim, dtype, device
        )

    def check(self, cache: KVCache, dtype: torch.dtype) -> None:
        expected = (self.num_layers, self.num_kv_heads, self.head_dim)
        storage = cache.storage
        actual = (storage.shape[0], storage.shape[4], storage.shape[5])
        if actual != expected or storage.dtype != dtype:
            raise ValueError(
                f"KV cache (layers, kv_heads, head_dim)={actual} dtype={storage.dtype} does not "
                f"match the model's {expected} dtype={dtype}"
            )


def bytes_per_block(spec: PagedKVShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V together."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * element_size


def num_blocks_for_budget(
    spec: PagedKVShape, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    """The number of blocks (reserved block included) that fit in `budget_bytes`."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    per_block = bytes_per_block(spec, block_size, dtype)
    num_blocks = budget_bytes // per_block
    if num_blocks <= NUM_RESERVED_BLOCKS:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds {num_blocks} blocks of {per_block} bytes "
            f"(block_size={block_size}, dtype={dtype}, layers={spec.num_layers}, "
            f"kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}); need at least "
            f"{NUM_RESERVED_BLOCKS + 1}"
        )
    return num_blocks


class KVCache:
    """K and V block arrays for every layer, allocated once as one tensor."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        if num_blocks <= NUM_RESERVED_BLOCKS:
            raise ValueError(
                f"num_blocks must exceed the {NUM_RESERVED_BLOCKS} reserved block(s), "
                f"got {num_blocks}"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # [L, 2, NB, BS, Hkv, Dh]; zeros so never-written slots read as finite values.
        self.storage = torch.zeros(
            num_layers,
            2,
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype=dtype,
            device=device,
        )

    @classmethod
    def for_model(
        cls,
        config: PagedKVShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> KVCache:
        return cls(
            config.num_layers,
            num_blocks,
            block_size,
            config.num_kv_heads,
            config.head_dim,
            dtype,
            device,
        )

    @property
    def num_layers(self) -> int:
        return self.storage.shape[0]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each a `[NB, BS, Hkv, Dh]` view into the shared storage."""
        return self.storage[layer_idx, 0], self.storage[layer_idx, 1]


def slot_mapping_for(
    block_table: list[int], first_position: int, num_tokens: int, block_size: int
) -> list[int]:
    """Flat cache slots of positions `[first_position, first_position + num_tokens)`."""
    positions = range(first_position, first_position + num_tokens)
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]
