"""Paged attention in plain PyTorch: write new K/V into the block cache, then attend.

Shape legend: T = tokens in the flat batch, B = sequences, H = query heads, Hkv = kv heads,
Dh = head dim, NB = blocks, BS = block size, MB = block-table columns, S = MB * BS,
Lq = longest query in the step.

Each sequence's K/V is gathered through its block table into a padded `[B, Hkv, S, Dh]` tensor
and one batched `scaled_dot_product_attention` call serves all sequences (GQA via
`enable_gqa`). This copies the context once per layer; a fused paged kernel (FlashInfer,
FlashAttention's paged API) can replace these two functions without touching the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dist_engine.attention_metadata import AttentionMetadata


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


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache [NB, BS, Hkv, Dh], block_tables [B, MB] → [B, Hkv, S, Dh] (a transposed view).

    index_select of whole blocks from a [NB, BS * Hkv * Dh] view: one contiguous row copy per
    block. Advanced indexing (`cache[block_tables]`) gives the same tensor but copies element by
    element, about 8x slower here; this gather is the largest non-GEMM cost of a decode step.
    """
    num_seqs, num_columns = block_tables.shape
    block_size = cache.shape[1]
    rows = cache.view(cache.shape[0], -1).index_select(0, block_tables.reshape(-1))
    gathered = rows.view(num_seqs, num_columns * block_size, *cache.shape[2:])
    return gathered.transpose(1, 2)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn: AttentionMetadata,
) -> torch.Tensor:
    """Attention of the step's queries over each sequence's cached context (new K/V included).

    query: [T, H, Dh], already rotated; caches: [NB, BS, Hkv, Dh], already holding this step's
    K/V (call `write_kv` first). Returns [T, H, Dh].
    """
    if attn.num_tokens == 0:
        return query.new_empty(query.shape)
    keys = _gather_context(key_cache, attn.block_tables)
    values = _gather_context(value_cache, attn.block_tables)
    if attn.max_query_len == 1:
        # Decode fast path: one query per sequence, rows already in sequence order.
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2), keys, values, attn_mask=attn.attn_mask, enable_gqa=True
        )
        return out.squeeze(2)
    num_heads, head_dim = query.shape[1], query.shape[2]
    padded = query.new_zeros(attn.num_seqs, attn.max_query_len, num_heads, head_dim)
    padded[attn.token_seq_idx, attn.token_query_idx] = query
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2), keys, values, attn_mask=attn.attn_mask, enable_gqa=True
    )  # [B, H, Lq, Dh]
    return out.transpose(1, 2)[attn.token_seq_idx, attn.token_query_idx]
