"""The model runner: one scheduler step in, one sampled token per scheduled sequence out.

Shape legend: T = tokens in the step's flat batch, B = scheduled sequences, V = vocab.

It turns ``SchedulerOutputs`` into tensors (token ids, positions, slot mapping, block tables,
which rows need logits), runs prefill steps with the MoE layers in normal dispatch mode and
decode steps in low-latency mode, and samples. A rank with nothing scheduled still runs a
zero-token forward, because in expert parallelism every MoE layer is a collective that every rank
must join; only a step the whole group knows to be empty (``known_empty``) skips the forward.
"""

from __future__ import annotations

import torch

from dist_engine.attention.metadata import AttentionMetadata
from dist_engine.engine.sampler import Sampler, SamplingState
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
        self._sampling: dict[str, SamplingState] = {}

    @torch.no_grad()
    def execute(self, outputs: SchedulerOutputs) -> list[int]:
        """Run one step; returns one token id per scheduled sequence, in order."""
        if outputs.known_empty:
            return []
        seqs = outputs.scheduled_seqs
        mode = DispatchMode.NORMAL if outputs.prompt_run else DispatchMode.LOW_LATENCY
        # The scheduler advanced each ledger optimistically: the step's tokens start where the
        # KV stood before (previous_num_tokens).
        cached = [seq.previous_num_tokens for seq in seqs]
        new = outputs.seqlens_q
        input_ids: list[int] = []
        for seq, start, count in zip(seqs, cached, new, strict=True):
            input_ids.extend(seq.token_ids[start : start + count])
        attn = AttentionMetadata.build(
            [seq.block_table for seq in seqs],
            cached,
            new,
            self.block_size,
            is_prefill=outputs.prompt_run,
            device=self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, attn.positions, attn, mode)
        # Only a sequence whose step reaches the end of its tokens needs logits.
        rows = [
            b
            for b, (seq, start, count) in enumerate(zip(seqs, cached, new, strict=True))
            if start + count == len(seq.token_ids)
        ]
        tokens = [NO_TOKEN] * len(seqs)
        if rows:
            last_token_rows = attn.query_start_loc[1:][rows] - 1
            logits = self.model.compute_logits(hidden[last_token_rows])
            states = [self._state(seqs[b]) for b in rows]
            for b, token in zip(rows, self.sampler(logits, states).tolist(), strict=True):
                tokens[b] = token
        return tokens

    def _state(self, seq: Sequence) -> SamplingState:
        state = self._sampling.get(seq.request_id)
        if state is None:
            params = seq.sampling_params
            state = SamplingState(
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                seed=params.seed,
                device=self.device,
            )
            self._sampling[seq.request_id] = state
        return state

    def forget(self, request_id: str) -> None:
        """Drop a finished request's sampling state (its generator)."""
        self._sampling.pop(request_id, None)
