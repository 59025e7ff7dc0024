"""The model runner: one scheduler step in, one sampled token per scheduled sequence out.

Shape legend: T = tokens in the step's flat batch, B = scheduled sequences, V = vocab.

It turns ``SchedulerOutputs`` into tensors (token ids, positions, slot mapping, block tables,
which rows need logits), runs prefill steps with the MoE layers in normal dispatch mode and
decode steps in low-latency mode, and samples. A rank with nothing scheduled still runs a
zero-token forward, because in expert parallelism every MoE layer is a collective that every rank
must join; only a step the whole group knows to be empty (``known_empty``) skips the forward.
"""

from __future__ import annotations

import secrets

import torch

from dist_engine.attention.metadata import AttentionMetadata, MixedMetadata, StepMetadata
from dist_engine.engine.sampler import Sampler, SamplingRow, check_row
from dist_engine.models.decoder import MoECausalLM
from moe import DispatchMode
from scheduler import SchedulerOutputs, Sequence

# Placeholder for a prompt chunk that does not end its prompt: no token is sampled for it and
# the scheduler ignores whatever stands in its place.
NO_TOKEN = -1


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
        # Each request's resolved seed: its own, or one drawn the first time it is sampled.
        self._seeds: dict[str, int] = {}

    @torch.no_grad()
    def execute(self, outputs: SchedulerOutputs) -> tuple[list[int], list[tuple[Sequence, str]]]:
        """Run one step; returns one token id per scheduled sequence, in order, and the
        sequences whose sampling failed, each with the reason (their token is NO_TOKEN).

        A failure that belongs to one request (its sampling settings, its row of the sample)
        is contained here, after the forward, so every rank has taken the same collectives and
        the caller can end that request alone while the group keeps stepping.
        """
        if outputs.known_empty:
            return [], []
        seqs = outputs.scheduled_seqs
        mode = DispatchMode.NORMAL if outputs.prompt_run else DispatchMode.LOW_LATENCY
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
            for b, token in self._sample(logits, [seqs[b] for b in rows], failures):
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
            is_prefill = outputs.prompt_run and outputs.num_decode_seqs == 0
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
        self, logits: torch.Tensor, seqs: list[Sequence], failures: list[tuple[Sequence, str]]
    ) -> list[tuple[int, int]]:
        """logits: [R, V] for `seqs` → (row, token) for every row that sampled; rows that
        could not are added to `failures`. One batched call normally; row by row only when the
        batch fails, to find the row that fails it."""
        rows: dict[int, SamplingRow] = {}
        for row, seq in enumerate(seqs):
            try:
                sampling_row = self._row(seq)
                check_row(sampling_row, logits.shape[1])
            except Exception as error:
                failures.append((seq, f"sampling settings rejected: {error}"))
                continue
            rows[row] = sampling_row
        usable = list(rows)
        if not usable:
            return []
        try:
            picked = logits if len(usable) == len(seqs) else logits[usable]
            tokens = self.sampler(picked, [rows[row] for row in usable]).token_ids.tolist()
            return list(zip(usable, tokens, strict=True))
        except Exception:
            sampled = []
            for row in usable:
                try:
                    output = self.sampler(logits[row : row + 1], [rows[row]])
                    token = output.token_ids.tolist()[0]
                except Exception as error:
                    failures.append((seqs[row], f"sampling failed: {error}"))
                    continue
                sampled.append((row, token))
            return sampled

    def _row(self, seq: Sequence) -> SamplingRow:
        """The sampler's row for `seq`: its next output token is number num_output_tokens."""
        params = seq.sampling_params
        seed = self._seeds.get(seq.request_id)
        if seed is None:
            seed = params.seed if params.seed is not None else secrets.randbits(64)
            self._seeds[seq.request_id] = seed
        index = seq.num_output_tokens
        penalised = params.uses_penalties
        return SamplingRow(
            params,
            seed,
            index,
            prompt_token_ids=seq.prompt_token_ids if params.repetition_penalty != 1.0 else (),
            output_token_ids=seq.output_token_ids if penalised else (),
            stop_token_ids=seq.stop_token_ids if index < params.min_tokens else frozenset(),
        )

    def forget(self, request_id: str) -> None:
        """Drop a finished request's sampling state (its resolved seed)."""
        self._seeds.pop(request_id, None)
