"""One request on a rank, from intake to its one terminal output: the record the engine, the
runner and the sampler share.

    intake (engine) -> Request.admit -> scheduler (record.seq) -> runner reads record.sampling
    -> scheduler commits tokens into record.seq -> engine emits deltas (record.num_streamed)
    -> one terminal output -> the record is dropped

Everything a rank knows about a request lives here and nowhere else: the scheduler's
`Sequence` (prompt and committed output tokens, and its KV and schedule ledgers), the sampling
state (settings and the seed its random stream is keyed by), whether and how far it has been
streamed, and, if it ended with an error, what kind of error. `resumable()` is what another
rank would need to continue it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dist_engine.engine.outputs import ErrorKind, RequestOutput
from dist_engine.engine.sampler import SamplingState
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


@dataclass(eq=False)
class Request:
    seq: Sequence
    sampling: SamplingState
    stream: bool  # report new tokens as they come, not only the terminal result
    num_streamed: int = 0  # output tokens already reported
    error_kind: ErrorKind | None = None  # set when the engine ends it with an error

    @classmethod
    def admit(
        cls,
        seq: Sequence,
        stream: bool,
        device: torch.device | str = "cpu",
        seed: int | None = None,
    ) -> Request:
        """The record of a new request; raises ValueError if its sampling settings cannot be
        honoured here (the engine then answers it at once, with nothing scheduled).

        ``seed``: the seed of a request that gives none (the engine draws it from its own
        seed); the request's own `SamplingParams.seed` wins. With neither, a random one. It is
        fixed here, once, so the request's random stream is known from its record alone."""
        params = seq.sampling_params
        sampling = SamplingState(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed if params.seed is not None else seed,
            device=device,
        )
        return cls(seq, sampling, stream)

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    def delta(self, dp_rank: int) -> RequestOutput | None:
        """The tokens committed since the last report, for a streamed request still running."""
        seq = self.seq
        if not self.stream or seq.is_finished or seq.num_output_tokens <= self.num_streamed:
            return None
        output = RequestOutput.of(seq, dp_rank, self.num_streamed)
        self.num_streamed = seq.num_output_tokens
        return output

    def terminal(self, dp_rank: int) -> RequestOutput:
        """The one terminal output, with whatever was not streamed yet."""
        assert self.seq.is_finished, self.seq
        return RequestOutput.of(self.seq, dp_rank, self.num_streamed, self.error_kind)

    def resumable(self) -> ResumableRequest:
        seq = self.seq
        assert self.sampling.seed is not None  # SamplingState draws one when none is given
        return ResumableRequest(
            request_id=seq.request_id,
            prompt_token_ids=list(seq.prompt_token_ids),
            output_token_ids=list(seq.output_token_ids),
            params=seq.sampling_params,
            seed=self.sampling.seed,
            stream=self.stream,
            num_streamed=self.num_streamed,
        )
