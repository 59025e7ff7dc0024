"""The model runner: one scheduler step in, one sampled token per scheduled sequence out.

Shape legend: T = tokens in the step's flat batch, B = scheduled sequences, V = vocab.

It turns ``SchedulerOutputs`` into tensors (token ids, positions, slot mapping, block tables,
which rows need logits), runs prefill steps with the MoE layers in normal dispatch mode and
decode steps in low-latency mode, and samples. A rank with nothing scheduled still runs a
zero-token forward, because in expert parallelism every MoE layer is a collective that every rank
must join; only a step the whole group knows to be empty (``known_empty``) skips the forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from dist_engine.attention.decode_inputs import DecodeInputs
from dist_engine.attention.metadata import (
    AttentionMetadata,
    MixedMetadata,
    StepMetadata,
    bucketed_columns,
    int64_tensor,
)
from dist_engine.engine.outputs import TokenLogprob
from dist_engine.engine.sampler import Logprobs, Sampler, SamplingRow, check_row, prompt_logprobs
from dist_engine.engine.structured import allowed_tokens
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
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        decode_batch_sizes: tuple[int, ...] | None = None,
    ) -> None:
        """max_model_len: the longest context, which caps a decode step's block-table width
        (None: uncapped). With it and max_num_seqs, decode steps take their inputs from
        persistent buffers (`DecodeInputs`), padded up to the next of `decode_batch_sizes`
        when given (the sizes a compiled or captured decode step exists for)."""
        if model.kv_cache is None:
            raise ValueError("attach a KVCache to the model before building its runner")
        self.model = model
        self.block_size = block_size
        self.max_columns = None if max_model_len is None else -(-max_model_len // block_size)
        self.device = torch.device(device)
        self.sampler = Sampler()  # the engine sets `native` from its sampler_backend
        # What runs a decode step's forward over the persistent buffers: `decode_logits`, or
        # its replay from CUDA graphs (the engine sets that, engine/decode_graphs.py).
        self.decode_step: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor] = (
            self.decode_logits
        )
        self.decode_inputs: DecodeInputs | None = None
        if decode_batch_sizes and (max_num_seqs is None or self.max_columns is None):
            raise ValueError("decode_batch_sizes needs max_model_len and max_num_seqs")
        if decode_batch_sizes and _counts_expert_load(model):
            # Pad rows go through the router like any row: they would count as routed load.
            raise ValueError("decode_batch_sizes: cannot pad a model that counts EPLB load")
        if max_model_len is not None:
            # No step's position reaches max_model_len (the scheduler refuses longer contexts).
            model.rotary.cache(max_model_len, model.dtype)
        if max_num_seqs is not None and self.max_columns is not None:
            self.decode_inputs = DecodeInputs(
                max_num_seqs, self.max_columns, block_size, self.device, decode_batch_sizes
            )

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
        if not outputs.is_prefill and seqs and self.decode_inputs is not None:
            tables = [seq.block_table for seq in seqs]
            ids, decode_attn = self.decode_inputs.fill(input_ids, tables, cached)
            logits = self.decode_step(ids, decode_attn)[: len(seqs)]
            return self._sample_all(logits, seqs, requests)
        attn = self._metadata(seqs, cached, new, outputs)
        ids = int64_tensor(input_ids, self.device)
        hidden = self.model(ids, attn.positions, attn, mode)
        # Only a sequence whose step reaches the end of its tokens needs logits.
        rows = [
            b
            for b, (seq, start, count) in enumerate(zip(seqs, cached, new, strict=True))
            if start + count == len(seq.token_ids)
        ]
        tokens = [NO_TOKEN] * len(seqs)
        failures: list[tuple[Sequence, str]] = []
        if outputs.is_prefill:
            self._score_prompts(outputs, hidden, attn, cached, requests)
        if rows:
            last_token_rows = attn.query_start_loc[1:][rows] - 1
            logits = self.model.compute_logits(hidden[last_token_rows])
            picked = [seqs[b] for b in rows]
            for b, token in self._sample(logits, picked, requests, failures):
                tokens[rows[b]] = token
        return tokens, failures

    def decode_logits(self, input_ids: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """A whole decode step's forward: input_ids [Bp], one token per row of `attn` (from
        `DecodeInputs.fill`) → logits [Bp, V]. It has fixed shapes for a given (Bp, MB) and
        no host sync, so it is what a compiled or captured decode step runs."""
        hidden = self.model(input_ids, attn.positions, attn, dispatch_mode(StepKind.DECODE))
        return self.model.compute_logits(hidden)

    def _sample_all(
        self, logits: torch.Tensor, seqs: list[Sequence], requests: Mapping[str, Request]
    ) -> tuple[list[int], list[tuple[Sequence, str]]]:
        """logits [B, V], one row per scheduled sequence → `execute`'s answer."""
        tokens = [NO_TOKEN] * len(seqs)
        failures: list[tuple[Sequence, str]] = []
        for row, token in self._sample(logits, seqs, requests, failures):
            tokens[row] = token
        return tokens, failures

    def _metadata(
        self, seqs: list[Sequence], cached: list[int], new: list[int], outputs: SchedulerOutputs
    ) -> StepMetadata:
        """The step's attention metadata. Decode tokens are attended in the decode regime in
        every step: a mixed step's get a part of their own, or the whole batch where this rank
        has no prompt chunk in it."""
        tables = [seq.block_table for seq in seqs]
        split = len(seqs) - outputs.num_decode_seqs
        if outputs.is_prefill and outputs.num_decode_seqs == 0:
            return AttentionMetadata.build(tables, cached, new, self.block_size, True, self.device)
        if not outputs.is_prefill or split == 0:
            return self._decode_metadata(tables, cached, new)
        return MixedMetadata.join(
            AttentionMetadata.build(
                tables[:split], cached[:split], new[:split], self.block_size, True, self.device
            ),
            self._decode_metadata(tables[split:], cached[split:], new[split:]),
        )

    def _decode_metadata(
        self, tables: list[list[int]], cached: list[int], new: list[int]
    ) -> AttentionMetadata:
        """One token per sequence, attended in the decode regime, block tables as wide as
        their bucket (`bucketed_columns`)."""
        contexts = (c + n for c, n in zip(cached, new, strict=True))
        needed = max((-(-length // self.block_size) for length in contexts), default=0)
        width = bucketed_columns(needed, self.max_columns)
        return AttentionMetadata.build(
            tables, cached, new, self.block_size, False, self.device, width
        )

    def _sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        requests: Mapping[str, Request],
        failures: list[tuple[Sequence, str]],
    ) -> list[tuple[int, int]]:
        """logits: [R, V] for `seqs` → (row, token) for every row that sampled; rows that
        could not are added to `failures`. One batched call normally; row by row only when the
        batch fails, to find the row that fails it. A row whose request asked for logprobs
        gets the sampled token's in its record."""
        rows: dict[int, SamplingRow] = {}
        for row, seq in enumerate(seqs):
            try:
                sampling_row = _sampling_row(seq, requests[seq.request_id])
                check_row(sampling_row, logits.shape[1])
            except Exception as error:
                failures.append((seq, f"sampling settings rejected: {error}"))
                continue
            rows[row] = sampling_row
        usable = list(rows)
        if not usable:
            return []
        logits = _apply_grammars(logits, seqs, requests)
        try:
            picked = logits if len(usable) == len(seqs) else logits[usable]
            output = self.sampler(picked, [rows[row] for row in usable], checked=True)
            sampled = list(zip(usable, output.token_ids.tolist(), strict=True))
            if output.logprobs is not None:
                for position, (row, token) in enumerate(sampled):
                    request = requests[seqs[row].request_id]
                    _keep_logprob(request, rows[row], output.logprobs, position, token)
            return sampled
        except Exception:
            sampled = []
            for row in usable:
                try:
                    output = self.sampler(logits[row : row + 1], [rows[row]], checked=True)
                    token = output.token_ids.tolist()[0]
                except Exception as error:
                    failures.append((seqs[row], f"sampling failed: {error}"))
                    continue
                if output.logprobs is not None:
                    request = requests[seqs[row].request_id]
                    _keep_logprob(request, rows[row], output.logprobs, 0, token)
                sampled.append((row, token))
            return sampled

    def _score_prompts(
        self,
        outputs: SchedulerOutputs,
        hidden: torch.Tensor,
        attn: StepMetadata,
        cached: list[int],
        requests: Mapping[str, Request],
    ) -> None:
        """Prompt logprobs (vLLM's `prompt_logprobs`, and completions' echo with logprobs):
        each prompt chunk of a request that asks scores the prompt tokens its positions
        predict, into the request's record. hidden: [T, D] for the step's flat batch."""
        seqs = outputs.scheduled_seqs
        starts = (
            attn.query_start_loc.tolist()
            if any(seq.sampling_params.prompt_logprobs is not None for seq in seqs)
            else None
        )
        if starts is None:
            return
        for b, seq in enumerate(seqs[: len(seqs) - outputs.num_decode_seqs]):
            count = seq.sampling_params.prompt_logprobs
            request = requests.get(seq.request_id)
            if count is None or request is None:
                continue
            first = cached[b]  # position of the chunk's first token
            # Position p predicts token p + 1; only prompt tokens are scored (a recomputed
            # output, after a preemption, is not the prompt).
            end = min(first + outputs.seqlens_q[b], seq.num_prompt_tokens - 1)
            if end <= first:
                continue
            rows = hidden[starts[b] : starts[b] + end - first]
            targets = torch.tensor(seq.token_ids[first + 1 : end + 1], device=self.device)
            scored = prompt_logprobs(self.model.compute_logits(rows), targets, count)
            entries = _entries(scored, targets.tolist())
            record = request.prompt_logprobs
            for offset, entry in enumerate(entries):
                record[first + 1 + offset] = entry


def _apply_grammars(
    logits: torch.Tensor, seqs: list[Sequence], requests: Mapping[str, Request]
) -> torch.Tensor:
    """logits: [R, V] for `seqs`; rows of grammar-bound requests keep only the tokens their
    grammar allows next (their masks were computed while the step ran; engine/structured.py)."""
    masked = [
        (row, request)
        for row, seq in enumerate(seqs)
        if (request := requests[seq.request_id]).next_mask is not None
    ]
    if not masked:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for row, request in masked:
        allowed = allowed_tokens(request.next_mask.result(), vocab).to(logits.device)
        logits[row].masked_fill_(~allowed, float("-inf"))
    return logits


def _sampling_row(seq: Sequence, request: Request) -> SamplingRow:
    """The sampler's row for `seq`: its next output token is number num_output_tokens, drawn
    from the random stream its record's seed keys."""
    params = seq.sampling_params
    index = seq.num_output_tokens
    prompt: torch.Tensor | tuple = ()
    outputs: torch.Tensor | tuple = ()
    if params.reads_output:
        # Tensors the record grows by each step's tokens: the penalties count the whole
        # history every step (and the bad words match its tail).
        outputs = request.output_ids()
        if params.repetition_penalty != 1.0:
            prompt = request.prompt_ids()
    return SamplingRow(
        params,
        request.seed,
        index,
        prompt_token_ids=prompt,
        output_token_ids=outputs,
        stop_token_ids=seq.stop_token_ids if index < params.min_tokens else frozenset(),
    )


def _keep_logprob(
    request: Request, row: SamplingRow, scored: Logprobs, position: int, token: int
) -> None:
    """The logprob of ``token``, drawn for output ``row.index``, into the record (a token
    drawn again at that index, after a preemption, replaces it)."""
    if row.params.logprobs is None:
        return
    at = slice(position, position + 1)
    one = Logprobs(
        scored.token_logprobs[at],
        scored.token_ranks[at],
        scored.top_token_ids[at],
        scored.top_logprobs[at],
    )
    (entry,) = _entries(one, [token])
    del request.logprobs[row.index :]
    request.logprobs.append(entry)


def _entries(scored: Logprobs, token_ids: list[int]) -> list[TokenLogprob]:
    """Plain entries of scored positions, ``token_ids`` the token each position scored (the
    sampler leaves -1 in the top ids past what a row asked for)."""
    values = scored.token_logprobs.tolist()
    ranks = scored.token_ranks.tolist()
    top_ids = scored.top_token_ids.tolist()
    top_values = scored.top_logprobs.tolist()
    return [
        TokenLogprob(
            token_ids[index],
            float(values[index]),
            int(ranks[index]),
            tuple(
                (top, logprob)
                for top, logprob in zip(top_ids[index], top_values[index], strict=True)
                if top >= 0
            ),
        )
        for index in range(len(values))
    ]


def _counts_expert_load(model: MoECausalLM) -> bool:
    return any(getattr(module, "count_expert_load", False) for module in model.modules())
