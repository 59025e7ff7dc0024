"""The `torch` attention backend: paged attention in plain PyTorch, on any device and dtype.

Shape legend: T = tokens in the flat batch, B = sequences, H = query heads, Hkv = kv heads,
Dh = head dim, NB = blocks, BS = block size, MB = block-table columns, S = MB * BS,
Lq = longest query in the step.

Each sequence's K/V is gathered through its block table into a padded `[B, Hkv, S, Dh]` tensor
and one batched `scaled_dot_product_attention` call serves all sequences (GQA via
`enable_gqa`). This copies the context once per layer; on the CPU, decode steps go in sequence
chunks sized to the CPU cache. The `native` backend (attention/native_backend.py) reads each
cached row once instead, straight through the block tables; on a GPU a fused paged kernel
(FlashInfer, FlashAttention's paged API) would be another backend beside these two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dist_engine.attention.backend import AttentionBackend
from dist_engine.attention.kv_cache import write_kv
from dist_engine.attention.metadata import AttentionMetadata, PrefillGroup, decode_mask
from dist_engine.layers.rotary import apply_rotary


class TorchAttention(AttentionBackend):
    name = "torch"

    def rotate_and_store(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        write_kv(key, value, key_cache, value_cache, attn.slot_mapping)
        return query

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        return paged_attention(query, key_cache, value_cache, attn)


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache [NB, BS, Hkv, Dh], block_tables [B, MB] → [B, Hkv, S, Dh] (a transposed view).

    index_select of whole blocks from a [NB, BS * Hkv * Dh] view: one contiguous row copy per
    block. Advanced indexing (`cache[block_tables]`) gives the same tensor but copies element by
    element, several times slower on the CPU (docs/benchmark_notes.md, "Model forward"); this
    gather is the largest non-GEMM cost of a decode step.
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
    if attn.max_query_len == 1:
        # Decode fast path: one query per sequence, rows already in sequence order.
        chunk = _decode_chunk(key_cache, attn.block_tables.shape[1])
        if chunk >= attn.num_seqs:
            return _decode(query, key_cache, value_cache, attn.block_tables, attn.context_lens)
        parts = []
        for start in range(0, attn.num_seqs, chunk):
            rows = slice(start, start + chunk)
            tables, lens = attn.block_tables[rows], attn.context_lens[rows]
            parts.append(_decode(query[rows], key_cache, value_cache, tables, lens))
        return torch.cat(parts)
    if len(attn.prefill_groups) == 1:  # every sequence, tokens in batch order
        return _prefill_group(query, key_cache, value_cache, attn, attn.prefill_groups[0])
    out = query.new_empty(query.shape)
    for group in attn.prefill_groups:
        out[group.token_rows] = _prefill_group(
            query[group.token_rows], key_cache, value_cache, attn, group
        )
    return out


def _prefill_group(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn: AttentionMetadata,
    group: PrefillGroup,
) -> torch.Tensor:
    """One batched attention call for a group's queries ([Tg, H, Dh], in the group's token
    order) → [Tg, H, Dh]."""
    tables = attn.block_tables[group.seq_idx, : group.num_columns]
    keys = _gather_context(key_cache, tables)
    values = _gather_context(value_cache, tables)
    num_heads, head_dim = query.shape[1], query.shape[2]
    padded = query.new_zeros(len(group.seq_idx), group.query_len, num_heads, head_dim)
    padded[group.token_seq, group.token_query] = query
    if group.attn_mask is None:
        # Nothing cached: key j sits at position j, so causal attention over the first
        # query_len keys is exact for every real query. Padding query rows also attend
        # whatever the cache holds past their sequence's end; they are dropped below.
        length = group.query_len
        out = F.scaled_dot_product_attention(
            padded.transpose(1, 2),
            keys[:, :, :length],
            values[:, :, :length],
            is_causal=True,
            enable_gqa=True,
        )
    else:
        out = F.scaled_dot_product_attention(
            padded.transpose(1, 2), keys, values, attn_mask=group.attn_mask, enable_gqa=True
        )  # [G, H, Lg, Dh]
    return out.transpose(1, 2)[group.token_seq, group.token_query]


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """query [B, H, Dh] (one token per sequence), block_tables [B, MB], context_lens [B]
    → [B, H, Dh]."""
    keys = _gather_context(key_cache, block_tables)
    values = _gather_context(value_cache, block_tables)
    mask = decode_mask(context_lens, keys.shape[2])
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True
    )
    return out.squeeze(2)


def _decode_chunk(cache: torch.Tensor, num_columns: int) -> int:
    """How many sequences one decode gather + attention call takes.

    A decode step reads the whole context twice: once to gather it, once in the attention call.
    In sequence chunks whose gathered K and V fit DECODE_CHUNK_BYTES per thread, the second read
    mostly hits the CPU cache instead of memory: a decode step with one thread got faster, one
    with two did not change (docs/benchmark_notes.md, "Model forward", commit b760f21). On an
    accelerator the whole batch goes in one call.
    """
    if cache.device.type != "cpu":
        return 1 << 62
    per_seq = 2 * num_columns * cache[0].numel() * cache.element_size()
    return max(1, DECODE_CHUNK_BYTES * num_threads() // max(per_seq, 1))


@torch.compiler.assume_constant_result
def num_threads() -> int:
    """torch's thread count, which a compiled decode step takes as a constant of its graph:
    it only sizes chunks (never changes a result), and the runtime sets it once at start-up."""
    return torch.get_num_threads()


DECODE_CHUNK_BYTES = 4 << 20
