"""A decode step's inputs in persistent buffers, of fixed shapes a compiled or captured step
can be replayed on.

Shape legend: B = sequences in the step, Bp = B padded up to a batch size, MB = block-table
columns (`bucketed_columns`), BS = block size.

Every decode step writes the same few fields: each row's token id, position (= tokens already
cached), cache slot and context length, and its block table. They are packed on the host into
one int64 staging buffer (pinned on a GPU) and reach the device in one non-blocking copy into
a device buffer that lives as long as the runner; the step's tensors are views of it. For a
given (Bp, MB) the views are always at the same addresses, which is what a CUDA graph captured
at that size reads. The fields that do not change between steps of a size (query starts,
each token's sequence and query index) are views of constant device tensors.

Pad rows (B <= row < Bp) are token 0 at position 0 of a context of one token in the reserved
block 0: they write their K/V into block 0, which no sequence is ever given, attend only that
key (so no softmax row is empty), and their outputs are dropped.

Invariant: the staging buffer is rewritten only once the previous step's copy has finished
(an event recorded after the copy is waited on first), and the device buffer only by a copy
queued after the previous step's forward on the same stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dist_engine.attention.metadata import (
    AttentionMetadata,
    _check_sequences,
    bucketed_columns,
    int64_tensor,
)


class DecodeInputs:
    """Persistent input buffers for decode steps of up to `max_num_seqs` sequences (padded to
    the next of `batch_sizes`, when given) and contexts of up to `max_columns` blocks."""

    def __init__(
        self,
        max_num_seqs: int,
        max_columns: int,
        block_size: int,
        device: torch.device | str = "cpu",
        batch_sizes: Sequence[int] | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_columns < 1 or block_size < 1:
            raise ValueError(
                f"need max_num_seqs, max_columns and block_size >= 1, got {max_num_seqs}, "
                f"{max_columns}, {block_size}"
            )
        sizes = sorted(set(batch_sizes or ()))
        if sizes and (sizes[0] < 1 or sizes[-1] < max_num_seqs):
            raise ValueError(
                f"decode batch sizes must be >= 1 and reach max_num_seqs={max_num_seqs}, got "
                f"{list(batch_sizes or ())}"
            )
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_columns = max_columns
        self.batch_sizes = tuple(sizes)
        self.max_rows = sizes[-1] if sizes else max_num_seqs
        capacity = self.max_rows * (4 + max_columns)
        on_host = self.device.type == "cpu"
        pinned = self.device.type == "cuda"
        self.staging = torch.zeros(capacity, dtype=torch.int64, pin_memory=pinned)
        self.buffer = (
            self.staging if on_host else torch.zeros(capacity, dtype=torch.int64, device=device)
        )
        self.counting = torch.arange(self.max_rows + 1, dtype=torch.int64, device=device)
        self.zeros = torch.zeros(self.max_rows, dtype=torch.int64, device=device)
        self.copied: torch.cuda.Event | None = None

    def padded_size(self, num_seqs: int) -> int:
        """Bp: the smallest batch size that holds `num_seqs` rows (itself without sizes)."""
        return next((size for size in self.batch_sizes if size >= num_seqs), num_seqs)

    def fill(
        self,
        token_ids: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        num_cached_tokens: Sequence[int],
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """One decode step: sequence b's new token `token_ids[b]` at position
        `num_cached_tokens[b]`, its blocks `block_tables[b]`. Returns (input ids [Bp], the
        step's metadata over Bp rows), views of the device buffer valid until the next fill."""
        num_seqs = len(token_ids)
        if not 1 <= num_seqs <= self.max_rows:
            raise ValueError(
                f"a decode step of {num_seqs} sequences; these buffers hold 1 to {self.max_rows}"
            )
        if not len(block_tables) == len(num_cached_tokens) == num_seqs:
            raise ValueError(
                f"token_ids, block_tables and num_cached_tokens must have one entry per "
                f"sequence; got {num_seqs}, {len(block_tables)}, {len(num_cached_tokens)}"
            )
        _check_sequences(block_tables, num_cached_tokens, [1] * num_seqs, self.block_size)
        size = self.block_size
        needed = max(cached // size + 1 for cached in num_cached_tokens)
        width = bucketed_columns(needed, self.max_columns)
        rows = self.padded_size(num_seqs)
        pad = rows - num_seqs
        slots = [
            table[cached // size] * size + cached % size
            for table, cached in zip(block_tables, num_cached_tokens, strict=True)
        ]
        values = [*token_ids, *[0] * pad, *num_cached_tokens, *[0] * pad, *slots, *[0] * pad]
        values += [cached + 1 for cached in num_cached_tokens] + [1] * pad
        for table in block_tables:
            values += table[:width]
            values += [0] * (width - min(len(table), width))
        values += [0] * (pad * width)
        self._copy(int64_tensor(values))
        fields = self.buffer[: 4 * rows].view(4, rows)
        ids, positions, slot_mapping, context_lens = fields.unbind(0)
        tables = self.buffer[4 * rows : rows * (4 + width)].view(rows, width)
        attn = AttentionMetadata(
            positions=positions,
            slot_mapping=slot_mapping,
            block_tables=tables,
            num_cached_tokens=positions,
            context_lens=context_lens,
            query_start_loc=self.counting[: rows + 1],
            token_seq_idx=self.counting[:rows],
            token_query_idx=self.zeros[:rows],
            attn_mask=None,
            is_prefill=False,
            max_query_len=1,
            block_size=size,
        )
        return ids, attn

    def _copy(self, values: torch.Tensor) -> None:
        """values → the front of the device buffer: one non-blocking host-to-device copy from
        the pinned staging buffer on a GPU, a plain copy on the CPU."""
        count = values.shape[0]
        if self.buffer is self.staging:
            self.staging[:count].copy_(values)
            return
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the staging buffer
        self.staging[:count].copy_(values)
        self.buffer[:count].copy_(self.staging[:count], non_blocking=True)
        if self.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()
