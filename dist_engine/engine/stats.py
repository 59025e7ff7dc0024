"""What a rank tells a monitor: its queues, its KV pool, and counters of its steps and votes.

`StepCounters` is updated by the engine's loop once per step; `rank_stats` takes a snapshot
from any thread. The snapshot is read without stopping the loop, so the queue lengths and the
free-block count may straddle a step; each number on its own is one the rank really had.
Counters only ever grow, which is what Prometheus counters need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler import AttemptPoint, StepKind

if TYPE_CHECKING:
    from dist_engine.engine.engine import DPEngine, StepTrace

# How a step is counted: a forward with tokens (prefill: prompt tokens only; mixed: prompt
# tokens and this rank's decode tokens; decode), a forward with none because the group steps
# and this rank has nothing (placeholder), or no forward at all because the last vote proved
# the whole group empty (known_empty).
STEP_COUNT_KINDS = ("prefill", "mixed", "decode", "placeholder", "known_empty")
VOTE_POINTS = tuple(point.value for point in AttemptPoint if point is not AttemptPoint.NONE)


class StepCounters:
    """Counts of a rank's steps by kind and of its votes by attempt point.

    Every key exists from the start, so a reader on another thread can copy the dicts while
    the loop increments them (a dict that never changes size can be copied concurrently).
    """

    def __init__(self) -> None:
        self.steps = dict.fromkeys(STEP_COUNT_KINDS, 0)
        self.votes = dict.fromkeys(VOTE_POINTS, 0)  # vote 1, by the point that called it
        self.num_second_votes = 0  # vote 2: did any rank assemble a prefill batch?
        self.num_prefill_tokens = 0  # prompt tokens computed (not those found in the cache)

    def record(self, trace: StepTrace) -> None:
        if trace.kind is StepKind.EMPTY:
            kind = "known_empty"
        elif trace.num_seqs == 0:
            kind = "placeholder"
        elif trace.num_decode_seqs:
            kind = "mixed"
        else:
            kind = trace.kind.value
        self.steps[kind] += 1
        if trace.kind is StepKind.PREFILL:
            # A mixed step's decode sequences take one token each; the rest are prompt chunks.
            self.num_prefill_tokens += trace.num_tokens - trace.num_decode_seqs
        if trace.group is not None:
            self.votes[trace.point.value] += 1
        if trace.any_scheduled is not None:
            self.num_second_votes += 1


@dataclass(frozen=True)
class RankStats:
    """One rank's state and counters; plain values, so it crosses Ray and pickling intact."""

    dp_rank: int
    num_running: int
    num_waiting: int
    num_free_blocks: int  # free plus evictable (cached, unheld) blocks
    num_usable_blocks: int  # the pool less the reserved block 0
    kv_usage: float  # fraction of usable blocks held by sequences
    num_steps: dict[str, int] = field(default_factory=dict)  # by STEP_COUNT_KINDS
    num_votes: dict[str, int] = field(default_factory=dict)  # vote 1 by VOTE_POINTS
    num_second_votes: int = 0
    num_preemptions: int = 0
    num_prefix_cache_hit_tokens: int = 0
    # Prompt tokens looked up in the prefix cache: those found there plus those computed
    # (0 without prefix caching, as vLLM counts).
    num_prefix_cache_query_tokens: int = 0
    error: str | None = None  # why the rank's loop stopped, if it failed
    # Set by a client when the rank did not answer in time: these are its last stats, and it
    # has not answered for this many seconds.
    silent_s: float = 0.0


def rank_stats(engine: DPEngine, error: str | None = None) -> RankStats:
    """A snapshot of ``engine``, safe to take from any thread."""
    scheduler = engine.scheduler
    # Copies first: the loop may replace or mutate these while we count.
    running = list(scheduler.running)
    num_running = sum(1 for seq in running if not seq.is_finished)
    pool = scheduler.pool_usage()
    counters = engine.step_counters
    caching = scheduler.config.enable_prefix_caching
    return RankStats(
        dp_rank=engine.rank,
        num_running=num_running,
        # Live requests that are not running: queued, or a prompt part-way through its chunks.
        num_waiting=max(0, scheduler.num_unfinished - num_running),
        num_free_blocks=pool.num_free_blocks,
        num_usable_blocks=pool.num_usable_blocks,
        kv_usage=pool.usage,
        num_steps=dict(counters.steps),
        num_votes=dict(counters.votes),
        num_second_votes=counters.num_second_votes,
        num_preemptions=scheduler.num_preemptions,
        num_prefix_cache_hit_tokens=pool.num_prefix_hit_tokens,
        num_prefix_cache_query_tokens=(
            pool.num_prefix_hit_tokens + counters.num_prefill_tokens if caching else 0
        ),
        error=error,
    )
