"""The `torch` MLA backend: Multi-head Latent Attention over the paged latent cache in plain
PyTorch, on any device and dtype.

Shape legend: T = tokens in the flat batch, B = sequences, G = sequences in one attention call,
Lg = their longest query, S = key slots gathered per sequence, H = heads,
Dn = qk_nope_head_dim, R = qk_rope_head_dim, Dv = v_head_dim, C = kv_lora_rank,
E = C + R (one cache entry).

Two forms of the same attention (equal up to rounding):

- **absorbed**: the query's nope part goes through the key half of `kv_up` into the latent
  space (`q_lat = q_nope @ W_uk`, [H, C] per token), so scores are one product of
  `[q_lat | q_rope]` with the cached entries `[latent | rope_key]`; the softmax-weighted sum of
  latents goes through the value half afterwards. Nothing per token of context is expanded;
  per query and key it costs `H * (E + C)` multiply-adds.
- **expanded**: every context latent is expanded into per-head K and V
  (`latent @ kv_up^T`, `S * C * H * (Dn + Dv)`), then ordinary attention at
  `H * (Dn + R + Dv)` per query and key.

A decode step has one query per sequence and a context of S tokens: the expansion would be
redone for all S every step, so decode takes the absorbed form. A prefill chunk has about as
many queries as keys, where the absorbed form's per-pair cost (`E + C = 1088` for
DeepSeek-V3) is 3.4x the expanded one's (`Dn + R + Dv = 320`) and the expansion is paid once
per key: prefill takes the expanded form (scripts/bench_forward.py measures both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dist_engine.attention.metadata import AttentionMetadata, decode_mask
from dist_engine.attention.mla_backend import MLABackend
from dist_engine.attention.torch_backend import DECODE_CHUNK_BYTES, num_threads

FORMS = ("absorbed", "expanded")


class TorchMLA(MLABackend):
    """`decode_form` and `prefill_form`: which form each regime takes (see the module
    docstring; the defaults are the faster ones, the others exist for comparison)."""

    name = "torch"

    def __init__(self, decode_form: str = "absorbed", prefill_form: str = "expanded") -> None:
        for key, form in (("decode_form", decode_form), ("prefill_form", prefill_form)):
            if form not in FORMS:
                raise ValueError(f"{key} must be one of {list(FORMS)}, got {form!r}")
        self.decode_form = decode_form
        self.prefill_form = prefill_form

    def store(self, latent, rope_key, cache, attn) -> None:
        write_latent(latent, rope_key, cache, attn.slot_mapping)

    def attend(self, q_nope, q_rope, cache, kv_up, attn, scale) -> torch.Tensor:
        form = self.decode_form if attn.max_query_len == 1 else self.prefill_form
        return mla_attention(q_nope, q_rope, cache, kv_up, attn, scale, form)


def write_latent(
    latent: torch.Tensor, rope_key: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """latent [T, C], rope_key [T, R] → rows `slot_mapping` of cache [NB, BS, C + R]."""
    entries = torch.cat((latent, rope_key), dim=-1)
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, entries)


def gather_entries(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache [NB, BS, E], block_tables [G, MB] → [G, MB * BS, E], one row copy per block."""
    num_seqs, num_columns = block_tables.shape
    rows = cache.view(cache.shape[0], -1).index_select(0, block_tables.reshape(-1))
    return rows.view(num_seqs, num_columns * cache.shape[1], cache.shape[2])


def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    kv_up: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    form: str,
) -> torch.Tensor:
    """q_nope [T, H, Dn], q_rope [T, H, R], cache [NB, BS, E] (holding this step's entries),
    kv_up [H, Dn + Dv, C] → [T, H, Dv], in the `form` given (absorbed | expanded)."""
    num_heads, value_dim = kv_up.shape[0], kv_up.shape[1] - q_nope.shape[2]
    if attn.num_tokens == 0:
        return q_nope.new_empty(0, num_heads, value_dim)
    attend = _absorbed if form == "absorbed" else _expanded
    if attn.max_query_len == 1:
        # One query per sequence, rows already in sequence order; in sequence chunks whose
        # gathered entries stay in the CPU's cache between the gather and the products.
        chunk = _decode_chunk(cache, attn.block_tables.shape[1])
        parts = []
        for start in range(0, attn.num_seqs, chunk):
            rows = slice(start, start + chunk)
            context = gather_entries(cache, attn.block_tables[rows])
            query = (q_nope[rows, None], q_rope[rows, None])
            mask = decode_mask(attn.context_lens[rows], context.shape[1])
            parts.append(attend(*query, context, kv_up, mask, scale))
        return (torch.cat(parts) if len(parts) > 1 else parts[0])[:, 0]
    out = q_nope.new_empty(attn.num_tokens, num_heads, value_dim)
    for group in attn.prefill_groups:
        num_seqs = len(group.seq_idx)
        shape = (num_seqs, group.query_len, num_heads)
        padded_nope = q_nope.new_zeros(*shape, q_nope.shape[2])
        padded_rope = q_rope.new_zeros(*shape, q_rope.shape[2])
        padded_nope[group.token_seq, group.token_query] = q_nope[group.token_rows]
        padded_rope[group.token_seq, group.token_query] = q_rope[group.token_rows]
        tables = attn.block_tables[group.seq_idx, : group.num_columns]
        context = gather_entries(cache, tables)
        if group.attn_mask is None:
            # Nothing cached: key j is position j, so the first Lg keys under a causal mask
            # are exact for every real query (padding rows are dropped below).
            context = context[:, : group.query_len]
        result = attend(padded_nope, padded_rope, context, kv_up, group.attn_mask, scale)
        out[group.token_rows] = result[group.token_seq, group.token_query]
    return out


