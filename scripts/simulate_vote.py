"""Simulate the DP step vote at sizes this machine cannot run (N = 8 … 256 ranks).

What is real and what is modelled
---------------------------------
Real: N ``scheduler.Scheduler`` objects, one per DP rank, each with its own queues and KV block
pool, coupled by a MIN vote exactly as the engine couples them. Their ``schedule()`` takes the
votes, picks the step kind and assembles the batch; ``process_outputs()`` does the accounting
(prompt chunks, stop rules, releases). The sync policy under test is the scheduler's own
(``vote`` with ALL/ANY intervals, ``every_step``, or ``deadline``), the latter two with prompt
steps that carry prompts only (``+separate``) or mixed steps (``+mixed``: a prefill step also
decodes every running sequence; ``mixed_prompt_tokens`` caps its chunks).

Modelled: the model and the network. No forward runs; every scheduled sequence gets a
deterministic token that is never a stop token, so every request ends by ``max_tokens``. Time is
simulated, per group step (every rank takes the same step, so the slowest rank sets the pace):

    prefill step     a + b * (most prompt tokens any rank batched)           [ms]
    decode step      c + d * (most sequences any rank decodes)               [ms]
    mixed step       c + max over ranks of (d * decode tokens + b * max(0, prompt tokens - k))
    known-empty      v                  (no forward: the step only votes)    [ms]
    plus, on every step, each vote collective taken:  v * log2(N)            [ms]

A mixed step is a decode step plus its prompt tokens at the prompt rate, less ``k`` tokens that
ride free: the slack of a memory-bound decode step, whose weights are read once however many
tokens use them. ``k`` = 0 (the default) is the pessimistic reading, where no token rides free.
Defaults (a=5, b=0.02, c=8, d=0.02, v=0.05, k=0) are plausible for one GPU per rank and a
small-vector allreduce over a tree/ring; every parameter is a CLI flag. A request arrives at a
simulated time; it joins its rank's queue at the first step that starts at or after that time.
Where the vote shows that no rank has any work, the group sleeps and the clock jumps to the next
arrival (the engine's idle/wake; waking is modelled as free).

The lock-step driver (and why)
------------------------------
``schedule()`` may call ``allreduce_min`` twice per step (vote 1, then vote 2 after a prefill
decision), so a rank must be suspended inside a vote until every rank has voted. Python has no
stackful coroutines without a third-party package, so each rank owns a thread and the driver
hands control to exactly one thread at a time (ping-pong on two raw locks): deterministic, no
GIL contention, and a rank that never parks is reported after a timeout instead of hanging.
Measured per rank-step at N=256 on this 2-core box (4 decoding sequences per rank):
``InProcessVoteGroup`` (free-running threads, two barriers per vote) ~100 µs under ``vote`` and
~180 µs under ``every_step``; the hand-off on every step ~35-90 / 70-140 µs; a direct call on
the main thread ~5 µs. Most ``vote`` steps take no collective, so the driver first computes, from
the step-policy state that is identical on every rank (``Scheduler.policy_state()`` and the
config, through ``Scheduler.next_point()``), whether this step is an attempt point. If not, it
calls every ``schedule()`` directly on the main thread, where a vote is a protocol error and
raises; if so, the ranks run on their threads. ``every_step`` therefore costs ~10x more wall time
per step than ``vote`` here, which is what bounds the default run.

Protocol checks made on every step (a failure raises ``LockstepError``): the shared step-policy
state is equal on all ranks; all ranks take the same number of collectives with vectors of the
same length; all ranks agree on the step kind (is_prefill / known_empty / decode), the attempt
point and the decode counter; the predicted and the actual vote-taking agree.

Limits, honestly
----------------
- Step costs are a linear stand-in; real MoE steps depend on expert load, all-to-all volume and
  attention context lengths, none of which is modelled. Placeholder forwards cost the same as the
  slowest rank's work, which is the point of lock-step, but their own cost is not modelled.
- Prefill and decode share a step only in mixed steps; there is no CPU/GPU overlap, no
  speculative decoding and no request routing (a request's rank is fixed by the workload, which
  is how skew is expressed).
- One step's host-side scheduling time is assumed hidden; at N=256 it is not on this machine,
  which is why wall time is reported separately from simulated time.
- The arrival process is open-loop and finite; throughput is output tokens over the span from
  the first arrival to the last token, so it includes idle gaps of the bursty workload.

Usage::

    .venv/bin/python scripts/simulate_vote.py [--quick] [--out bench_results/simulate_vote.json]
        [--plot bench_results/simulate_vote.png] [--deadline-steps D]
"""

