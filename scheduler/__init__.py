"""Per-rank scheduling for Lockstep: pure Python, no torch.distributed, no model."""

from scheduler.block_pool import AllocStatus, BlockPool
from scheduler.config import SchedulerConfig
from scheduler.outputs import SchedulerOutputs, StepKind
from scheduler.prefix_cache import PrefixCache
from scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.vote import (
    AttemptPoint,
    GroupView,
    InProcessVoteGroup,
    LocalState,
    LocalVote,
    Vote,
)

__all__ = [
    "AllocStatus",
    "AttemptPoint",
    "BlockPool",
    "GroupView",
    "InProcessVoteGroup",
    "LocalState",
    "LocalVote",
    "PrefixCache",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutputs",
    "Sequence",
    "SequenceStatus",
    "StepKind",
    "StructuredOutputsParams",
    "Vote",
]