def _absorbed(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    context: torch.Tensor,
    kv_up: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """q_nope [G, Lg, H, Dn], q_rope [G, Lg, H, R], context [G, S, E], mask [G, 1, Lg, S] bool
    (None: causal, S = Lg) → [G, Lg, H, Dv].

    The heads become query rows of one single-head attention over the entries: scores are
    `[G, Lg*H, E] @ [G, E, S]`, values the latent part of the same entries. Two bmm calls with
    the scale applied to the (small) query rather than SDPA, which scales inside and was the
    slower of the two on a CPU decode step (docs/benchmark_notes.md, "Model forward").
    """
    num_seqs, query_len, num_heads, nope_dim = q_nope.shape
    latent_dim = kv_up.shape[2]
    key_half, value_half = kv_up[:, :nope_dim], kv_up[:, nope_dim:]  # [H, Dn, C], [H, Dv, C]
    rows = q_nope.reshape(-1, num_heads, nope_dim).transpose(0, 1)  # [H, G*Lg, Dn]
    q_latent = torch.bmm(rows, key_half).transpose(0, 1)  # [G*Lg, H, C]
    query = torch.cat((q_latent.reshape(num_seqs, query_len, num_heads, latent_dim), q_rope), -1)
    query = query.reshape(num_seqs, query_len * num_heads, -1) * scale  # [G, Lg*H, E]
    scores = torch.bmm(query, context.transpose(1, 2))  # [G, Lg*H, S]
    if mask is None:
        mask = _causal_mask(query_len, q_nope.device)
    allowed = mask[:, 0].repeat_interleave(num_heads, dim=1) if query_len > 1 else mask[:, 0]
    scores = scores.masked_fill_(~allowed, float("-inf"))
    # At least float32, as transformers' eager attention does for lower-precision models.
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(context.dtype)
    weighted = torch.bmm(probs, context[..., :latent_dim])  # [G, Lg*H, C]
    weighted = weighted.reshape(-1, num_heads, latent_dim).transpose(0, 1)  # [H, G*Lg, C]
    out = torch.bmm(weighted, value_half.transpose(1, 2))  # [H, G*Lg, Dv]
    return out.transpose(0, 1).reshape(num_seqs, query_len, num_heads, -1)


def _expanded(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    context: torch.Tensor,
    kv_up: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The same contract as `_absorbed`, by expanding every context latent into per-head keys
    and values first."""
    num_seqs, num_keys = context.shape[:2]
    num_heads, nope_dim, latent_dim = q_nope.shape[2], q_nope.shape[3], kv_up.shape[2]
    expanded = context[..., :latent_dim] @ kv_up.reshape(-1, latent_dim).t()
    expanded = expanded.view(num_seqs, num_keys, num_heads, -1)  # [G, S, H, Dn + Dv]
    rope_key = context[:, :, None, latent_dim:].expand(-1, -1, num_heads, -1)
    keys = torch.cat((expanded[..., :nope_dim], rope_key), dim=-1).transpose(1, 2)
    values = expanded[..., nope_dim:].transpose(1, 2)  # [G, H, S, Dv]
    query = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)  # [G, H, Lg, Dn + R]
    # Causal without a mask lets SDPA skip the keys above the diagonal.
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale
    )
    return out.transpose(1, 2)  # [G, Lg, H, Dv]


def _causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """[1, 1, L, L] bool, True on and below the diagonal."""
    index = torch.arange(length, device=device)
    return (index[None, :] <= index[:, None])[None, None]


def _decode_chunk(cache: torch.Tensor, num_columns: int) -> int:
    """Sequences per decode call: as many as keep their gathered entries within
    DECODE_CHUNK_BYTES per thread on the CPU (as the GQA path does), all on an accelerator."""
    if cache.device.type != "cpu":
        return 1 << 62
    per_seq = num_columns * cache[0].numel() * cache.element_size()
    return max(1, DECODE_CHUNK_BYTES * num_threads() // max(per_seq, 1))
