"""What a front end (the `LLM`, the server) does when its group fails and it heals
(`parallel.on_rank_failure: heal`): the bookkeeping that lets every unfinished request go on
in a new group as if nothing had happened. Pure logic: no Ray, no threads.

    submit: ResumeLedger.add -> Submission (seed fixed here for a request that gives none)
    outputs: ResumeLedger.take(output) -> what the caller sees (None: held for it)
    failure: RecoveryBudget.available? -> client.reform() (-> the ranks replaced)
             -> ResumeLedger.resume(ranks) -> resubmissions (+ poison requests ended alone)

Why a resubmission gives a fault-free run's tokens: a request's draw for output token i is a
pure function of its seed and i (dist_engine/engine/sampler.py), greedy is deterministic, and
scheduling never changes results. So the ledger resubmits each request with the same seed
and the output tokens the front end already has (`Submission.resumed_token_ids`); the rank
puts them in the sequence's token ledger (`resume_sequence`) and draws on at that index.
Tokens reach the front end only in a streamed request's deltas, so a request is resubmitted
with the tokens its caller has seen (a stream continues with no token missing or repeated),
and one that was not streamed starts again from its prompt and computes the same tokens again.
Resubmissions are always streamed, so a second failure resumes them from what they have.

A *poison* request (one whose steps kill the group) would otherwise loop: heal, resubmit,
fail. A request outstanding in `poison_failure_threshold` failures in a row, with no token
committed in between as far as the front end can see, is ended alone with an error naming it.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import secrets
from dataclasses import dataclass, field

from dist_engine.engine.outputs import ErrorKind, RequestOutput, TokenLogprob
from launcher.clients import Submission
from scheduler import SamplingParams

_HOUR_S = 3600.0


@dataclass(frozen=True)
class GroupFault:
    """A failure of the running group, as a front end noticed it: a `RankFailure`, a rank
    ending its requests because the group failed (`ErrorKind.GROUP_FAILED`), or a rank whose
    loop died. ``rank``: the rank named, when one was."""

    reason: str
    rank: int | None = None


def describe_reform(gone: set[int], live: list[int]) -> str:
    """What a re-form did, for the log: which ranks were replaced, which left the group (it
    shrank onto the others), and which were kept with their requests."""
    parts = []
    if gone & set(live):
        parts.append(f"rank(s) {sorted(gone & set(live))} replaced")
    if gone - set(live):
        parts.append(f"rank(s) {sorted(gone - set(live))} gone, the group shrank onto the rest")
    kept = sorted(set(live) - gone)
    parts.append(f"{kept or 'none'} kept with their requests")
    return ", ".join(parts)


def is_group_failure(output: RequestOutput) -> bool:
    """A rank ended this request because its group failed: under `heal` the request is
    resubmitted, not ended."""
    return output.finished and output.error_kind is ErrorKind.GROUP_FAILED


class DriverSeeds:
    """Seeds for requests that give none, fixed by the front end before the first submission
    so that a resubmission draws the same stream. With the job's `seed` (EngineConfig.seed)
    they are drawn in submission order, so a rerun of the same job samples alike whatever the
    DP size or routing; without one, each is random."""

    def __init__(self, job_seed: int | None) -> None:
        self._random = None if job_seed is None else random.Random(f"lockstep:{job_seed}:driver")

    def seed_for(self, params: SamplingParams) -> int | None:
        """The seed to submit with: None when the request gives its own (it wins anyway)."""
        if params.seed is not None:
            return None
        if self._random is None:
            return secrets.randbits(63)
        return self._random.getrandbits(63)


class RecoveryBudget:
    """At most ``max_per_hour`` recoveries within any hour; past it a failure fails the
    group as `on_rank_failure: fail` would. Times are time.monotonic() seconds."""

    def __init__(self, max_per_hour: int) -> None:
        self.max_per_hour = max_per_hour
        self._times: collections.deque[float] = collections.deque()

    def available(self, now: float) -> bool:
        while self._times and now - self._times[0] >= _HOUR_S:
            self._times.popleft()
        return len(self._times) < self.max_per_hour

    def spend(self, now: float) -> None:
        assert self.available(now), "no recovery left in this hour"
        self._times.append(now)

    def describe(self) -> str:
        return (
            f"{len(self._times)} recoveries in the last hour "
            f"(parallel.max_recoveries_per_hour {self.max_per_hour})"
        )


@dataclass(eq=False)
class _Tracked:
    """One unfinished request as its front end knows it."""

    submission: Submission  # as first submitted
    rank: int  # where it is routed (moved to a live rank when its rank left a shrunk group)
    caller_streams: bool  # the caller sees every new token (else only the terminal output)
    committed: list[int] = field(default_factory=list)  # output tokens the front end has
    # Held for a caller that does not stream, out of the deltas of a resubmitted request.
    held_logprobs: list[TokenLogprob] = field(default_factory=list)
    held_prompt_logprobs: list[TokenLogprob | None] | None = None
    num_failures: int = 0  # failures in a row it was outstanding in, no token in between
    resubmitted: bool = False
    # The first incarnation's times, once it had a token (both on its rank's clock).
    arrival_time: float | None = None
    first_token_time: float | None = None


@dataclass(frozen=True)
class Resumption:
    """What a recovery does with the unfinished requests: submit these to the new group (by
    request id; the caller routes each to its rank), and hand these terminal outputs (the
    poison requests, ended alone) to the callers."""

    submissions: list[Submission]
    ended: list[RequestOutput]

    @property
    def num_from_tokens(self) -> int:
        """How many resume from committed tokens (the rest start again from the prompt)."""
        return sum(1 for s in self.submissions if s.resumed_token_ids)


class ResumeLedger:
    """Every unfinished request of a front end, with what it needs to be resubmitted."""

    def __init__(self, poison_failure_threshold: int) -> None:
        self.poison_failure_threshold = poison_failure_threshold
        self._open: dict[str, _Tracked] = {}

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int | None,
        stream: bool,
        rank: int,
        sample_group: str | None = None,
        deferred: bool = False,
    ) -> Submission:
        """Track a new request routed to ``rank``; returns its first submission (resubmissions
        keep its seed, ``sample_group`` and ``deferred``). ``seed``: `DriverSeeds`'."""
        submission = Submission(
            request_id,
            prompt_token_ids,
            params,
            stream,
            seed=seed,
            sample_group=sample_group,
            deferred=deferred,
        )
        self._open[request_id] = _Tracked(submission, rank, caller_streams=stream)
        return submission

    def move(self, request_id: str, rank: int) -> None:
        """A request whose rank left a shrunk group goes on at ``rank``."""
        self._open[request_id].rank = rank

    def forget(self, request_id: str) -> None:
        """The caller ended the request itself (e.g. answered it without its rank)."""
        self._open.pop(request_id, None)

    def take(self, output: RequestOutput) -> RequestOutput | None:
        """An output of a tracked request, as its caller should see it; None for a delta
        the caller does not see (it does not stream: the tokens are kept for the terminal
        output). A terminal output ends the tracking. Outputs of untracked requests are
        returned as they are."""
        tracked = self._open.get(output.request_id)
        if tracked is None:
            return output
        if not tracked.resubmitted:
            if output.finished:
                del self._open[output.request_id]
            else:
                self._keep(tracked, output)
            return output  # the first incarnation reports just what the caller expects
        if not output.finished:
            self._keep(tracked, output)
            if not tracked.caller_streams:
                return None
            return self._with_first_times(tracked, output)
        del self._open[output.request_id]
        return self._terminal(tracked, output)

    def _keep(self, tracked: _Tracked, output: RequestOutput) -> None:
        new = output.new_token_ids
        if not new:
            return
        tracked.committed.extend(new)
        tracked.num_failures = 0  # it made progress: its steps did not fail the group
        if tracked.arrival_time is None and output.first_token_time is not None:
            tracked.arrival_time = output.arrival_time
            tracked.first_token_time = output.first_token_time
        if not tracked.caller_streams:
            if output.new_logprobs:
                tracked.held_logprobs.extend(output.new_logprobs)
            if output.prompt_logprobs is not None and tracked.held_prompt_logprobs is None:
                tracked.held_prompt_logprobs = list(output.prompt_logprobs)

    def _terminal(self, tracked: _Tracked, output: RequestOutput) -> RequestOutput:
        """A resubmitted request's end: every token it has (those the front end had before
        this output, then the output's new ones: a rank that refused or failed it reports
        none of the resumed ones), the new ones counted from what its caller has seen."""
        tokens = tracked.committed + list(output.new_token_ids)
        seen = len(tracked.committed) if tracked.caller_streams else 0
        changes: dict = {"output_token_ids": tokens, "new_token_ids": tokens[seen:]}
        if not tracked.caller_streams:
            if output.new_logprobs is not None:
                changes["new_logprobs"] = tracked.held_logprobs + list(output.new_logprobs)
            if tracked.held_prompt_logprobs is not None:
                changes["prompt_logprobs"] = tracked.held_prompt_logprobs
        return self._with_first_times(tracked, dataclasses.replace(output, **changes))

    @staticmethod
    def _with_first_times(tracked: _Tracked, output: RequestOutput) -> RequestOutput:
        if tracked.arrival_time is None or tracked.first_token_time is None:
            return output
        return dataclasses.replace(
            output, arrival_time=tracked.arrival_time, first_token_time=tracked.first_token_time
        )

    def resume(self, fault: GroupFault, ranks: set[int] | None = None) -> Resumption:
        """The group failed and ``ranks`` were replaced (None: all of them): each unfinished
        request routed to one of them is resubmitted from the tokens its front end has; the
        other ranks kept their processes, so their requests go on there untouched. A request
        of any rank outstanding in too many failures in a row is ended alone with an error
        naming it (the caller aborts it on its rank if that rank was kept)."""
        submissions: list[Submission] = []
        ended: list[RequestOutput] = []
        for request_id, tracked in list(self._open.items()):
            tracked.num_failures += 1
            first = tracked.submission
            if tracked.num_failures >= self.poison_failure_threshold:
                del self._open[request_id]
                ended.append(self._poisoned(tracked, fault))
                continue
            if ranks is not None and tracked.rank not in ranks:
                continue  # its rank was kept: it goes on there
            tracked.resubmitted = True
            submissions.append(
                dataclasses.replace(first, stream=True, resumed_token_ids=tuple(tracked.committed))
            )
        return Resumption(submissions, ended)

    def _poisoned(self, tracked: _Tracked, fault: GroupFault) -> RequestOutput:
        first = tracked.submission
        reason = (
            f"request {first.request_id} was outstanding in {tracked.num_failures} failures of "
            f"the DP group in a row without a token in between (parallel."
            f"poison_failure_threshold {self.poison_failure_threshold}); it is ended alone, as "
            f"it may be what fails the group (last failure: {fault.reason})"
        )
        output = RequestOutput.failed(
            first.request_id,
            list(first.prompt_token_ids),
            reason,
            dp_rank=tracked.rank,
            arrival_time=tracked.arrival_time or 0.0,
            error_kind=ErrorKind.REQUEST_FAILED,
        )
        tokens = list(tracked.committed)
        seen = len(tokens) if tracked.caller_streams else 0
        return dataclasses.replace(output, output_token_ids=tokens, new_token_ids=tokens[seen:])
