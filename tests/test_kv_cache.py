"""Paged KV cache: slot math, metadata, and paged attention against dense causal attention."""

from __future__ import annotations

import math

import pytest
import torch

import dist_engine.paged_attention as paged_attention_module
from dist_engine.attention_metadata import AttentionMetadata
from dist_engine.kv_cache import KVCache, bytes_per_block, num_blocks_for_budget, slot_mapping_for
from dist_engine.model_config import ModelConfig
from dist_engine.paged_attention import paged_attention, write_kv

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 8, 4


def test_slot_mapping_math() -> None:
    table = [7, 3, 9]
    # Positions 2..6 with BS=4: block 7 offsets 2,3 then block 3 offsets 0,1,2.
    assert slot_mapping_for(table, 2, 5, 4) == [30, 31, 12, 13, 14]
    attn = AttentionMetadata.build([table, [5]], [2, 0], [5, 1], 4, is_prefill=True)
    assert attn.slot_mapping.tolist() == [30, 31, 12, 13, 14, 20]
    assert attn.positions.tolist() == [2, 3, 4, 5, 6, 0]
    assert attn.context_lens.tolist() == [7, 1]
    assert attn.query_start_loc.tolist() == [0, 5, 6]
    # Only the columns the longest context needs; the short table is padded with block 0.
    assert attn.block_tables.tolist() == [[7, 3], [5, 0]]
    assert attn.max_query_len == 5 and attn.is_prefill


def test_metadata_rejects_short_block_table_and_empty_queries() -> None:
    with pytest.raises(ValueError, match=r"needs 2 blocks of 4, but its block table has 1"):
        AttentionMetadata.build([[3]], [4], [1], 4, is_prefill=False)
    with pytest.raises(ValueError, match="num_new_tokens >= 1"):
        AttentionMetadata.build([[3]], [0], [0], 4, is_prefill=True)
    with pytest.raises(ValueError, match="one entry per sequence"):
        AttentionMetadata.build([[3], [4]], [0], [1, 1], 4, is_prefill=True)


def _dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int):
    """query [Q, H, Dh] at positions cached..cached+Q-1; keys/values [C, Hkv, Dh]."""
    groups = NUM_HEADS // NUM_KV_HEADS
    keys = keys.repeat_interleave(groups, dim=1)
    values = values.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, keys) / math.sqrt(HEAD_DIM)
    q_pos = torch.arange(cached, cached + query.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


@pytest.mark.parametrize(
    ("num_cached", "num_new"),
    [
        ([0, 5, 9, 3], [6, 3, 1, 1]),  # fresh prompt, chunk with prefix, two decodes
        ([4, 11, 0], [1, 1, 1]),  # decode fast path (one is a one-token prompt)
        ([8], [8]),  # a chunk exactly on a block boundary
        ([30, 2, 17, 9, 0], [1, 1, 1, 1, 1]),  # five decodes of different lengths
    ],
)
@pytest.mark.parametrize("decode_chunk", [None, 1, 2])
def test_paged_attention_matches_dense(
    num_cached: list[int],
    num_new: list[int],
    decode_chunk: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """decode_chunk forces the sequences-per-call of the decode path (None: its own choice)."""
    if decode_chunk is not None:
        monkeypatch.setattr(paged_attention_module, "_decode_chunk", lambda *_: decode_chunk)
    gen = torch.Generator().manual_seed(sum(num_cached) + len(num_new))
    cache = KVCache(1, 64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float64)
    key_cache, value_cache = cache.layer(0)
    # Scattered, non-contiguous block tables that never use the reserved block 0.
    free = (torch.randperm(63, generator=gen) + 1).tolist()
    contexts = [c + n for c, n in zip(num_cached, num_new, strict=True)]
    tables = [[free.pop() for _ in range(-(-c // BLOCK_SIZE))] for c in contexts]
    full_k = [
        torch.randn(c, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for c in contexts
    ]
    full_v = [
        torch.randn(c, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for c in contexts
    ]

    prefix = [b for b, c in enumerate(num_cached) if c > 0]
    if prefix:  # an earlier step cached the prefixes
        before = AttentionMetadata.build(
            [tables[b] for b in prefix],
            [0] * len(prefix),
            [num_cached[b] for b in prefix],
            BLOCK_SIZE,
            is_prefill=True,
        )
        write_kv(
            torch.cat([full_k[b][: num_cached[b]] for b in prefix]),
            torch.cat([full_v[b][: num_cached[b]] for b in prefix]),
            key_cache,
            value_cache,
            before.slot_mapping,
        )

    attn = AttentionMetadata.build(tables, num_cached, num_new, BLOCK_SIZE, is_prefill=True)
    new_k = torch.cat([k[c:] for k, c in zip(full_k, num_cached, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(full_v, num_cached, strict=True)])
    write_kv(new_k, new_v, key_cache, value_cache, attn.slot_mapping)
    query = torch.randn(sum(num_new), NUM_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    out = paged_attention(query, key_cache, value_cache, attn)

    starts = attn.query_start_loc.tolist()
    for b in range(len(num_new)):
        q = query[starts[b] : starts[b + 1]]
        expected = _dense_attention(q, full_k[b], full_v[b], num_cached[b])
        torch.testing.assert_close(out[starts[b] : starts[b + 1]], expected)
    assert torch.count_nonzero(key_cache[0]) == 0, "block 0 is reserved and must stay untouched"


def _config() -> ModelConfig:
    return ModelConfig.from_hf_dict(
        {
            "model_type": "mixtral",
            "vocab_size": 32,
            "hidden_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_experts_per_tok": 2,
            "num_local_experts": 4,
            "intermediate_size": 16,
        }
    )


def test_num_blocks_for_budget() -> None:
    config = _config()
    # 2 (K, V) * 3 layers * 16 tokens * 2 heads * 16 dims * 2 bytes
    assert bytes_per_block(config, 16, torch.bfloat16) == 2 * 3 * 16 * 2 * 16 * 2
    assert num_blocks_for_budget(config, 16, torch.bfloat16, 10 * 6144 + 100) == 10
    with pytest.raises(ValueError, match="holds 1 blocks"):
        num_blocks_for_budget(config, 16, torch.bfloat16, 6144)
    cache = KVCache.for_model(config, 10, 16, torch.bfloat16)
    key, value = cache.layer(2)
    assert key.shape == value.shape == (10, 16, 2, 16)
    assert cache.storage.numel() * 2 == 10 * bytes_per_block(config, 16, torch.bfloat16)