from __future__ import annotations

import _thread
import argparse
import json
import math
import platform
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from scheduler import (
    AttemptPoint,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutputs,
    Sequence,
)
from scheduler.config import MIXED_PROMPT_TOKENS_GROUP, POLICY_VARIANTS, policy_variant

WORKLOADS = ("uniform", "skewed", "bursty")
POLICIES = POLICY_VARIANTS
DEFAULT_RANKS = (8, 16, 32, 64, 128, 256)
QUICK_RANKS = (8, 16, 32)


class LockstepError(RuntimeError):
    """The ranks left lock-step: a protocol violation the real engine would hang on."""


# -- cost model ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CostModel:
    a: float = 5.0  # prefill step fixed cost, ms
    b: float = 0.02  # prefill cost per token of the largest rank batch, ms
    c: float = 8.0  # decode step fixed cost, ms
    d: float = 0.02  # decode cost per sequence of the largest rank batch, ms
    v: float = 0.05  # vote: one step's host cost, and per log2(N) hop of a collective, ms
    k: float = 0.0  # prompt tokens a mixed step carries at no cost (decode's memory-bound slack)

    def step_ms(self, kind: str, outputs: list[SchedulerOutputs], collectives: int) -> float:
        hops = math.log2(len(outputs)) if len(outputs) > 1 else 0.0
        votes = collectives * self.v * hops
        if kind == "prefill" and any(o.num_decode_seqs for o in outputs):
            work = max(
                self.d * o.num_decode_seqs
                + self.b * max(0.0, o.num_batched_tokens - o.num_decode_seqs - self.k)
                for o in outputs
            )
            return self.c + work + votes
        if kind == "prefill":
            return self.a + self.b * max(o.num_batched_tokens for o in outputs) + votes
        if kind == "decode":
            return self.c + self.d * max(o.num_seqs for o in outputs) + votes
        return self.v + votes


# -- workloads -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    request_id: str
    rank: int
    arrival_ms: float
    prompt_len: int
    max_tokens: int


@dataclass(frozen=True)
class WorkloadSpec:
    requests_per_rank: int = 16
    duration_ms: float = 4000.0
    prompt_len: tuple[int, int] = (32, 1024)
    max_tokens: tuple[int, int] = (16, 256)
    zipf_s: float = 0.6  # skewed: rank k gets weight (k + 1) ** -zipf_s
    bursts: int = 6  # bursty: number of bursts over the duration
    burst_rank_frac: float = 0.25  # bursty: share of ranks one burst lands on
    burst_ms: float = 50.0  # bursty: a burst's requests arrive within this window
    seed: int = 0


def make_workload(kind: str, num_ranks: int, spec: WorkloadSpec) -> list[Request]:
    """Seeded requests, sorted by arrival; the same (kind, N, spec) gives the same list."""
    rng = np.random.default_rng([spec.seed, num_ranks, WORKLOADS.index(kind)])
    count = spec.requests_per_rank * num_ranks  # constant load per rank as N grows
    if kind == "uniform":
        ranks = rng.integers(0, num_ranks, count)
        arrivals = rng.uniform(0.0, spec.duration_ms, count)
    elif kind == "skewed":
        weights = np.arange(1, num_ranks + 1, dtype=float) ** -spec.zipf_s
        ranks = rng.choice(num_ranks, count, p=weights / weights.sum())
        arrivals = rng.uniform(0.0, spec.duration_ms, count)
    elif kind == "bursty":
        ranks, arrivals = _bursts(rng, num_ranks, count, spec)
    else:
        raise ValueError(f"unknown workload {kind!r}; known: {WORKLOADS}")
    prompts = rng.integers(spec.prompt_len[0], spec.prompt_len[1] + 1, count)
    outputs = rng.integers(spec.max_tokens[0], spec.max_tokens[1] + 1, count)
    order = np.argsort(arrivals, kind="stable")
    return [
        Request(f"r{i}", int(ranks[i]), float(arrivals[i]), int(prompts[i]), int(outputs[i]))
        for i in order
    ]


def _bursts(
    rng: np.random.Generator, num_ranks: int, count: int, spec: WorkloadSpec
) -> tuple[np.ndarray, np.ndarray]:
    """Bursts at Poisson times (exponential gaps, so some gaps are long idle stretches), each
    landing on its own random subset of ranks."""
    starts = np.cumsum(rng.exponential(spec.duration_ms / spec.bursts, spec.bursts))
    sizes = rng.multinomial(count, [1.0 / spec.bursts] * spec.bursts)
    width = max(1, round(num_ranks * spec.burst_rank_frac))
    ranks, arrivals = [], []
    for start, size in zip(starts, sizes, strict=True):
        targets = rng.choice(num_ranks, width, replace=False)
        ranks.append(rng.choice(targets, size))
        arrivals.append(start + rng.uniform(0.0, spec.burst_ms, size))
    return np.concatenate(ranks), np.concatenate(arrivals)


