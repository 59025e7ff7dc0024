"""What a rank tells a monitor: its queues, its KV pool, and counters of its steps and votes.

`StepCounters` is updated by the engine's loop once per step; `rank_stats` takes a snapshot
from any thread. The snapshot is read without stopping the loop, so the queue lengths and the
free-block count may straddle a step; each number on its own is one the rank really had.
Counters only ever grow, which is what Prometheus counters need.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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
class RankExpertStats:
    """One rank's EPLB state (dist_engine/engine/eplb.py); plain values.

    balancedness: per MoE layer, mean / max tokens per rank over the window measured at the
    last decision, under the placement that served it (`moe.balancedness`); empty before the
    first decision. The group's load is summed at each decision, so every rank reports the
    same values, and the same counts.
    """

    balancedness: list[float] = field(default_factory=list)
    window_steps: int = 0  # forward steps that window held
    num_rebalances: int = 0  # placements adopted
    num_skipped: int = 0  # decisions whose proposal would not gain enough (`worth_adopting`)
    num_failed: int = 0  # proposals dropped because a rank's staging failed
    # The last adopted one: the step indices of its decision and commit, balancedness per
    # layer before and after on the window it was computed from, this rank's time staging
    # in the background and time its steps paused for it (computing the placement, and
    # writing the weights in at the commit; not the two small collectives, a SUM of the
    # [L, E] counts and a one-integer MIN), the expert weights it wrote into its slots, and
    # of those the bytes it staged (into spare buffers: the extra memory it held until the
    # commit), and of those the bytes peers sent it (the rest it read from the checkpoint or
    # copied from a slot of its own).
    last_decided_step: int | None = None
    last_adopted_step: int | None = None
    last_balancedness_before: list[float] = field(default_factory=list)
    last_balancedness_after: list[float] = field(default_factory=list)
    last_staging_s: float = 0.0
    last_pause_s: float = 0.0
    last_bytes: int = 0
    last_staged_bytes: int = 0
    last_received_bytes: int = 0
    # Where the experts new to a rank come from ("peer" or "checkpoint", the group's choice:
    # `moe.eplb_expert_source`), and the rates the group measured as it formed (bytes per
    # second of expert weights, the slowest rank's; 0 where not measured).
    expert_source: str = "checkpoint"
    peer_bytes_per_s: float = 0.0
    checkpoint_bytes_per_s: float = 0.0


# The fields of `RankExpertStats` that are one rank's own costs of the last rebalance; the
# others are the group's, alike on every rank (a replacement takes those from a kept rank).
RANK_OWN_EXPERT_FIELDS = (
    "last_staging_s",
    "last_pause_s",
    "last_bytes",
    "last_staged_bytes",
    "last_received_bytes",
)


def as_replacement(kept: RankExpertStats) -> RankExpertStats:
    """What a replacement that joins a re-formed group reports: a kept rank's EPLB stats (the
    group's, alike on every rank) without that rank's own costs of the last rebalance
    (`RANK_OWN_EXPERT_FIELDS`), which the replacement did not pay."""
    fresh = RankExpertStats()
    return replace(kept, **{name: getattr(fresh, name) for name in RANK_OWN_EXPERT_FIELDS})


@dataclass(frozen=True)
class ExpertStats:
    """The group's EPLB state (`LLM.expert_stats()`), from every rank's `RankExpertStats`.

    balancedness, the counts and the last rebalance's steps and balancedness are the group's
    (every rank has the same); its staging and pause times are the slowest rank's, its bytes
    the sum over ranks, `staged_bytes` the most any rank staged. `enabled` is False when the
    group runs without EPLB (then nothing is measured). The ranks' snapshots are taken
    without stopping their loops, so one taken during a commit may straddle it.
    """

    enabled: bool
    balancedness: list[float] = field(default_factory=list)
    num_rebalances: int = 0
    num_skipped: int = 0
    num_failed: int = 0
    last_rebalance_step: int | None = None
    last_balancedness_before: list[float] = field(default_factory=list)
    last_balancedness_after: list[float] = field(default_factory=list)
    last_rebalance_staging_s: float = 0.0
    last_rebalance_pause_s: float = 0.0
    last_rebalance_bytes: int = 0
    last_staged_bytes: int = 0
    last_received_bytes: int = 0  # sent by peers, summed over the ranks
    expert_source: str = "checkpoint"
    ranks: list[RankExpertStats] = field(default_factory=list)


def group_expert_stats(stats: list[RankStats]) -> ExpertStats:
    """The group's `ExpertStats` from its ranks' `RankStats` (ranks without EPLB stats, or a
    group without EPLB: `enabled=False`)."""
    ranks = [rank.experts for rank in sorted(stats, key=lambda r: r.dp_rank) if rank.experts]
    if not ranks:
        return ExpertStats(enabled=False)
    first = ranks[0]
    return ExpertStats(
        enabled=True,
        balancedness=list(first.balancedness),
        num_rebalances=first.num_rebalances,
        num_skipped=first.num_skipped,
        num_failed=first.num_failed,
        last_rebalance_step=first.last_adopted_step,
        last_balancedness_before=list(first.last_balancedness_before),
        last_balancedness_after=list(first.last_balancedness_after),
        last_rebalance_staging_s=max(rank.last_staging_s for rank in ranks),
        last_rebalance_pause_s=max(rank.last_pause_s for rank in ranks),
        last_rebalance_bytes=sum(rank.last_bytes for rank in ranks),
        last_staged_bytes=max(rank.last_staged_bytes for rank in ranks),
        last_received_bytes=sum(rank.last_received_bytes for rank in ranks),
        expert_source=first.expert_source,
        ranks=ranks,
    )


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
    num_prefill_tokens: int = 0  # prompt tokens computed (not those found cached or shared)
    # Without prefix caching: prompt tokens a sample of an `n` request took from a sibling,
    # computed once for all of them (scheduler/samples.py); with it, they are cache hits.
    num_shared_prompt_tokens: int = 0
    error: str | None = None  # why the rank's loop stopped, if it failed
    # Set by a client when the rank did not answer in time: these are its last stats, and it
    # has not answered for this many seconds.
    silent_s: float = 0.0
    experts: RankExpertStats | None = None  # EPLB's, when enabled
    # The longest prompt plus output this rank takes: scheduler.max_model_len as the group
    # resolved it (an unset one is the model's, capped by the pool; every rank agrees).
    max_model_len: int | None = None


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
        num_prefill_tokens=counters.num_prefill_tokens,
        num_shared_prompt_tokens=pool.num_shared_prompt_tokens,
        error=error,
        experts=engine.balancer.snapshot() if engine.balancer is not None else None,
        max_model_len=scheduler.config.max_model_len,
    )
