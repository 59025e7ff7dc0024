"""The model runner: one scheduler step in, one sampled token per scheduled sequence out.

Shape legend: T = tokens in the step's flat batch, B = scheduled sequences, V = vocab.

It turns ``SchedulerOutputs`` into tensors (token ids, positions, slot mapping, block tables,
which rows need logits), runs prefill steps with the MoE layers in normal dispatch mode and
decode steps in low-latency mode, and samples. A rank with nothing scheduled still runs a
zero-token forward, because in expert parallelism every MoE layer is a collective that every rank
must join; only a step the whole group knows to be empty (``known_empty``) skips the forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from dist_engine.attention.metadata import AttentionMetadata, MixedMetadata, StepMetadata
from dist_engine.engine.sampler import Sampler, SamplingState
from dist_engine.models.decoder import MoECausalLM
from moe import DispatchMode
from scheduler import SchedulerOutputs, Sequence, StepKind

if TYPE_CHECKING:
    from dist_engine.engine.request import Request

# Placeholder for a prompt chunk that does not end its prompt: no token is sampled for it and
# the scheduler ignores whatever stands in its place.
NO_TOKEN = -1

_DISPATCH_MODES = {StepKind.PREFILL: DispatchMode.NORMAL, StepKind.DECODE: DispatchMode.LOW_LATENCY}


def dispatch_mode(kind: StepKind) -> DispatchMode | None:
    """How a step's MoE layers exchange tokens: normal (counts, then uneven rows) in prefill
    and mixed steps, low-latency (fixed capacity) in decode steps; None for a known-empty step,
    which runs no forward. The one place that ties step kinds to dispatch modes."""
    return _DISPATCH_MODES.get(kind)


class ModelRunner:
    def __init__(
        self,
        model: MoECausalLM,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if model.kv_cache is None:
            raise ValueError("attach a KVCache to the model before building its runner")
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler()

    @torch.no_grad()
    def execute(
        self, outputs: SchedulerOutputs, requests: Mapping[str, Request]
    ) -> tuple[list[int], list[tuple[Sequence, str]]]:
        """Run one step; returns one token id per scheduled sequence, in order, and the
        sequences whose sampling failed, each with the reason (their token is NO_TOKEN).
        ``requests``: the records of (at least) the scheduled sequences, by request id; the
        sampler draws from their sampling states.

        A failure that belongs to one request (its sampling settings, its row of the sample)
        is contained here, after the forward, so every rank has taken the same collectives and
        the caller can end that request alone while the group keeps stepping.
        """
        if outputs.known_empty:
            return [], []
        seqs = outputs.scheduled_seqs
        mode = dispatch_mode(outputs.kind)
        # The scheduler advanced each ledger optimistically: the step's tokens start where the
        # KV stood before (previous_num_tokens).
        cached = [seq.previous_num_tokens for seq in seqs]
        new = outputs.seqlens_q
        input_ids: list[int] = []
        for seq, start, count in zip(seqs, cached, new, strict=True):
            input_ids.extend(seq.token_ids[start : start + count])
        attn = self._metadata(seqs, cached, new, outputs)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, attn.positions, attn, mode)
        # Only a sequence whose step reaches the end of its tokens needs logits.
        rows = [
            b
            for b, (seq, start, count) in enumerate(zip(seqs, cached, new, strict=True))
            if start + count == len(seq.token_ids)
        ]
        tokens = [NO_TOKEN] * len(seqs)
        failures: list[tuple[Sequence, str]] = []
        if rows:
            last_token_rows = attn.query_start_loc[1:][rows] - 1
            logits = self.model.compute_logits(hidden[last_token_rows])
            states = [requests[seqs[b].request_id].sampling for b in rows]
            for b, token in self._sample(logits, states, [seqs[b] for b in rows], failures):
                tokens[rows[b]] = token
        return tokens, failures

    def _metadata(
        self, seqs: list[Sequence], cached: list[int], new: list[int], outputs: SchedulerOutputs
    ) -> StepMetadata:
        """The step's attention metadata. Decode tokens are attended in the decode regime in
        every step: a mixed step's get a part of their own, or the whole batch where this rank
        has no prompt chunk in it."""
        tables = [seq.block_table for seq in seqs]
        split = len(seqs) - outputs.num_decode_seqs
        if outputs.num_decode_seqs == 0 or split == 0:
            is_prefill = outputs.is_prefill and outputs.num_decode_seqs == 0
            return AttentionMetadata.build(
                tables, cached, new, self.block_size, is_prefill, self.device
            )
        return MixedMetadata.join(
            AttentionMetadata.build(
                tables[:split], cached[:split], new[:split], self.block_size, True, self.device
            ),
            AttentionMetadata.build(
                tables[split:], cached[split:], new[split:], self.block_size, False, self.device
            ),
        )

    def _sample(
        self,
        logits: torch.Tensor,
        states: list[SamplingState],
        seqs: list[Sequence],
        failures: list[tuple[Sequence, str]],
    ) -> list[tuple[int, int]]:
        """logits: [R, V] for `seqs` (sampled by `states`) → (row, token) for every row that
        sampled; rows that could not are added to `failures`. One batched call normally; row by
        row only when the batch fails, to find the row that fails it."""
        try:
            tokens = self.sampler(logits, states).tolist()
            return list(enumerate(tokens))
        except Exception:
            sampled = []
            for row, state in enumerate(states):
                try:
                    token = self.sampler(logits[row : row + 1], [state]).tolist()[0]
                except Exception as error:
                    failures.append((seqs[row], f"sampling failed: {error}"))
                    continue
                sampled.append((row, token))
            return sampled