# -- the lock-step driver --------------------------------------------------------------------
def _locked() -> _thread.LockType:
    lock = _thread.allocate_lock()
    lock.acquire()
    return lock


@dataclass(frozen=True)
class _Event:
    """What a rank thread posts when it parks: a vote, its finished step, or an error."""

    kind: str  # "vote" | "done" | "error"
    values: list[int] | None = None
    outputs: SchedulerOutputs | None = None
    error: Exception | None = None


class _Stop(BaseException):
    """Unwinds a rank thread parked inside a vote when the driver closes."""


class _Rank:
    """One rank: its scheduler, and the thread its ``schedule()`` runs on at vote steps.

    It is also the rank's ``Vote``: ``allreduce_min`` posts the values to the driver and parks
    until the driver hands back the group minimum.
    """

    def __init__(
        self, rank: int, config: SchedulerConfig, back: _thread.LockType, timeout_s: float
    ) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.sched = Scheduler(config, vote=self)
        self._back = back  # released by whichever rank thread just posted
        self._go = _locked()
        self._event = _Event("none")
        self._result: list[int] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=f"rank{rank}", daemon=True)
        self._thread.start()

    def allreduce_min(self, values: list[int]) -> list[int]:
        if threading.current_thread() is not self._thread:
            raise LockstepError(
                f"rank {self.rank} voted at step {self.sched.step_index}, which the shared "
                "step-policy state marks as a plain decode step"
            )
        self._post(_Event("vote", values=list(values)))
        self._go.acquire()
        if self._stopping:
            raise _Stop
        return list(self._result)

    def resume(self, result: list[int] | None = None) -> _Event:
        """Run this rank until it votes or finishes its ``schedule()``; returns what it posted."""
        if result is not None:
            self._result = result
        self._go.release()
        if not self._back.acquire(timeout=self.timeout_s):
            raise LockstepError(f"rank {self.rank} did not reach a vote or the step's end")
        return self._event

    def stop(self) -> None:
        self._stopping = True
        self._go.release()
        self._thread.join(5.0)

    def _post(self, event: _Event) -> None:
        self._event = event
        self._back.release()

    def _serve(self) -> None:
        while True:
            self._go.acquire()
            if self._stopping:
                return
            try:
                event = _Event("done", outputs=self.sched.schedule())
            except _Stop:
                return
            except Exception as exc:  # handed to the driver, which raises it
                event = _Event("error", error=exc)
            self._post(event)


class LockstepDriver:
    """Steps N schedulers in lock-step; one thread runs at a time, so runs are deterministic."""

    def __init__(self, num_ranks: int, config: SchedulerConfig, timeout_s: float = 60.0) -> None:
        self.config = config
        self._back = _locked()
        self.ranks = [_Rank(r, config, self._back, timeout_s) for r in range(num_ranks)]

    def __enter__(self) -> LockstepDriver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for rank in self.ranks:
            rank.stop()

    def step(self) -> tuple[list[SchedulerOutputs], int]:
        """One ``schedule()`` on every rank; returns the outputs and the collectives taken."""
        if not self._is_attempt_point():
            return [rank.sched.schedule() for rank in self.ranks], 0
        events = [rank.resume() for rank in self.ranks]
        collectives = 0
        while events[0].kind == "vote":
            result = self._reduce(events)
            collectives += 1
            events = [rank.resume(result) for rank in self.ranks]
        self._check_done(events)
        if collectives == 0:
            step = self.ranks[0].sched.step_index - 1
            raise LockstepError(f"step {step}: predicted an attempt point but no rank voted")
        return [event.outputs for event in events if event.outputs is not None], collectives

    def _is_attempt_point(self) -> bool:
        """Whether this step is an attempt point, from state every rank must share."""
        states = {r.sched.policy_state() for r in self.ranks}
        if len(states) != 1:
            # Scheduler.policy_state() per distinct view
            raise LockstepError(
                f"ranks hold different step-policy state: {sorted(map(str, states))}"
            )
        return self.ranks[0].sched.next_point() is not AttemptPoint.NONE

    def _reduce(self, events: list[_Event]) -> list[int]:
        _raise_errors(events)
        rows = [event.values for event in events if event.values is not None]
        if len(rows) != len(events) or len({len(row) for row in rows}) != 1:
            raise LockstepError(f"ranks disagree on the collective: {_describe(events)}")
        return [min(column) for column in zip(*rows, strict=True)]

    @staticmethod
    def _check_done(events: list[_Event]) -> None:
        _raise_errors(events)
        if any(event.kind != "done" for event in events):
            raise LockstepError(
                f"some ranks voted while others ended the step: {_describe(events)}"
            )


