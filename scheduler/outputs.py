"""What ``Scheduler.schedule()`` hands to the model runner, and how sequences are reported.

Every sequence ends with exactly one report, through one of three doors:
- ``SchedulerOutputs.ignored_seqs``: ended by the scheduler itself (rejected at arrival, prompt
  too long, larger than the KV pool, preempted with ``stop_preempted_request``);
- the list ``Scheduler.process_outputs()`` returns: ended by a sampled token (stop, length);
- the sequence ``Scheduler.abort()`` returns: ended by the caller (abort, or failure).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler.sequence import Sequence
from scheduler.vote import AttemptPoint, GroupView


class StepKind(enum.Enum):
    """What the whole group does in a step; the same on every rank."""

    PREFILL = "prefill"  # prompt tokens (and, in a mixed step, decode tokens); normal dispatch
    DECODE = "decode"  # one token per running sequence; low-latency dispatch
    EMPTY = "empty"  # known-empty: the last vote proved no rank has a token, so no forward

    @property
    def code(self) -> int:
        """A small integer for collectives that compare step kinds across ranks."""
        return _KIND_CODES[self]


_KIND_CODES = {kind: code for code, kind in enumerate(StepKind)}


@dataclass
class SchedulerOutputs:
    is_prefill: bool  # a prefill step (prompt chunks, and in a mixed step decode tokens too)
    scheduled_seqs: list[Sequence]
    seqlens_q: list[int]  # same order as scheduled_seqs
    num_batched_tokens: int
    ignored_seqs: list[Sequence] = field(default_factory=list)
    step_index: int = 0
    decode_step: int = 0  # the counter this step was decided on
    point: AttemptPoint = AttemptPoint.NONE
    group: GroupView | None = None  # set when vote 1 was taken this step
    any_scheduled: bool | None = None  # vote 2, when taken
    # Every rank knows no rank has a token this step: nobody runs a forward.
    known_empty: bool = False
    # Mixed steps: the last this-many scheduled sequences of a prefill step are running
    # sequences taking their one decode token (seqlen_q 1); the ones before are prompt chunks.
    num_decode_seqs: int = 0

    @property
    def kind(self) -> StepKind:
        if self.known_empty:
            return StepKind.EMPTY
        return StepKind.PREFILL if self.is_prefill else StepKind.DECODE

    @property
    def prompt_run(self) -> bool:
        """The reference design's name for ``is_prefill`` (kept for the public surface)."""
        return self.is_prefill

    @property
    def is_placeholder(self) -> bool:
        """This rank has nothing to run but must still join the group's forward."""
        return not self.scheduled_seqs and not self.known_empty

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled_seqs)
