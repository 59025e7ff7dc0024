"""What a DP rank reports about a request: streamed deltas and exactly one terminal result;
and `CompletionOutput`, the offline API's per-completion view in vLLM's shape."""

from __future__ import annotations

import enum
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field, fields

from dist_engine.errors import LockstepError
from scheduler import Sequence, SequenceStatus


class ErrorKind(enum.Enum):
    """Why a request ended with an error (finish reason ``"error: ..."``), as data: callers
    decide what to answer from this, never from the message's text."""

    INVALID_REQUEST = "invalid_request"  # its own input: a bad prompt, id or setting
    REQUEST_FAILED = "request_failed"  # a fault inside a step, contained to this request
    GROUP_FAILED = "group_failed"  # the DP group failed: a rank died or stopped answering
    ENGINE_STOPPED = "engine_stopped"  # the engine (or the server) shut down before it ended


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability, its rank among the vocabulary (1: the most likely) and the
    most likely tokens at its position, most likely first (as many as the request asked)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


class TokenSlice(SequenceABC):
    """``tokens[start:stop]`` of a list that only grows at its end, made without copying it.

    A running streamed request's output carries every output token so far, every step; a
    copy each time costs O(tokens so far) per request per step on the rank and again in the
    driver (at 32k-token outputs, 64 streams: ~11 ms a step). A slice of the sequence's own
    token list, fixed at its length when made, costs O(1) and reads as that list would:
    ``len``, indexing (a slice of it is a list), iteration, ``==`` with lists, tuples and other
    slices, ``list(...)``. Not JSON by itself (`output_to_plain` writes it as a list); pickled
    as the list it reads as."""

    __slots__ = ("_start", "_stop", "_tokens")

    def __init__(self, tokens: list[int], start: int, stop: int) -> None:
        self._tokens = tokens
        self._start = start
        self._stop = stop

    @staticmethod
    def whole(tokens: list[int]) -> TokenSlice:
        """All of ``tokens`` as they are now."""
        return TokenSlice(tokens, 0, len(tokens))

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return self._tokens[self._start : self._stop][index]
        length = self._stop - self._start
        if index < 0:
            index += length
        if not 0 <= index < length:
            raise IndexError("TokenSlice index out of range")
        return self._tokens[self._start + index]

    def __iter__(self):
        # (not islice over the list: that would step through the prompt before it too)
        return iter(self._tokens[self._start : self._stop])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenSlice | list | tuple):
            if len(other) != len(self):
                return False
            mine = self._tokens[self._start : self._stop]
            return mine == (other if isinstance(other, list) else list(other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # as a list's

    def __add__(self, other: list[int]) -> list[int]:
        return [*self, *other]

    def __radd__(self, other: list[int]) -> list[int]:
        return [*other, *self]

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self):
        return (TokenSlice.whole, (list(self),))


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # Every output token so far: a list in a terminal output, a `TokenSlice` (reads as one)
    # in a running stream's, so a step's outputs cost O(its new tokens), not O(all so far).
    output_token_ids: list[int] | TokenSlice
    new_token_ids: list[int]  # the tokens since this request's previous output
    finished: bool
    finish_reason: str | None
    dp_rank: int
    arrival_time: float  # time.monotonic() on the rank
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    # Why the request ended where the finish reason alone does not say (the limit a prompt
    # exceeded, the pool it could not fit); None otherwise.
    detail: str | None = None
    error_kind: ErrorKind | None = None  # set exactly when finish_reason is "error: ..."
    # With SamplingParams.logprobs: one entry per token of new_token_ids. With prompt_logprobs:
    # one per prompt token (the first None: nothing predicts it), in the first output only.
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @classmethod
    def failed(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        reason: str,
        dp_rank: int,
        arrival_time: float,
        error_kind: ErrorKind,
    ) -> RequestOutput:
        """The terminal output of a request that ended with an error before any token:
        finish reason ``"error: <reason>"``."""
        return cls(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            output_token_ids=[],
            new_token_ids=[],
            finished=True,
            finish_reason=f"error: {reason}",
            dp_rank=dp_rank,
            arrival_time=arrival_time,
            error_kind=error_kind,
        )

    @classmethod
    def of(
        cls, seq: Sequence, dp_rank: int, num_sent: int, error_kind: ErrorKind | None = None
    ) -> RequestOutput:
        """The state of ``seq``; ``num_sent`` output tokens were already streamed. A sequence
        the scheduler failed on its own (its prompt) is an INVALID_REQUEST unless
        ``error_kind`` says otherwise. A running sequence's output tokens are a `TokenSlice`
        of its token list (which only grows), a finished one's a list."""
        tokens = seq.token_ids
        first = seq.num_prompt_tokens
        finished = seq.is_finished
        failed = seq.status is SequenceStatus.FAILED
        kind = (error_kind or ErrorKind.INVALID_REQUEST) if failed else None
        outputs = tokens[first:] if finished else TokenSlice(tokens, first, len(tokens))
        return cls(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=outputs,
            new_token_ids=tokens[first + num_sent :],
            finished=finished,
            finish_reason=seq.finish_reason,
            dp_rank=dp_rank,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            finish_time=seq.finish_time,
            token_times=list(seq.token_times) if finished else [],
            detail=(seq.error_message or None) if finished else None,
            error_kind=kind,
        )


@dataclass(frozen=True)
class Logprob:
    """vLLM's `Logprob`: a token's log-probability at one position, its rank in the vocabulary
    there (1: the most likely) and its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class CompletionOutput:
    """One completion (sample) of a request, shaped like vLLM's (`output.outputs[i].text`).

    ``index``: the sample's, 0 to n - 1. ``finish_reason``: "stop" (an EOS or stop token, or
    a stop string), "length" (max_tokens or the model's length), or Lockstep's other reasons
    as they are ("abort", "prompt_length_exceeded", "insufficient_system_resource",
    "error: ..."); None while the request runs. With `SamplingParams.logprobs`, ``logprobs``
    holds one dict per token of ``token_ids`` (the sampled token's `Logprob`, then the most
    likely tokens', as vLLM's) and ``cumulative_logprob`` the sampled tokens' sum; both are
    None when the request asked for none.
    """

    index: int
    text: str | None  # None without a tokenizer, and while the request runs
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


# -- outputs as JSON values: how they cross a process boundary Lockstep owns (the torchrun
# results exchange, a Ray rank's output channel), never as pickles --------------------------
_OUTPUT_FIELDS = [f.name for f in fields(RequestOutput)]


def output_to_plain(output: RequestOutput) -> dict:
    """An output as JSON values."""
    plain = {name: getattr(output, name) for name in _OUTPUT_FIELDS}
    if isinstance(output.output_token_ids, TokenSlice):
        plain["output_token_ids"] = list(output.output_token_ids)
    if output.error_kind is not None:
        plain["error_kind"] = output.error_kind.value
    for name in ("new_logprobs", "prompt_logprobs"):
        if plain[name] is not None:
            plain[name] = logprobs_to_plain(plain[name])
    return plain


def logprobs_to_plain(entries: list[TokenLogprob | None]) -> list:
    return [None if e is None else _plain_logprob(e) for e in entries]


def logprobs_from_plain(entries: list) -> list[TokenLogprob | None]:
    if not isinstance(entries, list):
        raise LockstepError(f"a rank sent logprobs that are not a list: {str(entries)[:80]}")
    return [None if e is None else _logprob(e) for e in entries]


def output_from_plain(plain: dict) -> RequestOutput:
    """The output `output_to_plain` made; LockstepError for one that is not."""
    if not isinstance(plain, dict):
        raise LockstepError(f"a rank sent a result that is not an object: {str(plain)[:80]}")
    unknown = set(plain) - set(_OUTPUT_FIELDS)
    if unknown:
        raise LockstepError(f"a rank sent results with unknown fields {sorted(unknown)}")
    kind = plain.get("error_kind")
    if kind is not None:
        try:
            plain = {**plain, "error_kind": ErrorKind(kind)}
        except ValueError:
            raise LockstepError(
                f"a rank sent results with an unknown error_kind {kind!r}"
            ) from None
    for name in ("new_logprobs", "prompt_logprobs"):
        if plain.get(name) is not None:
            plain = {**plain, name: logprobs_from_plain(plain[name])}
    try:
        return RequestOutput(**plain)
    except TypeError as error:
        raise LockstepError(f"a rank sent a malformed result: {error}") from None


def _plain_logprob(entry: TokenLogprob) -> list:
    return [entry.token_id, entry.logprob, entry.rank, [list(pair) for pair in entry.top]]


def _logprob(plain: list) -> TokenLogprob:
    try:
        token_id, logprob, rank, top = plain
        return TokenLogprob(
            int(token_id), float(logprob), int(rank), tuple((int(t), float(v)) for t, v in top)
        )
    except (TypeError, ValueError):
        raise LockstepError(f"a rank sent a malformed logprob entry {str(plain)[:80]}") from None