def _raise_errors(events: list[_Event]) -> None:
    for event in events:
        if event.error is not None:
            raise event.error


def _describe(events: list[_Event]) -> str:
    """The first ranks' views of a mismatched collective, for the error message."""
    views = [f"{e.kind}{e.values}" if e.values is not None else e.kind for e in events]
    shown = ", ".join(f"rank {r}: {view}" for r, view in enumerate(views[:8]))
    return shown + (" …" if len(views) > 8 else "")


def step_kind(outputs: list[SchedulerOutputs]) -> str:
    """The group's step kind; raises if any rank took another kind, point or counter."""
    views = {(o.is_prefill, o.known_empty, o.point, o.decode_step) for o in outputs}
    if len(views) != 1:
        raise LockstepError(
            f"step {outputs[0].step_index}: ranks disagree: {sorted(map(str, views))}"
        )
    is_prefill, known_empty, _, _ = views.pop()
    return "prefill" if is_prefill else "empty" if known_empty else "decode"


# -- the simulation --------------------------------------------------------------------------
@dataclass
class _Track:
    """Simulated timing of one request."""

    arrival_ms: float
    intake_step: int
    first_ms: float | None = None
    first_step: int | None = None
    last_ms: float = 0.0
    prefills_seen: int = 0  # the group's prefill steps up to this request's last token


@dataclass
class RunResult:
    num_ranks: int
    workload: str
    policy: str
    metrics: dict[str, float] = field(default_factory=dict)
    finish_counts: Counter[str] = field(default_factory=Counter)  # request id -> reports
    ttft_ms: list[float] = field(default_factory=list)
    steps_checked: int = 0  # steps on which every protocol check passed


@dataclass
class _Stats:
    steps: int = 0
    forward_steps: int = 0
    prefill_steps: int = 0
    prefills_at: Counter[str] = field(default_factory=Counter)  # attempt point -> prefills
    placeholder_rank_steps: int = 0
    idle_rank_steps: int = 0
    collectives: int = 0
    output_tokens: int = 0
    itl_ms: list[float] = field(default_factory=list)
    itl_interrupted: int = 0  # gaps between two tokens that contain a prefill step


def sample_token(seq: Sequence) -> int:
    """A deterministic token that is never a stop token (none are set): ends by max_tokens."""
    return 1 + (len(seq.token_ids) * 7919) % 30_000


def simulate(
    num_ranks: int,
    workload: str,
    policy: str,
    requests: list[Request],
    config: SchedulerConfig,
    cost: CostModel,
    max_steps: int = 1_000_000,
) -> RunResult:
    config = policy_variant(config, policy).for_group(num_ranks)  # as the engine resolves it
    result = RunResult(num_ranks, workload, policy)
    stats, tracks = _Stats(), {}
    now, next_arrival = 0.0, 0
    started = time.perf_counter()
    with LockstepDriver(num_ranks, config) as driver:
        while len(result.finish_counts) < len(requests) or next_arrival < len(requests):
            if stats.steps >= max_steps:
                raise RuntimeError(f"{workload}/{policy}/N={num_ranks}: over {max_steps} steps")
            next_arrival = _intake(driver, requests, next_arrival, now, stats.steps, tracks)
            outputs, collectives = driver.step()
            kind = step_kind(outputs)
            now += cost.step_ms(kind, outputs, collectives)
            _account(driver, outputs, kind, collectives, now, stats, tracks, result)
            result.steps_checked += 1
            if kind == "empty" and outputs[0].group is not None and outputs[0].group.none_work:
                now = _sleep_until_arrival(requests, next_arrival, now, result)
    result.metrics = _metrics(stats, tracks, requests, now, num_ranks)
    result.metrics["wall_s"] = time.perf_counter() - started
    result.metrics["deadline_steps"] = config.deadline_steps  # as resolved for N ranks
    result.ttft_ms = [t.first_ms - t.arrival_ms for t in tracks.values() if t.first_ms is not None]
    return result


