"""One request on a rank, from intake to its one terminal output: the record the engine, the
runner and the sampler share.

    intake (engine) -> Request.admit -> scheduler (record.seq) -> runner draws with
    record.seed, keeps logprobs in the record -> scheduler commits tokens into record.seq
    -> engine emits deltas (record.num_streamed) -> one terminal output -> record dropped

Everything a rank knows about a request lives here and nowhere else: the scheduler's
`Sequence` (prompt and committed output tokens, its sampling settings, its KV and schedule
ledgers), the seed its random stream is keyed by (draw i is a function of the seed and i
alone, so a request resumed from its committed tokens draws on as it would have), whether and
how far it has been streamed, the logprobs it asked for, and, if it ended with an error, what
kind of error. `resumable()` is what another rank would need to continue it.
"""

from __future__ import annotations

import secrets
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dist_engine.engine.outputs import ErrorKind, RequestOutput, TokenLogprob
from scheduler import SamplingParams, Sequence


@dataclass(frozen=True)
class ResumableRequest:
    """A request as plain data, enough to continue it on another rank from its committed
    tokens: recompute `prompt_token_ids + output_token_ids` as a prefill and sample on with the
    same settings and seed."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    seed: int
    stream: bool
    num_streamed: int


class TokenHistory:
    """A part of a sequence's token ledger (the prompt, or the outputs so far) as one int64
    tensor, grown by the tokens added since the last ask: O(new tokens) a step where a list
    turned into a tensor every step costs O(history) in Python (the penalties read it every
    step). The ledger only grows, so what was copied stays right; a view handed out keeps its
    values when the history grows past it."""

    __slots__ = ("_buffer", "_length")

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.int64)
        self._length = 0

    def view(self, token_ids: list[int], start: int, stop: int) -> torch.Tensor:
        """``token_ids[start:stop]`` as a tensor (a view of the history's buffer)."""
        length = stop - start
        if length < self._length:  # not a ledger that only grows: start again
            self._length = 0
        if length > self._length:
            if length > self._buffer.numel():
                grown = torch.empty(max(length, 2 * self._buffer.numel(), 64), dtype=torch.int64)
                grown[: self._length] = self._buffer[: self._length]
                self._buffer = grown
            new = token_ids[start + self._length : stop]
            self._buffer[self._length : length] = torch.tensor(new, dtype=torch.int64)
            self._length = length
        return self._buffer[:length]


@dataclass(eq=False)
class Request:
    seq: Sequence
    seed: int  # keys the request's random stream: draw i is a function of (seed, i) alone
    stream: bool  # report new tokens as they come, not only the terminal result
    num_streamed: int = 0  # output tokens already reported
    error_kind: ErrorKind | None = None  # set when the engine ends it with an error
    # With SamplingParams.logprobs: one entry per output token drawn so far (the runner's);
    # None for the tokens a resumed request brought (reported before, never again).
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, filled chunk by chunk
    # (the first stays None: nothing predicts it); reported once, with the first output.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # With SamplingParams.grammar: its matcher, how many output tokens it has consumed, and
    # the mask for the next token, being computed (engine/structured.py).
    matcher: Any = None
    num_matched: int = 0
    next_mask: Future | None = None
    # With penalties: the prompt's and the outputs' ids as tensors, for the sampler.
    prompt_history: TokenHistory | None = field(default=None, repr=False)
    output_history: TokenHistory | None = field(default=None, repr=False)

    @classmethod
    def admit(cls, seq: Sequence, stream: bool, seed: int | None = None) -> Request:
        """The record of a new request. ``seed``: the seed of a request that gives none (the
        engine draws it from its own seed); the request's own `SamplingParams.seed` wins;
        with neither, a random one. It is fixed here, once, so the request's random stream is
        known from its record alone.

        A resumed sequence (`resume_sequence`) counts its committed outputs as reported: only
        the tokens after them are new, and its prompt logprobs, which went out with its first
        token, are not sent again.

        Raises ValueError for the front-end fields (`SamplingParams.n`, `stop`, and
        `structured_outputs` or `bad_words` not yet converted): a rank cannot apply them, and a
        request must not have them silently ignored."""
        params = seq.sampling_params
        if params.n != 1 or params.stop:
            raise ValueError(
                f"n={params.n} and stop={list(params.stop)!r} are applied by the front end (the "
                "LLM, the server), which sends each sample to a rank as a request of its own "
                "with n=1 and no stop strings; a rank cannot apply them"
            )
        if params.structured_outputs is not None or (
            params.bad_words and not params.bad_words_token_ids
        ):
            raise ValueError(
                "structured_outputs and bad_words are turned into a grammar and token ids by "
                "the front end (the LLM, the server); a rank cannot apply them as given"
            )
        if params.seed is not None:
            seed = params.seed
        elif seed is None:
            seed = secrets.randbits(64)
        num_resumed = seq.num_output_tokens
        request = cls(seq, seed, stream, num_streamed=num_resumed)
        if params.logprobs is not None:
            request.logprobs = [None] * num_resumed
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * seq.num_prompt_tokens
            request.prompt_logprobs_sent = num_resumed > 0
        return request

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    def prompt_ids(self) -> torch.Tensor:
        """The prompt's ids as an int64 tensor (made once)."""
        if self.prompt_history is None:
            self.prompt_history = TokenHistory()
        seq = self.seq
        return self.prompt_history.view(seq.token_ids, 0, seq.num_prompt_tokens)

    def output_ids(self) -> torch.Tensor:
        """The output ids so far as an int64 tensor (grown by the new ones)."""
        if self.output_history is None:
            self.output_history = TokenHistory()
        seq = self.seq
        return self.output_history.view(seq.token_ids, seq.num_prompt_tokens, len(seq.token_ids))

    def delta(self, dp_rank: int) -> RequestOutput | None:
        """The tokens committed since the last report, for a streamed request still running."""
        seq = self.seq
        if not self.stream or seq.is_finished or seq.num_output_tokens <= self.num_streamed:
            return None
        output = self._with_logprobs(RequestOutput.of(seq, dp_rank, self.num_streamed))
        self.num_streamed = seq.num_output_tokens
        return output

    def terminal(self, dp_rank: int) -> RequestOutput:
        """The one terminal output, with whatever was not streamed yet."""
        assert self.seq.is_finished, self.seq
        output = RequestOutput.of(self.seq, dp_rank, self.num_streamed, self.error_kind)
        return self._with_logprobs(output)

    def _with_logprobs(self, output: RequestOutput) -> RequestOutput:
        params = self.seq.sampling_params
        changes: dict = {}
        if params.logprobs is not None:
            end = self.num_streamed + len(output.new_token_ids)
            changes["new_logprobs"] = self.logprobs[self.num_streamed : end]
        if params.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            changes["prompt_logprobs"] = list(self.prompt_logprobs)
            self.prompt_logprobs_sent = True
        return replace(output, **changes) if changes else output

    def resumable(self) -> ResumableRequest:
        seq = self.seq
        return ResumableRequest(
            request_id=seq.request_id,
            prompt_token_ids=list(seq.prompt_token_ids),
            output_token_ids=list(seq.output_token_ids),
            params=seq.sampling_params,
            seed=self.seed,
            stream=self.stream,
            num_streamed=self.num_streamed,
        )


def resume_sequence(seq: Sequence, output_token_ids: list[int] | tuple[int, ...]) -> None:
    """Give a new sequence the output tokens its request had committed before (on a group that
    failed), so that it continues after them exactly as it would have.

    The sequence is then what a request preempted for recompute is: prompt and outputs in its
    token ledger, no KV, waiting to be prefilled whole; its next token is drawn at output index
    ``len(output_token_ids)`` (the runner's `seq.num_output_tokens`), and its penalties,
    ``min_tokens``, ``max_tokens`` and stop rules count the resumed outputs as outputs. So with
    the same seed it draws the tokens a fault-free run draws (greedy needs no seed).
    Raises ValueError when the tokens leave nothing to generate (``max_tokens`` reached) or
    the sequence is not new.
    """
    if seq.num_output_tokens or seq.num_tokens or seq.block_table:
        raise ValueError(f"only a new sequence can be resumed, got {seq!r}")
    if len(output_token_ids) >= seq.max_tokens:
        raise ValueError(
            f"request {seq.request_id!r}: {len(output_token_ids)} resumed output tokens leave "
            f"nothing to generate (max_tokens {seq.max_tokens})"
        )
    seq.token_ids.extend(output_token_ids)
    seq.num_output_tokens = len(output_token_ids)
