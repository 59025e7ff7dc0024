"""Per-step attention metadata: where each new token's K/V goes and what each query may see.

Shape legend: T = tokens in the flat batch (sequences concatenated, no padding), B = sequences,
MB = block-table columns (enough for the longest context; a decode step's runner rounds it up
to a bucket, so the width does not change every time a context crosses a block), BS = block
size, Lq = longest query in the step, S = MB * BS key slots gathered per sequence.

Built once per step on the host from the scheduler's per-sequence view, then shared by every
layer — which is why a prefill step's masks are precomputed here rather than in each attention
call. A step of one query per sequence carries no dense mask: a kernel that walks block tables
reads `context_lens`, and the PyTorch path derives its mask from them on the device
(`decode_mask`), so nothing of size S is built on the host or copied per step.
"""

from __future__ import annotations

import functools
import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class PrefillGroup:
    """Sequences of a prefill step that one batched attention call serves (G of them).

    seq_idx:     [G] int64 — the sequences, as rows of the step's block tables, in batch order
                 (so a group of every sequence has its tokens in flat-batch order).
    token_rows:  [Tg] int64 — their tokens' rows in the flat batch.
    token_seq:   [Tg] int64 — each token's sequence within the group.
    token_query: [Tg] int64 — each token's index within its sequence's query.
    query_len:   Lg, the longest query in the group (queries are padded to it).
    num_columns: block-table columns gathered for the group (its longest context).
    attn_mask:   [G, 1, Lg, num_columns * BS] bool for sequences with a cached prefix; None for
                 a group of sequences with nothing cached, which are causal from their first
                 token: the call then needs no mask and skips the keys above the diagonal.
    """

    seq_idx: torch.Tensor
    token_rows: torch.Tensor
    token_seq: torch.Tensor
    token_query: torch.Tensor
    query_len: int
    num_columns: int
    attn_mask: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """Frozen description of one step's batch for paged attention.

    positions:         [T] int64 — position of each token in its sequence.
    slot_mapping:      [T] int64 — flat cache slot (`block * BS + offset`) each new K/V goes to.
    block_tables:      [B, MB] int64 — padded with block 0 (reserved, always masked out).
    num_cached_tokens: [B] int64 — context already in the cache before this step.
    context_lens:      [B] int64 — context after this step (cached + new).
    query_start_loc:   [B + 1] int64 — sequence b's tokens are rows
                       `query_start_loc[b]:query_start_loc[b + 1]` of the flat batch.
    token_seq_idx:     [T] int64 — the sequence each token belongs to.
    token_query_idx:   [T] int64 — the token's index within its sequence's query.
    attn_mask:         [B, 1, Lq, S] bool — True where query i of sequence b may attend key j
                       (causal over cached prefix + itself); None when Lq <= 1 (see
                       `decode_mask`).
    is_prefill:        the regime these rows are attended in (prompt chunks, or one decode token
                       each); the MoE dispatch mode follows the step kind, set by the runner.
    max_query_len:     Lq; 1 selects the decode fast path.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    num_cached_tokens: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    token_seq_idx: torch.Tensor
    token_query_idx: torch.Tensor
    attn_mask: torch.Tensor | None
    is_prefill: bool
    max_query_len: int
    block_size: int

    @functools.cached_property
    def prefill_groups(self) -> tuple[PrefillGroup, ...]:
        """When Lq > 1, the sequences split into groups that each take one batched attention
        call (see `PrefillGroup`); empty for decode steps. Derived on first use, because only
        the PyTorch prefill path needs it (the CPU prefill kernel does not)."""
        if self.max_query_len <= 1:
            return ()
        assert self.attn_mask is not None  # built whenever Lq > 1
        starts = self.query_start_loc.tolist()
        num_new = [end - start for start, end in itertools.pairwise(starts)]
        return _prefill_groups(
            self.num_cached_tokens.tolist(),
            num_new,
            starts,
            self.block_size,
            self.attn_mask.squeeze(1),
            self.attn_mask.device,
        )

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def parts(self) -> tuple[tuple[AttentionMetadata, slice], ...]:
        """The batch as one part: every row, attended in this step's regime."""
        return ((self, slice(0, None)),)

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        num_cached_tokens: Sequence[int],
        num_new_tokens: Sequence[int],
        block_size: int,
        is_prefill: bool,
        device: torch.device | str | None = None,
        num_columns: int | None = None,
    ) -> AttentionMetadata:
        """From per-sequence (block table, tokens already cached, tokens new in this step).

        The flat batch must list the sequences' new tokens in the same order. An empty batch
        (B = 0) is valid: it is the placeholder forward of a rank with nothing to run.
        num_columns: MB, the block tables' width (None: the longest context's blocks); columns
        past a sequence's context hold block 0.
        """
        num_seqs = len(block_tables)
        if not len(num_cached_tokens) == len(num_new_tokens) == num_seqs:
            raise ValueError(
                f"block_tables, num_cached_tokens and num_new_tokens must have one entry per "
                f"sequence; got {num_seqs}, {len(num_cached_tokens)}, {len(num_new_tokens)}"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        _check_sequences(block_tables, num_cached_tokens, num_new_tokens, block_size)
        context_lens = [c + n for c, n in zip(num_cached_tokens, num_new_tokens, strict=True)]
        needed = max((-(-length // block_size) for length in context_lens), default=0)
        if num_columns is None:
            num_columns = needed
        elif num_columns < needed:
            raise ValueError(
                f"num_columns={num_columns} block-table columns cannot hold the longest "
                f"context, {max(context_lens)} tokens in blocks of {block_size} ({needed} columns)"
            )
        padded_tables: list[int] = []  # [num_seqs * num_columns], row by row
        for table in block_tables:
            padded_tables += table[:num_columns]
            padded_tables += [0] * (num_columns - len(table))

        positions: list[int] = []
        slots: list[int] = []
        seq_idx: list[int] = []
        query_idx: list[int] = []
        for b, (table, cached, new) in enumerate(
            zip(block_tables, num_cached_tokens, num_new_tokens, strict=True)
        ):
            for i in range(new):
                position = cached + i
                positions.append(position)
                slots.append(table[position // block_size] * block_size + position % block_size)
                seq_idx.append(b)
                query_idx.append(i)
        max_query_len = max(num_new_tokens, default=0)

        def as_tensor(values: Sequence[int]) -> torch.Tensor:
            return int64_tensor(values, device)

        cached_t = as_tensor(list(num_cached_tokens))
        starts = [0]
        for new in num_new_tokens:
            starts.append(starts[-1] + new)
        attn_mask = None
        if max_query_len > 1:
            key_idx = torch.arange(num_columns * block_size, device=device)
            query_pos = torch.arange(max_query_len, device=device)
            # Key j is visible to query i of sequence b iff j <= num_cached[b] + i. Padding
            # query rows (i >= query length) always see key 0, so no softmax row is fully
            # masked (NaN).
            visible_until = cached_t[:, None] + query_pos[None, :]  # [B, Lq]
            attn_mask = (key_idx[None, None, :] <= visible_until[:, :, None]).unsqueeze(1)
        return cls(
            positions=as_tensor(positions),
            slot_mapping=as_tensor(slots),
            block_tables=as_tensor(padded_tables).view(num_seqs, num_columns),
            num_cached_tokens=cached_t,
            context_lens=as_tensor(context_lens),
            query_start_loc=as_tensor(starts),
            token_seq_idx=as_tensor(seq_idx),
            token_query_idx=as_tensor(query_idx),
            attn_mask=attn_mask,
            is_prefill=is_prefill,
            max_query_len=max_query_len,
            block_size=block_size,
        )


def int64_tensor(values: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """`torch.tensor(values, dtype=torch.int64, device=device)` for a flat sequence of ints,
    built through an `array`: torch.tensor on a list makes a Python object of every value,
    ~4x the time (100 against 26 us for a decode step's 2,560 values of metadata). On the CPU
    the tensor shares the array's memory (and keeps the array alive)."""
    if len(values) == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    tensor = torch.frombuffer(array("q", values), dtype=torch.int64)
    return tensor if device is None or torch.device(device).type == "cpu" else tensor.to(device)


def bucketed_columns(num_columns: int, max_columns: int | None = None) -> int:
    """The block-table width for a decode step whose longest context needs `num_columns`
    blocks: the next power of two, at most `max_columns` (a context of max_model_len) but
    never fewer than needed. A step's tensors then keep their shapes until the longest context
    doubles, so a compiled or captured decode step is not rebuilt at every block boundary;
    the columns past a context hold block 0 and are never attended."""
    if num_columns <= 1:
        return num_columns
    bucket = 1 << (num_columns - 1).bit_length()
    return max(num_columns, min(bucket, max_columns or bucket))


def decode_mask(context_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """context_lens: [B] → [B, 1, 1, num_keys] bool, True for the keys a sequence's one query
    may attend (key j iff j < its context length, this step's key included). Device ops on a
    tensor the step already holds: no host work, no sync, a shape fixed by the block tables."""
    keys = torch.arange(num_keys, device=context_lens.device)
    return (keys[None, :] < context_lens[:, None])[:, None, None, :]


def _check_sequences(
    block_tables: Sequence[Sequence[int]],
    num_cached_tokens: Sequence[int],
    num_new_tokens: Sequence[int],
    block_size: int,
) -> None:
    for b, (table, cached, new) in enumerate(
        zip(block_tables, num_cached_tokens, num_new_tokens, strict=True)
    ):
        if cached < 0 or new < 1:
            raise ValueError(
                f"sequence {b}: need num_cached_tokens >= 0 and num_new_tokens >= 1, got "
                f"{cached} and {new}"
            )
        needed = -(-(cached + new) // block_size)
        if len(table) < needed:
            raise ValueError(
                f"sequence {b}: context of {cached + new} tokens needs {needed} blocks of "
                f"{block_size}, but its block table has {len(table)}: {list(table)}"
            )


@dataclass(frozen=True, eq=False)
class MixedMetadata:
    """A mixed step: prompt chunks in rows ``[0, P)`` of the flat batch, then one decode token
    per running sequence in rows ``[P, T)``. Each part is its own ``AttentionMetadata`` and is
    attended by its own regime's backend (``parts()``), so the decode tokens keep the decode
    kernels while the step's other layers run over every row at once. The step-level fields
    are the parts' joined in row order.
    """

    prompt: AttentionMetadata
    decode: AttentionMetadata
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    is_prefill: bool = True

    @classmethod
    def join(cls, prompt: AttentionMetadata, decode: AttentionMetadata) -> MixedMetadata:
        if not prompt.is_prefill or decode.is_prefill or decode.max_query_len > 1:
            raise ValueError("a mixed step joins a prompt part and a one-token decode part")
        starts = (prompt.query_start_loc, decode.query_start_loc[1:] + prompt.num_tokens)
        return cls(
            prompt=prompt,
            decode=decode,
            positions=torch.cat((prompt.positions, decode.positions)),
            slot_mapping=torch.cat((prompt.slot_mapping, decode.slot_mapping)),
            query_start_loc=torch.cat(starts),
        )

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.prompt.num_seqs + self.decode.num_seqs

    def parts(self) -> tuple[tuple[AttentionMetadata, slice], ...]:
        split = self.prompt.num_tokens
        return ((self.prompt, slice(0, split)), (self.decode, slice(split, None)))


StepMetadata = AttentionMetadata | MixedMetadata


PREFILL_BUCKET_RATIO = 0.5
"""A sequence with nothing cached starts a new prefill group when its query is shorter than
this fraction of the group's longest: each group pads its queries (and keys) to its longest,
so mixed prompt lengths would otherwise spend most of the attention on padding."""


def _prefill_groups(
    num_cached_tokens: Sequence[int],
    num_new_tokens: Sequence[int],
    starts: Sequence[int],
    block_size: int,
    attn_mask: torch.Tensor,
    device: torch.device | str | None,
) -> tuple[PrefillGroup, ...]:
    """Split a prefill step's sequences: those with a cached prefix (chunked prompts, prefix
    cache hits) form one masked group; the rest, longest first, are cut into causal groups of
    similar query length (PREFILL_BUCKET_RATIO)."""
    fresh = sorted(
        (b for b, cached in enumerate(num_cached_tokens) if cached == 0),
        key=lambda b: -num_new_tokens[b],
    )
    buckets: list[list[int]] = []
    for b in fresh:
        if not buckets or num_new_tokens[b] < PREFILL_BUCKET_RATIO * num_new_tokens[buckets[-1][0]]:
            buckets.append([])
        buckets[-1].append(b)
    prefixed = [b for b, cached in enumerate(num_cached_tokens) if cached > 0]
    groups = [
        _group(sorted(bucket), num_cached_tokens, num_new_tokens, starts, block_size, None, device)
        for bucket in buckets
    ]
    if prefixed:
        groups.append(
            _group(
                prefixed, num_cached_tokens, num_new_tokens, starts, block_size, attn_mask, device
            )
        )
    return tuple(groups)


def _group(
    seqs: list[int],
    num_cached_tokens: Sequence[int],
    num_new_tokens: Sequence[int],
    starts: Sequence[int],
    block_size: int,
    attn_mask: torch.Tensor | None,
    device: torch.device | str | None,
) -> PrefillGroup:
    rows: list[int] = []
    token_seq: list[int] = []
    token_query: list[int] = []
    for g, b in enumerate(seqs):
        count = num_new_tokens[b]
        rows.extend(range(starts[b], starts[b] + count))
        token_seq.extend([g] * count)
        token_query.extend(range(count))
    query_len = max(num_new_tokens[b] for b in seqs)
    context = max(num_cached_tokens[b] + num_new_tokens[b] for b in seqs)
    num_columns = -(-context // block_size)
    seq_idx = int64_tensor(seqs, device)
    mask = None
    if attn_mask is not None:
        mask = attn_mask[seq_idx, :query_len, : num_columns * block_size].unsqueeze(1)
    return PrefillGroup(
        seq_idx=seq_idx,
        token_rows=int64_tensor(rows, device),
        token_seq=int64_tensor(token_seq, device),
        token_query=int64_tensor(token_query, device),
        query_len=query_len,
        num_columns=num_columns,
        attn_mask=mask,
    )