def _intake(
    driver: LockstepDriver,
    requests: list[Request],
    index: int,
    now: float,
    step: int,
    tracks: dict[str, _Track],
) -> int:
    while index < len(requests) and requests[index].arrival_ms <= now:
        req = requests[index]
        prompt = [1 + index % 30_000] * req.prompt_len  # content is irrelevant: no prefix cache
        seq = Sequence(req.request_id, prompt, SamplingParams(max_tokens=req.max_tokens))
        driver.ranks[req.rank].sched.add_sequence(seq)
        tracks[req.request_id] = _Track(req.arrival_ms, step)
        index += 1
    return index


def _sleep_until_arrival(
    requests: list[Request], next_arrival: int, now: float, result: RunResult
) -> float:
    """The group saw no work anywhere: it sleeps, and the next arrival wakes it."""
    if next_arrival < len(requests):
        return max(now, requests[next_arrival].arrival_ms)
    if len(result.finish_counts) < len(requests):
        raise LockstepError("the group went to sleep with unfinished requests and no arrivals")
    return now


def _account(
    driver: LockstepDriver,
    outputs: list[SchedulerOutputs],
    kind: str,
    collectives: int,
    now: float,
    stats: _Stats,
    tracks: dict[str, _Track],
    result: RunResult,
) -> None:
    stats.steps += 1
    stats.collectives += collectives
    if kind != "empty":
        stats.forward_steps += 1
        if kind == "prefill":
            stats.prefill_steps += 1
            stats.prefills_at[outputs[0].point.value] += 1
    for rank, out in zip(driver.ranks, outputs, strict=True):
        if out.is_placeholder:
            stats.placeholder_rank_steps += 1
            stats.idle_rank_steps += rank.sched.num_unfinished == 0
        seqs = out.scheduled_seqs
        before = [seq.num_output_tokens for seq in seqs]
        finished = rank.sched.process_outputs(out, [sample_token(seq) for seq in seqs])
        for seq, count in zip(seqs, before, strict=True):
            if seq.num_output_tokens > count:
                _record_token(tracks[seq.request_id], now, stats)
        for seq in [*finished, *out.ignored_seqs]:
            result.finish_counts[seq.request_id] += 1


def _record_token(track: _Track, now: float, stats: _Stats) -> None:
    stats.output_tokens += 1
    if track.first_ms is None:
        track.first_ms = now
        track.first_step = stats.steps - 1
    else:
        stats.itl_ms.append(now - track.last_ms)
        stats.itl_interrupted += stats.prefill_steps > track.prefills_seen
    track.last_ms = now
    track.prefills_seen = stats.prefill_steps


def _metrics(
    stats: _Stats, tracks: dict[str, _Track], requests: list[Request], now: float, num_ranks: int
) -> dict[str, float]:
    started = [t for t in tracks.values() if t.first_ms is not None]
    ttft_ms = np.array([t.first_ms - t.arrival_ms for t in started])
    # The step that produced the first token counts: a request admitted at once waited 1 step.
    ttft_steps = np.array([t.first_step - t.intake_step + 1 for t in started])
    span_s = max(now - requests[0].arrival_ms, 1e-9) / 1000.0
    forward_rank_steps = max(stats.forward_steps * num_ranks, 1)
    metrics = {
        "num_requests": len(requests),
        "steps": stats.steps,
        "forward_steps": stats.forward_steps,
        "prefill_steps": stats.prefill_steps,
        "placeholder_frac": stats.placeholder_rank_steps / forward_rank_steps,
        "idle_rank_frac": stats.idle_rank_steps / forward_rank_steps,
        "collectives_per_step": stats.collectives / max(stats.steps, 1),
        "output_tokens": stats.output_tokens,
        "sim_s": now / 1000.0,
        "throughput_tok_s": stats.output_tokens / span_s,
    }
    for point in AttemptPoint:
        if point is not AttemptPoint.NONE:
            metrics[f"prefills_at_{point.value}"] = stats.prefills_at[point.value]
    for q in (50, 90, 99):
        metrics[f"ttft_ms_p{q}"] = _pct(ttft_ms, q)
        metrics[f"ttft_steps_p{q}"] = _pct(ttft_steps, q)
    for q in (50, 99):
        metrics[f"itl_ms_p{q}"] = _pct(np.array(stats.itl_ms), q)
    # ITL p99 stays at a decode step's length only while under 1% of the gaps between two
    # tokens contain a prefill step; the longest gap shows stalls that p99 hides.
    metrics["itl_interrupted_frac"] = stats.itl_interrupted / max(len(stats.itl_ms), 1)
    metrics["itl_ms_max"] = float(max(stats.itl_ms, default=float("nan")))
    return metrics


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


