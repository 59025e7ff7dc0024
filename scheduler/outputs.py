"""What ``Scheduler.schedule()`` hands to the model runner, and how sequences are reported.

Every sequence ends with exactly one report, through one of three doors:
- ``SchedulerOutputs.ignored_seqs``: ended by the scheduler itself (rejected at arrival, prompt
  too long, larger than the KV pool, preempted with ``stop_preempted_request``);
- the list ``Scheduler.process_outputs()`` returns: ended by a sampled token (stop, length);
- the sequence ``Scheduler.abort()`` returns: ended by the caller (abort, or failure).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sequence import Sequence
from scheduler.vote import AttemptPoint, GroupView


@dataclass
class SchedulerOutputs:
    prompt_run: bool
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

    @property
    def is_placeholder(self) -> bool:
        """This rank has nothing to run but must still join the group's forward."""
        return not self.scheduled_seqs and not self.known_empty

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled_seqs)
