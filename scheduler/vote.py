"""The DP step vote: attempt points, the vote vector and the group decision.

Everything here is a pure function of allreduced values and of state every rank shares
(``decode_step``, the config, the previous vote), never of one rank's local state alone.
That is what keeps all ranks on the same step kind, and so inside matching all-to-alls.

Vote 1 is one MIN-allreduce of a small vector. "Any" and "max" travel through MIN as
complements, so one collective answers every question the step needs:

    index  sent                      MIN means
    0      want ? 1 : 0              1 -> every rank wants to prefill      (ALL)
    1      want ? 0 : 1              0 -> some rank wants to prefill       (ANY)
    2      running ? 0 : 1           1 -> no rank has running sequences
    3      work ? 0 : 1              1 -> no rank has any work (the group may sleep)
    4      -wake_epoch               -(highest wake epoch seen by any rank)
    5      shutdown ? 0 : 1          0 -> some rank asks the group to shut down
    6      -remaining                -(most tokens any running sequence may still produce)
    7      ready ? 1 : 0             1 -> every rank's head could start a prefill now
    8      ready ? -(wait + 1) : 0   -(longest wait of a ready head, + 1); 0 -> none ready
    9      backlog ? 0 : 1           0 -> some ready head was queued before the current run of
                                          prefill steps began (the FOLLOW point serves it)
    10     regroup ? 0 : 1           0 -> some rank asks the group to leave its process groups
                                          at this step and re-form (a planned re-form: a group
                                          that shrank grows back)

Entry 6 gives the group a *drain point*: if the group decodes from here, then after that many
decode steps no sequence running now can still be running, so the group votes again there
instead of running placeholder forwards until the next regular attempt point. An extra vote is
always safe; this only decides when to look.

Entries 7 to 9 serve the ``deadline`` policy (the others send "not ready"). A rank's head is
*ready* when the next prefill would start it: schedulable, under the watermark (or mid-chunk),
a free sequence slot, and its blocks and state slot free now. Its wait is counted in steps
since it joined the waiting queue, on the step counter every rank shares.

Vote 2 is ``[scheduled ? 0 : 1]``: whether any rank assembled a prefill batch.

The ``deadline`` policy, in short: vote after every prefill step, while the group is idle, and
otherwise only when the oldest ready head falls due (or, with none ready, every
``prefill_deadline_steps`` steps to look for new ones); prefill when a ready head has waited
``prefill_deadline_steps``, when every rank is ready, or when nobody decodes. So a head that
stays ready from step ``r`` on starts its prefill by step ``r + prefill_deadline_steps``, and
decoding is interrupted at most once per deadline by prompts that are not yet due. A deadline of
0 (a rank alone or a pair, by default) votes at every step and prefills as soon as a head is
ready.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Protocol

from scheduler.registry import Registry


class Vote(Protocol):
    def allreduce_min(self, values: list[int]) -> list[int]:
        """Element-wise minimum of ``values`` over every rank of the group."""
        ...


class LocalVote:
    """The vote of a group of one: no collective at all."""

    def allreduce_min(self, values: list[int]) -> list[int]:
        return list(values)


class AttemptPoint(enum.Enum):
    NONE = "none"  # a plain decode step: no vote
    ALL = "all"  # prefill only if every rank wants to
    ANY = "any"  # prefill if any rank wants to (the starvation guard)
    IDLE = "idle"  # the last vote saw no rank decoding: ANY at every step
    DRAIN = "drain"  # every sequence seen running at the last vote must have finished
    EVERY = "every"  # the every_step policy: ANY at every step
    FOLLOW = "follow"  # deadline policy: the step after a prefill step
    DUE = "due"  # deadline policy: a scheduled vote (a head falls due, or look for new ones)


def attempt_point(
    decode_step: int,
    all_interval: int,
    any_interval: int,
    *,
    group_idle: bool,
    every_step: bool,
    drain_step: int | None = None,
) -> AttemptPoint:
    if every_step:
        return AttemptPoint.EVERY
    if group_idle:
        return AttemptPoint.IDLE
    if decode_step != 0 and decode_step % any_interval == 0:
        return AttemptPoint.ANY  # where both points coincide, ANY wins
    if decode_step % all_interval == 0:
        return AttemptPoint.ALL
    if decode_step == drain_step:
        return AttemptPoint.DRAIN
    return AttemptPoint.NONE


@dataclass(frozen=True)
class LocalState:
    want: bool  # KV usage under the watermark and a schedulable head of waiting
    has_running: bool
    has_work: bool
    wake_epoch: int = 0
    shutdown: bool = False
    max_remaining_tokens: int = 0
    ready: bool = False  # the head could start a prefill now (deadline policy)
    ready_wait: int = -1  # decode steps the head has been ready for; -1 when not ready
    backlog: bool = False  # the ready head was queued before the current prefill steps began
    regroup: bool = False

    def encode(self) -> list[int]:
        return [
            int(self.want),
            int(not self.want),
            int(not self.has_running),
            int(not self.has_work),
            -self.wake_epoch,
            int(not self.shutdown),
            -self.max_remaining_tokens,
            int(self.ready),
            -(self.ready_wait + 1) if self.ready else 0,
            int(not self.backlog),
            int(not self.regroup),
        ]


@dataclass(frozen=True)
class GroupView:
    """What vote 1 told every rank about the whole group."""

    all_want: bool
    any_want: bool
    none_running: bool
    none_work: bool
    max_wake_epoch: int
    shutdown: bool
    max_remaining_tokens: int
    all_ready: bool = False
    max_ready_wait: int = -1  # the longest wait of any rank's ready head; -1 when none
    any_backlog: bool = False
    regroup: bool = False

    @classmethod
    def from_vector(cls, values: list[int]) -> GroupView:
        """The group's view from vote 1's reduced vector (see the table above)."""
        if len(values) != VOTE_VECTOR_LEN:
            raise ValueError(f"vote vector must have {VOTE_VECTOR_LEN} entries, got {values}")
        return cls(
            all_want=values[0] == 1,
            any_want=values[1] == 0,
            none_running=values[2] == 1,
            none_work=values[3] == 1,
            max_wake_epoch=-values[4],
            shutdown=values[5] == 0,
            max_remaining_tokens=-values[6],
            all_ready=values[7] == 1,
            max_ready_wait=-values[8] - 1,
            any_backlog=values[9] == 0,
            regroup=values[10] == 0,
        )


VOTE_VECTOR_LEN = len(LocalState(False, False, False).encode())


def group_prefills(point: AttemptPoint, view: GroupView) -> bool:
    """The step-kind decision at an attempt point.

    Where no rank is decoding there is no decode to protect, so any rank's wish suffices.
    """
    if point in (AttemptPoint.ALL, AttemptPoint.DRAIN) and not view.none_running:
        return view.all_want
    return view.any_want


def deadline_point(
    decode_step: int, *, group_idle: bool, next_vote: int, drain_step: int | None = None
) -> AttemptPoint:
    """The deadline policy's attempt point, from state every rank shares.

    ``decode_step`` 0 is the step after a prefill step (or the first step). ``next_vote`` is
    the decode step the last vote scheduled (``deadline_next_vote``).
    """
    if group_idle:
        return AttemptPoint.IDLE
    if decode_step == 0:
        return AttemptPoint.FOLLOW
    if decode_step == next_vote:
        return AttemptPoint.DUE
    if decode_step == drain_step:
        return AttemptPoint.DRAIN
    return AttemptPoint.NONE


def deadline_prefills(point: AttemptPoint, view: GroupView, deadline: int) -> bool:
    """The deadline policy's step-kind decision.

    With nobody decoding there is nothing to protect: any ready head suffices. Otherwise the
    group interrupts decoding for a head that has been ready for ``deadline`` decode steps,
    or when every rank has a head to start (a prefill step without placeholder ranks). Right
    after a prefill step, while decoding is interrupted anyway, it goes on as long as some
    rank still has a ready head that was queued before the prefill steps began: one burst of
    arrivals costs the decoding sequences one gap, not one per deadline.
    """
    if view.none_running:
        return view.max_ready_wait >= 0
    if view.max_ready_wait >= deadline or view.all_ready:
        return True
    return point is AttemptPoint.FOLLOW and view.any_backlog


def deadline_next_vote(decided_on: int, view: GroupView, deadline: int) -> int:
    """After the group decoded on a vote taken at ``decided_on``: the decode step of the next.

    The oldest ready head falls due ``deadline - wait`` steps on; a head that is not ready
    yet, or arrives later, is seen at a vote at most ``deadline`` steps on (the next step
    where the deadline is 0). A head that is already due here was not admitted by any rank
    after all (vote 2 found no batch): look again next step.
    """
    return decided_on + max(1, deadline - max(view.max_ready_wait, 0))


@dataclass(frozen=True)
class PolicyState:
    """The step-policy state every rank shares, as a policy reads it."""

    decode_step: int
    group_idle: bool
    drain_step: int | None
    next_vote: int  # deadline policy: the decode step of the next scheduled vote
    all_interval: int  # prefill_attempt_interval
    any_interval: int  # prefill_any_attempt_interval
    deadline: int  # prefill_deadline_steps


class ReferencePolicy:
    """`vote`: the reference article's ALL/ANY attempt points (and `every_step`: ANY at every
    step, as vLLM and SGLang sync)."""

    tracks_readiness = False

    def __init__(self, every_step: bool = False) -> None:
        self.every_step = every_step

    def point(self, state: PolicyState) -> AttemptPoint:
        return attempt_point(
            state.decode_step,
            state.all_interval,
            state.any_interval,
            group_idle=state.group_idle,
            every_step=self.every_step,
            drain_step=state.drain_step,
        )

    def prefills(self, point: AttemptPoint, view: GroupView, state: PolicyState) -> bool:
        return group_prefills(point, view)

    def next_vote(self, decided_on: int, view: GroupView, state: PolicyState) -> int:
        return state.next_vote  # votes fall on the fixed intervals


class DeadlinePolicy:
    """`deadline`: vote when a ready head falls due; no ready head waits past the deadline."""

    tracks_readiness = True

    def point(self, state: PolicyState) -> AttemptPoint:
        return deadline_point(
            state.decode_step,
            group_idle=state.group_idle,
            next_vote=state.next_vote,
            drain_step=state.drain_step,
        )

    def prefills(self, point: AttemptPoint, view: GroupView, state: PolicyState) -> bool:
        return deadline_prefills(point, view, state.deadline)

    def next_vote(self, decided_on: int, view: GroupView, state: PolicyState) -> int:
        return deadline_next_vote(decided_on, view, state.deadline)


# sync_policy -> when the group votes and what it decides there.
SYNC_POLICIES: Registry[ReferencePolicy | DeadlinePolicy] = Registry(
    "sync_policy",
    {
        "vote": ReferencePolicy(),
        "every_step": ReferencePolicy(every_step=True),
        "deadline": DeadlinePolicy(),
    },
)


class InProcessVoteGroup:
    """A MIN vote among threads of one process: the vote of simulations and protocol tests.

    ``member(rank)`` returns that rank's ``Vote``. A rank that stops voting breaks the barrier
    for the others after ``timeout_s``, so a protocol bug shows up as an error, not a hang.
    """

    def __init__(self, num_ranks: int, timeout_s: float = 30.0) -> None:
        self.num_ranks = num_ranks
        self.timeout_s = timeout_s
        self._values: list[list[int] | None] = [None] * num_ranks
        self._result: list[int] = []
        self._barrier = threading.Barrier(num_ranks, action=self._reduce)
        # A second barrier keeps a fast rank from overwriting its slot before every rank has
        # read the previous result.
        self._barrier_after = threading.Barrier(num_ranks)
        self.num_collectives = 0

    def _reduce(self) -> None:
        rows = [row or [] for row in self._values]
        if len({len(row) for row in rows}) != 1:
            self._result = []  # mismatched calls: every rank raises below
        else:
            self._result = [min(column) for column in zip(*rows, strict=True)]
        self._values = [None] * self.num_ranks
        self.num_collectives += 1

    def member(self, rank: int) -> Vote:
        group = self

        class _Member:
            def allreduce_min(self, values: list[int]) -> list[int]:
                group._values[rank] = list(values)
                try:
                    group._barrier.wait(group.timeout_s)
                    result = list(group._result)
                    group._barrier_after.wait(group.timeout_s)
                except threading.BrokenBarrierError as exc:
                    raise RuntimeError(f"rank {rank}: in-process vote broken or timed out") from exc
                if len(result) != len(values):
                    raise RuntimeError(f"rank {rank}: ranks voted with vectors of different length")
                return result

        return _Member()

    def abort(self) -> None:
        self._barrier.abort()
        self._barrier_after.abort()