# -- report ----------------------------------------------------------------------------------
# (header, metric key, width, format: "s" text, "d" integer, a digit = decimals)
_COLUMNS = (
    ("N", "num_ranks", 4, "d"),
    ("workload", "workload", 8, "s"),
    ("policy", "policy", 10, "s"),
    ("steps", "steps", 6, "d"),
    ("plchold", "placeholder_frac", 7, "3"),
    ("idle", "idle_rank_frac", 6, "3"),
    ("coll/st", "collectives_per_step", 7, "3"),
    ("ttft50ms", "ttft_ms_p50", 8, "0"),
    ("ttft90ms", "ttft_ms_p90", 8, "0"),
    ("ttft99ms", "ttft_ms_p99", 8, "0"),
    ("st50", "ttft_steps_p50", 5, "0"),
    ("st90", "ttft_steps_p90", 5, "0"),
    ("st99", "ttft_steps_p99", 5, "0"),
    ("itl50", "itl_ms_p50", 6, "1"),
    ("itl99", "itl_ms_p99", 6, "1"),
    ("itl_max", "itl_ms_max", 7, "0"),
    ("intr", "itl_interrupted_frac", 5, "3"),
    ("tok/s", "throughput_tok_s", 8, "0"),
    ("wall_s", "wall_s", 6, "1"),
)


def _cell(value: float | str, width: int, fmt: str) -> str:
    if fmt == "s":
        return f"{value:<{width}}"
    if fmt == "d":
        return f"{int(value):>{width}d}"
    return f"{value:>{width}.{fmt}f}"


def format_table(results: list[RunResult]) -> str:
    header = " ".join(
        name.ljust(width) if fmt == "s" else name.rjust(width) for name, _, width, fmt in _COLUMNS
    )
    lines = [header, "-" * len(header)]
    for res in results:
        row = {"num_ranks": res.num_ranks, "workload": res.workload, "policy": res.policy}
        row.update(res.metrics)
        lines.append(" ".join(_cell(row[key], width, fmt) for _, key, width, fmt in _COLUMNS))
    return "\n".join(lines)


_MD_COLUMNS = (
    ("N", lambda m: f"{m['num_ranks']}"),
    ("workload", lambda m: m["workload"]),
    ("policy", lambda m: m["policy"]),
    ("D", lambda m: f"{m['deadline_steps']}" if m["policy"].startswith("deadline") else "-"),
    ("placeholder", lambda m: f"{m['placeholder_frac']:.3f}"),
    ("idle ranks", lambda m: f"{m['idle_rank_frac']:.3f}"),
    ("votes/step", lambda m: f"{m['collectives_per_step']:.2f}"),
    ("TTFT p50 / p99 ms", lambda m: f"{m['ttft_ms_p50']:,.0f} / {m['ttft_ms_p99']:,.0f}"),
    ("TTFT p99 steps", lambda m: f"{m['ttft_steps_p99']:.0f}"),
    ("ITL p99 ms", lambda m: f"{m['itl_ms_p99']:.1f}"),
    ("ITL max ms", lambda m: f"{m['itl_ms_max']:,.0f}"),
    ("gaps with a prefill", lambda m: f"{m['itl_interrupted_frac']:.1%}"),
    ("tok/s", lambda m: f"{m['throughput_tok_s']:,.0f}"),
)


def _row(result: RunResult) -> dict[str, object]:
    return {
        "num_ranks": result.num_ranks,
        "workload": result.workload,
        "policy": result.policy,
        **result.metrics,
    }


def markdown_table(results: list[RunResult]) -> str:
    lines = [
        "| " + " | ".join(name for name, _ in _MD_COLUMNS) + " |",
        "| " + " | ".join("---" if i in (1, 2) else "---:" for i in range(len(_MD_COLUMNS))) + " |",
    ]
    for res in results:
        row = _row(res)
        lines.append("| " + " | ".join(cell(row) for _, cell in _MD_COLUMNS) + " |")
    return "\n".join(lines)


# The goals the deadline policy was built against (issue 16), per workload and N.
GOAL_TTFT_VS_EVERY_STEP = 1.25  # TTFT p99 at most this times every_step's
GOAL_ITL_VS_VOTE = 1.1  # ITL p99 at most this times vote's


