"""The paged KV cache of one rank: what a cache layout is (`KVSpec`), and the per-head layout,
K and V as `[NB, BS, Hkv, Dh]` block arrays per layer. MLA's latent layout is in
attention/latent_cache.py.

Shape legend: L = layers, NB = blocks, BS = block size (tokens per block), Hkv = kv heads,
Dh = head dim, T = tokens in the flat batch.

Token position `p` of a sequence lives in block `block_table[p // BS]` at offset `p % BS`, i.e.
at flat slot `block_table[p // BS] * BS + p % BS` of the `[NB * BS, Hkv, Dh]` view. Block 0 is
reserved by the scheduler (never handed to a sequence), which lets padding rows of block tables
point at it harmlessly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

# Block 0 is never allocated to a sequence (see the module docstring).
NUM_RESERVED_BLOCKS = 1


class PagedKVShape(Protocol):
    """What sizes a per-head K/V cache: a `PagedKVSpec`, or a GQA `ModelConfig` (same
    attribute names)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


class KVSpec(ABC):
    """The cache layout an architecture needs (its `MoECausalLM.kv_spec`): what one token costs
    and how to allocate and check a pool. `PagedKVSpec` (per-head K and V) and
    `attention.latent_cache.LatentKVSpec` (MLA's one latent vector per token) implement it."""

    num_layers: int

    @abstractmethod
    def values_per_token_per_layer(self) -> int:
        """Cached values one token takes in one layer."""

    def expanded_values_per_token_per_layer(self) -> int:
        """What a per-head K/V cache of the same attention would hold per token and layer
        (the same as `values_per_token_per_layer` for a per-head cache)."""
        return self.values_per_token_per_layer()

    @abstractmethod
    def describe_layout(self) -> str:
        """One token's entry in one layer, in words (for the start-up log)."""

    @abstractmethod
    def allocate(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> PagedCache:
        """A zeroed pool of `num_blocks` blocks of `block_size` tokens."""

    @abstractmethod
    def check(self, cache: PagedCache, dtype: torch.dtype) -> None:
        """ValueError unless `cache` has this layout and dtype."""

    def values_per_token(self) -> int:
        """Cached values per token over all layers."""
        return self.num_layers * self.values_per_token_per_layer()

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.values_per_token() * _element_size(dtype)

    def expanded_bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.num_layers * self.expanded_values_per_token_per_layer() * _element_size(dtype)

    def describe(self, dtype: torch.dtype) -> str:
        """The per-token cost, as the engine states it at start-up."""
        per_token = self.bytes_per_token(dtype)
        text = (
            f"{per_token} bytes per token = {self.describe_layout()} x {self.num_layers} layers "
            f"x {_element_size(dtype)} bytes"
        )
        expanded = self.expanded_bytes_per_token(dtype)
        if expanded != per_token:
            text += (
                f"; an expanded per-head K/V cache would take {expanded} bytes per token "
                f"({expanded / per_token:.1f}x)"
            )
        return text


@dataclass(frozen=True)
class PagedKVSpec(KVSpec):
    """The cache an architecture with per-head K and V needs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def values_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def describe_layout(self) -> str:
        return f"(K + V) x {self.num_kv_heads} kv heads x {self.head_dim} dims"

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

    def check(self, cache: PagedCache, dtype: torch.dtype) -> None:
        expected = (self.num_layers, self.num_kv_heads, self.head_dim)
        if not isinstance(cache, KVCache):
            raise ValueError(
                f"the model needs a per-head K/V cache {expected}, got {type(cache).__name__}"
            )
        storage = cache.storage
        actual = (storage.shape[0], storage.shape[4], storage.shape[5])
        if actual != expected or storage.dtype != dtype:
            raise ValueError(
                f"KV cache (layers, kv_heads, head_dim)={actual} dtype={storage.dtype} does not "
                f"match the model's {expected} dtype={dtype}"
            )


def as_kv_spec(spec: KVSpec | PagedKVShape) -> KVSpec:
    """A `KVSpec`, or the per-head spec of a GQA shape (a `ModelConfig`)."""
    if isinstance(spec, KVSpec):
        return spec
    if getattr(spec, "mla", None) is not None:
        raise ValueError("an MLA model's cache is a latent cache: pass the model's kv_spec")
    return PagedKVSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim)


def bytes_per_block(spec: KVSpec | PagedKVShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers."""
    return block_size * as_kv_spec(spec).bytes_per_token(dtype)


def num_blocks_for_budget(
    spec: KVSpec | PagedKVShape, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    """The number of blocks (reserved block included) that fit in `budget_bytes`."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    spec = as_kv_spec(spec)
    per_block = bytes_per_block(spec, block_size, dtype)
    num_blocks = budget_bytes // per_block
    if num_blocks <= NUM_RESERVED_BLOCKS:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds {num_blocks} blocks of {per_block} bytes "
            f"(block_size={block_size}, dtype={dtype}, {spec.describe_layout()} x "
            f"{spec.num_layers} layers); need at least {NUM_RESERVED_BLOCKS + 1}"
        )
    return num_blocks


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class PagedCache(ABC):
    """A rank's block pool for every layer, allocated once as one tensor (`storage`); a layer
    reads and writes its share through `layer(i)`."""

    storage: torch.Tensor
    num_blocks: int
    block_size: int

    @property
    def num_layers(self) -> int:
        return self.storage.shape[0]

    @abstractmethod
    def layer(self, layer_idx: int) -> tuple[torch.Tensor, ...]:
        """This layer's views into `storage`, as its attention backend takes them."""


def check_pool_size(num_blocks: int, block_size: int) -> None:
    if num_blocks <= NUM_RESERVED_BLOCKS:
        raise ValueError(
            f"num_blocks must exceed the {NUM_RESERVED_BLOCKS} reserved block(s), got {num_blocks}"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


class KVCache(PagedCache):
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
        check_pool_size(num_blocks, block_size)
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
        """The per-head cache of a GQA model config (an MLA model: `model.new_kv_cache`)."""
        spec = as_kv_spec(config)
        assert isinstance(spec, PagedKVSpec)
        return spec.allocate(num_blocks, block_size, dtype, device)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each a `[NB, BS, Hkv, Dh]` view into the shared storage."""
        return self.storage[layer_idx, 0], self.storage[layer_idx, 1]


def slot_mapping_for(
    block_table: list[int], first_position: int, num_tokens: int, block_size: int
) -> list[int]:
    """Flat cache slots of positions `[first_position, first_position + num_tokens)`."""
    positions = range(first_position, first_position + num_tokens)
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the step's new keys/values. key, value: [T, Hkv, Dh]; caches: [NB, BS, Hkv, Dh]."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
