"""The `native` attention backend: Lockstep's CPU kernels (kernels/compute.py).

- decode: `paged_decode_attention` walks each sequence's blocks in place (scores of all heads,
  softmax, weighted values; one task per sequence on torch's OpenMP pool), any float dtype;
- prefill: `paged_prefill_attention`, float32 or bfloat16 (computed in float32): tasks of
  (sequence, kv head, 32 queries) largest first, an online softmax over blocks of 16 keys,
  nothing above the diagonal;
- rotary q/k plus the K/V cache write in one pass (`rope_write_kv`), float32 or bfloat16.

Where a kernel does not apply (another dtype, a non-contiguous cache, a GPU tensor) the call
goes to the `torch` backend, which computes the same thing.
"""

from __future__ import annotations

import torch

from dist_engine.attention.backend import AttentionBackend
from dist_engine.attention.metadata import AttentionMetadata
from dist_engine.attention.torch_backend import TorchAttention
from dist_engine.kernels import compute

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
ROPE_DTYPES = (torch.float32, torch.bfloat16)  # what csrc/rope_cache.cpp takes
PREFILL_DTYPES = (torch.float32, torch.bfloat16)  # and csrc/paged_prefill_attention.cpp


class NativeAttention(AttentionBackend):
    name = "native"

    def __init__(self) -> None:
        self.fallback = TorchAttention()
        self.decode_kernel = compute.decode_attention()
        self.prefill_kernel = compute.prefill_attention()
        self.rope_kernel = compute.rope_write_kv()
        if self.decode_kernel is None:
            raise RuntimeError("the CPU compute kernels did not build")

    def rotate_and_store(self, query, key, value, cos, sin, key_cache, value_cache, attn):
        if (
            query.dtype in ROPE_DTYPES
            and query.device.type == "cpu"
            and key_cache.dtype == cos.dtype == query.dtype
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
        ):
            return self.rope_kernel(
                query, key, value, cos, sin, attn.slot_mapping, key_cache, value_cache
            )
        return self.fallback.rotate_and_store(
            query, key, value, cos, sin, key_cache, value_cache, attn
        )

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        if attn.num_tokens == 0 or query.device.type != "cpu":
            return self.fallback.attend(query, key_cache, value_cache, attn)
        scale = query.shape[-1] ** -0.5
        if attn.max_query_len == 1 and query.dtype in FLOAT_DTYPES:
            # One query per sequence, rows already in sequence order.
            tables, lens = attn.block_tables, attn.context_lens
            return self.decode_kernel(
                query.contiguous(), key_cache, value_cache, tables, lens, scale
            )
        if (
            query.dtype in PREFILL_DTYPES
            and key_cache.dtype == value_cache.dtype == query.dtype
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
        ):
            return self.prefill_kernel(
                query.contiguous(),
                key_cache,
                value_cache,
                attn.block_tables,
                attn.query_start_loc,
                attn.num_cached_tokens,
                scale,
            )
        return self.fallback.attend(query, key_cache, value_cache, attn)