def goal_check(results: list[RunResult], policy: str = "deadline+mixed") -> list[dict[str, object]]:
    """``policy`` against vote and every_step with prefill-only steps (the goals' terms), per
    (workload, N) where all three ran."""
    cells = {(r.workload, r.num_ranks, r.policy): r.metrics for r in results}
    checks = []
    for workload, num_ranks in dict.fromkeys((r.workload, r.num_ranks) for r in results):
        try:
            new, vote, every = (
                cells[(workload, num_ranks, p)] for p in (policy, "vote", "every_step+separate")
            )
        except KeyError:
            continue
        best_tok = max(vote["throughput_tok_s"], every["throughput_tok_s"])
        best_placeholder = min(vote["placeholder_frac"], every["placeholder_frac"])
        ttft = new["ttft_ms_p99"] / every["ttft_ms_p99"]
        itl = new["itl_ms_p99"] / vote["itl_ms_p99"]
        checks.append(
            {
                "policy": policy,
                "workload": workload,
                "num_ranks": num_ranks,
                "ttft_p99_vs_every_step": ttft,
                "ttft_met": ttft <= GOAL_TTFT_VS_EVERY_STEP,
                "itl_p99_vs_vote": itl,
                "itl_met": itl <= GOAL_ITL_VS_VOTE,
                "throughput_vs_best": new["throughput_tok_s"] / best_tok,
                "throughput_met": new["throughput_tok_s"] >= best_tok,
                "placeholder_vs_best": new["placeholder_frac"] - best_placeholder,
                "placeholder_met": new["placeholder_frac"] <= best_placeholder,
            }
        )
    return checks


def goals_markdown(checks: list[dict[str, object]]) -> str:
    def mark(met: object) -> str:
        return "met" if met else "**missed**"

    lines = [
        f"| N | workload | TTFT p99 / every_step's (goal <= {GOAL_TTFT_VS_EVERY_STEP}) "
        f"| ITL p99 / vote's (goal <= {GOAL_ITL_VS_VOTE}) | tok/s / the better's (goal >= 1) "
        "| placeholder - the better's (goal <= 0) |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for c in checks:
        lines.append(
            f"| {c['num_ranks']} | {c['workload']} "
            f"| {c['ttft_p99_vs_every_step']:.2f} {mark(c['ttft_met'])} "
            f"| {c['itl_p99_vs_vote']:.2f} {mark(c['itl_met'])} "
            f"| {c['throughput_vs_best']:.3f} {mark(c['throughput_met'])} "
            f"| {c['placeholder_vs_best']:+.3f} {mark(c['placeholder_met'])} |"
        )
    return "\n".join(lines)


def write_plot(results: list[RunResult], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")  # headless: no display on the bench machines
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return False
    panels = (
        ("ttft_ms_p99", "TTFT p99 (simulated ms)", True),
        ("itl_ms_p99", "inter-token latency p99 (simulated ms)", True),
        ("itl_ms_max", "longest gap between two tokens (simulated ms)", True),
        ("itl_interrupted_frac", "share of token gaps with a prefill step", False),
        ("throughput_tok_s", "throughput (tokens / simulated s)", True),
        ("placeholder_frac", "placeholder fraction of forward rank-steps", False),
        ("collectives_per_step", "vote collectives per step", True),
        ("ttft_steps_p99", "TTFT p99 (group steps)", True),
    )
    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5))
    # Colour = policy (the comparison), line and marker = workload.
    colors = dict(
        zip(POLICIES, ("tab:blue", "tab:red", "tab:green", "tab:orange", "tab:purple"), strict=True)
    )
    styles = dict(zip(WORKLOADS, (("-", "o"), ("--", "s"), (":", "^")), strict=True))
    for ax, (key, title, log_y) in zip(axes.flat, panels, strict=True):
        for workload in WORKLOADS:
            for policy in POLICIES:
                runs = [r for r in results if r.workload == workload and r.policy == policy]
                if runs:
                    xs = [r.num_ranks for r in runs]
                    ys = [r.metrics[key] for r in runs]
                    line, marker = styles[workload]
                    label = f"{policy} / {workload}"
                    ax.plot(xs, ys, line, color=colors[policy], marker=marker, label=label)
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel("DP ranks N")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(
        "Lockstep step policies vote, every_step and deadline (+mixed: mixed steps), simulated "
        "(real schedulers, modelled time)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- CLI -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="DP sizes to simulate")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--quick", action="store_true", help="N up to 32 and half the requests")
    p.add_argument("--out", type=Path, default=Path("bench_results/simulate_vote.json"))
    p.add_argument("--plot", type=Path, default=Path("bench_results/simulate_vote.png"))
    p.add_argument("--no-plot", action="store_true")
    w = p.add_argument_group("workload")
    defaults = WorkloadSpec()
    w.add_argument("--requests-per-rank", type=int, default=defaults.requests_per_rank)
    w.add_argument("--duration-ms", type=float, default=defaults.duration_ms)
    w.add_argument("--prompt-len", type=int, nargs=2, default=defaults.prompt_len)
    w.add_argument("--max-tokens", type=int, nargs=2, default=defaults.max_tokens)
    w.add_argument("--zipf-s", type=float, default=defaults.zipf_s)
    w.add_argument("--bursts", type=int, default=defaults.bursts)
    w.add_argument("--burst-rank-frac", type=float, default=defaults.burst_rank_frac)
    w.add_argument("--burst-ms", type=float, default=defaults.burst_ms)
    w.add_argument("--seed", type=int, default=defaults.seed)
    c = p.add_argument_group("cost model (ms)")
    for name, value in asdict(CostModel()).items():
        c.add_argument(f"--{name}", type=float, default=value)
    s = p.add_argument_group("scheduler (per rank)")
    s.add_argument("--max-num-seqs", type=int, default=128)
    s.add_argument("--max-num-batched-tokens", type=int, default=8192)
    s.add_argument("--max-model-len", type=int, default=4096)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-blocks", type=int, default=8192)
    s.add_argument("--all-interval", type=int, default=70)
    s.add_argument("--any-interval", type=int, default=100)
    s.add_argument("--mixed-prompt-tokens", type=int, default=MIXED_PROMPT_TOKENS_GROUP)
    s.add_argument(
        "--deadline-steps", type=int, default=None,
        help="deadline policy: prefill_deadline_steps (default: the engine's for N ranks)",
    )  # fmt: skip
    s.add_argument(
        "--goal-policy", choices=POLICIES, default="deadline+mixed", help="the policy checked"
    )
    return p.parse_args(argv)


def configs_from_args(args: argparse.Namespace) -> tuple[WorkloadSpec, CostModel, SchedulerConfig]:
    spec = WorkloadSpec(
        requests_per_rank=max(1, args.requests_per_rank // (2 if args.quick else 1)),
        duration_ms=args.duration_ms,
        prompt_len=tuple(args.prompt_len),
        max_tokens=tuple(args.max_tokens),
        zipf_s=args.zipf_s,
        bursts=args.bursts,
        burst_rank_frac=args.burst_rank_frac,
        burst_ms=args.burst_ms,
        seed=args.seed,
    )
    cost = CostModel(**{name: getattr(args, name) for name in asdict(CostModel())})
    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        prefill_attempt_interval=args.all_interval,
        prefill_any_attempt_interval=args.any_interval,
        mixed_prompt_tokens=args.mixed_prompt_tokens,
        prefill_deadline_steps=args.deadline_steps,
    )
    return spec, cost, config


def run_all(
    ranks: list[int],
    workloads: list[str],
    policies: list[str],
    spec: WorkloadSpec,
    cost: CostModel,
    config: SchedulerConfig,
) -> list[RunResult]:
    results = []
    for workload in workloads:
        for num_ranks in ranks:
            requests = make_workload(workload, num_ranks, spec)
            for policy in policies:
                res = simulate(num_ranks, workload, policy, requests, config, cost)
                _check_complete(res, requests)
                results.append(res)
                print(format_table([res]).splitlines()[-1], flush=True)
    return results


def _check_complete(result: RunResult, requests: list[Request]) -> None:
    twice = [rid for rid, n in result.finish_counts.items() if n != 1]
    missing = len(requests) - len(result.finish_counts)
    if twice or missing:
        raise LockstepError(f"{missing} requests never finished; reported twice: {twice[:5]}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    spec, cost, config = configs_from_args(args)
    ranks = args.ranks or list(QUICK_RANKS if args.quick else DEFAULT_RANKS)
    started = time.perf_counter()
    print(format_table([]).splitlines()[0], flush=True)
    results = run_all(ranks, args.workloads, args.policies, spec, cost, config)
    wall_s = time.perf_counter() - started
    print(f"\n{format_table(results)}\n\ntotal wall time {wall_s:.1f} s")
    table, checks = markdown_table(results), goal_check(results, args.goal_policy)
    print(f"\n{table}\n\n{goals_markdown(checks)}")
    payload = {
        "command": " ".join(["python", "scripts/simulate_vote.py", *(argv or sys.argv[1:])]),
        "markdown_table": table,
        "goals": checks,
        "goals_markdown": goals_markdown(checks),
        "workload": asdict(spec),
        "cost_model_ms": asdict(cost),
        "scheduler": config.to_dict(),
        "python": platform.python_version(),
        "wall_s": wall_s,
        "results": [_row(r) for r in results],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.out}")
    if not args.no_plot and write_plot(results, args.plot):
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
