"""What step synchronisation costs a DP group: sync policies ``vote``, ``every_step`` and
``deadline``, the latter two with prefill-only (``+separate``) or mixed (``+mixed``) prefill steps.
``deadline`` runs at the engine's default deadline for the group's size (0 for a pair, 2 for
more); ``--deadline-steps`` adds runs at others.

The same seeded workloads run under each policy at DP=2 and DP=4, in real multi-process gloo
groups (one spawned process per rank, CPU, float32) serving a small random Qwen3-MoE written by
``make_tiny_checkpoint`` into a temp dir. Each rank's engine loop runs on a thread while the
rank's main thread submits that rank's requests at their scheduled wall-clock times (prompts of
8-128 tokens, 16-64 output tokens, ``ignore_eos`` so every request produces exactly
``max_tokens``). When every rank's requests have ended (ranks report it through the TCPStore),
rank 0 asks the group to shut down. One spawned group per DP size runs every job in turn (one
engine per job, the model loaded once per rank).

Runs (``--runs``):

- ``skewed``: Poisson arrivals with rank skew on purpose: rank 0 gets more and longer work, odd
  ranks get nothing during an opening burst, and every rank pauses mid-run so the group drains,
  sleeps and wakes again.
- ``online``: first a capacity probe (``deadline+mixed``; every rank gets a batch of requests at
  once; capacity = requests / (last token - first submit), per rank), then uniform Poisson arrivals
  on every rank at 50% and 90% of that capacity. This is the online run the engines serve the
  way ``LLM.generate_stream`` would, minus the launcher: ``generate_stream`` takes every prompt
  up front (an offline call), so it cannot play arrivals at given times; here each rank's driver
  submits to its engine at the arrival time, as a server's request handler would.
  ``--capacity`` gives that rate instead of probing it (the probe moved 64-98 requests/s per
  rank between three runs on one shared 2-core host, so runs of one probe each are not at the
  same load), and ``--rounds`` repeats every job, the policies' order rotated each round, and
  adds a table of medians and ranges over the rounds.

Measured per (policy, DP), from every rank's ``engine.trace`` and streamed outputs:

- steps/s: steps per second of busy loop time (``sum(step_s)``, which excludes sleeping).
- sync %: ``sum(sync_s) / sum(step_s)`` per rank, averaged over ranks. ``sync_s`` is the time
  inside the vote collectives, which includes waiting for the slowest rank to arrive.
- per vote: mean seconds per allreduce call (``sum(sync_s) / TorchVote.num_calls``); "floor":
  the median over vote steps of the *smallest* ``sync_s`` of any rank at that step (per call),
  i.e. the last rank to arrive, which waits for nobody; and "bare": one vote call
  (``TorchVote.allreduce_min`` as the engine makes it: through the shared-memory exchange on
  one host, else a gloo MIN-allreduce) of 7 int64s with the ranks aligned (200 back-to-back
  calls after a barrier, after the run).
  "p50": the median call on each rank (vote steps' ``sync_s`` over their calls), averaged.
- votes/step: allreduce calls per step (vote 1 and vote 2 both count).
- placeholder %: rank-steps that ran a zero-token forward (``num_seqs == 0``, not known-empty).
- known-empty %: steps the group knew to be empty everywhere (no forward at all).
- TTFT and inter-token latency (ITL) in ms (``arrival_time``, ``first_token_time`` and
  ``token_times`` of each request's final output) and in steps. Steps are the engine's
  ``step_index``: the output callback runs inside the step that produced a token, so it records
  ``scheduler.step_index - 1`` for each streamed token; the driver records
  ``scheduler.step_index`` (the next step to start) when it submits. TTFT in steps is
  ``first token step - submit step + 1`` (the producing step counts); ITL 1 = consecutive steps.
- output tok/s: all ranks' output tokens over the time from the first arrival to the last token.

    .venv/bin/python scripts/bench_sync.py [--quick] [--runs skewed online]
        [--policies vote deadline+mixed ...] [--dp 2 4] [--deadline-steps 0 ...]
        [--rounds N] [--capacity REQUESTS_PER_S_PER_RANK] [--out bench_results/sync.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dist_engine.distributed.groups import DistContext, init_distributed
from dist_engine.distributed.spawn import current_store, run_multirank
from dist_engine.distributed.step_sync import TorchVote
from dist_engine.engine.config import EngineConfig, ParallelConfig
from dist_engine.engine.engine import DPEngine
from dist_engine.engine.outputs import RequestOutput
from dist_engine.models.make_model import make_tiny_checkpoint
from scheduler import SamplingParams, SchedulerConfig
from scheduler.config import POLICY_VARIANTS, policy_variant
from scheduler.vote import VOTE_VECTOR_LEN

MODEL_SIZES = dict(
    vocab_size=512,
    hidden_size=128,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    num_experts=16,
    top_k=2,
    moe_intermediate_size=64,
    intermediate_size=256,
)
SCHEDULER = dict(
    max_num_seqs=16,
    max_num_batched_tokens=256,
    max_model_len=256,
    block_size=16,
    num_blocks=320,
)
POLICIES = POLICY_VARIANTS
WORLD_SIZES = (2, 4)
RUNS = ("skewed", "online")
ONLINE_LOADS = (0.5, 0.9)  # fractions of the measured capacity
PROBE_POLICY = "deadline+mixed"
COLLECTIVE_TIMEOUT_S = 60.0
BARE_CALLS = 200


@dataclass(frozen=True)
class Spec:
    """The workload, per rank: the same for every policy and DP size."""

    duration_s: float  # arrivals are spread over this many seconds
    rate_per_s: float  # mean arrivals per second (skewed: on the least loaded rank)
    seed: int = 1234
    kind: str = "skewed"  # skewed | poisson (uniform, no pauses) | batch (capacity probe)
    batch: int = 0  # kind "batch": requests per rank, all submitted at once


@dataclass(frozen=True)
class Arrival:
    request_id: str
    at_s: float  # seconds after the driver starts
    prompt: tuple[int, ...]
    max_tokens: int


# -- workload ----------------------------------------------------------------------------------
def make_workload(rank: int, world: int, spec: Spec) -> list[Arrival]:
    """Seeded arrivals for one rank. skewed: Poisson with rank skew (rank 0 gets 1.6x the rate
    and longer prompts; odd ranks sit out the first 15%; all pause at 50-65%). poisson: the
    same rate on every rank, no pauses. batch: ``spec.batch`` requests at time 0."""
    rng = random.Random(spec.seed * 1000 + rank + (0 if spec.kind == "skewed" else 100 * world))
    skewed = spec.kind == "skewed"
    rate = spec.rate_per_s * (1.6 if skewed and rank == 0 else 1.0)
    arrivals: list[Arrival] = []
    now = 0.0
    while True:
        if spec.kind == "batch":
            if len(arrivals) == spec.batch:
                return arrivals
        else:
            now += rng.expovariate(rate)
            if now >= spec.duration_s:
                return arrivals
        phase = now / spec.duration_s if spec.duration_s else 0.0
        if skewed and ((phase < 0.15 and rank % 2 == 1) or 0.5 <= phase < 0.65):
            continue
        low = 48 if skewed and rank == 0 else 8
        prompt = tuple(
            rng.randrange(1, MODEL_SIZES["vocab_size"]) for _ in range(rng.randint(low, 128))
        )
        arrivals.append(Arrival(f"r{rank}-{len(arrivals)}", now, prompt, rng.randint(16, 64)))


# -- one rank ----------------------------------------------------------------------------------
class Collector:
    """Per-request streamed outputs, with the step each token was produced at."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.engine: DPEngine | None = None
        self.submit_step: dict[str, int] = {}
        self.token_steps: dict[str, list[int]] = {}
        self.final: dict[str, RequestOutput] = {}
        self.all_done = threading.Event()
        self.expected = 0

    def __call__(self, output: RequestOutput) -> None:
        # Runs on the engine thread inside the producing step; schedule() already advanced
        # step_index, so that step is step_index - 1.
        assert self.engine is not None
        step = self.engine.scheduler.step_index - 1
        with self.lock:
            steps = self.token_steps.setdefault(output.request_id, [])
            steps.extend([step] * len(output.new_token_ids))
            if output.finished:
                self.final[output.request_id] = output
                if len(self.final) >= self.expected:
                    self.all_done.set()


def _engine_config(model_dir: str, world: int, policy: str) -> EngineConfig:
    """``policy``: a POLICY_VARIANTS name, or ``deadline+mixed@D`` (`--deadline-steps`)."""
    policy, _, deadline = policy.partition("@")
    overrides: dict[str, Any] = {"prefill_deadline_steps": int(deadline)} if deadline else {}
    scheduler = policy_variant(SchedulerConfig(**SCHEDULER, **overrides), policy)
    return EngineConfig(
        model=model_dir,
        dtype="float32",
        parallel=ParallelConfig(
            dp_size=world,
            launcher="local",
            backend="gloo",
            collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        ),
        scheduler=scheduler,
        check_lockstep=False,
    )


def _play(engine: DPEngine, collector: Collector, arrivals: list[Arrival]) -> None:
    start = time.monotonic()
    for arrival in arrivals:
        delay = start + arrival.at_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        with collector.lock:
            collector.submit_step[arrival.request_id] = engine.scheduler.step_index
        params = SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True)
        engine.submit(arrival.request_id, list(arrival.prompt), params, stream=True)


def _shut_down_together(
    engine: DPEngine, store: dist.Store, rank: int, world: int, job: int
) -> None:
    """Every rank reports done through the store; rank 0 then asks the group to stop, so no
    rank leaves while another still needs it in the collectives."""
    keys = [f"bench_sync/{job}/done/{r}" for r in range(world)]
    store.set(keys[rank], b"1")
    if rank == 0:
        while not store.check(keys):
            time.sleep(0.01)
        engine.shutdown()


def _bare_allreduce(ctx: DistContext) -> list[float]:
    """Seconds per vote call on a vote-sized vector with the ranks aligned, through the path
    the engine's votes take (`TorchVote`: shared memory on one host, else gloo)."""
    vote = TorchVote(ctx.vote_group, ctx.shared_memory)
    values = [0] * VOTE_VECTOR_LEN
    dist.barrier(group=ctx.vote_group)
    times = []
    for _ in range(BARE_CALLS):
        start = time.perf_counter()
        vote.allreduce_min(values)
        times.append(time.perf_counter() - start)
    return times


def _serve(
    ctx: DistContext, model_dir: str, policy: str, spec: Spec, job: int, model: Any
) -> tuple[dict[str, Any], Any]:
    arrivals = make_workload(ctx.rank, ctx.world_size, spec)
    collector = Collector()
    collector.expected = len(arrivals)
    if not arrivals:
        collector.all_done.set()
    config = _engine_config(model_dir, ctx.world_size, policy)
    engine = DPEngine(config, ctx, model=model, on_output=collector)
    collector.engine = engine
    # The driver's own store connection: a client serves one request at a time.
    store = dist.TCPStore(ctx.store.host, ctx.store.port, is_master=False)
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    _play(engine, collector, arrivals)
    if not collector.all_done.wait(spec.duration_s * 10 + 120):
        raise TimeoutError(f"rank {ctx.rank}: requests never ended")
    _shut_down_together(engine, store, ctx.rank, ctx.world_size, job)
    thread.join(COLLECTIVE_TIMEOUT_S)
    if thread.is_alive() or engine.error is not None:
        raise RuntimeError(f"rank {ctx.rank}: engine did not stop cleanly: {engine.error}")
    return _rank_result(engine, collector, arrivals), engine.model


def _rank_result(engine: DPEngine, collector: Collector, arrivals: list[Arrival]) -> dict[str, Any]:
    requests = {}
    for arrival in arrivals:
        final = collector.final[arrival.request_id]
        requests[arrival.request_id] = {
            "prompt_len": len(arrival.prompt),
            "max_tokens": arrival.max_tokens,
            "finish_reason": final.finish_reason,
            "num_tokens": len(final.output_token_ids),
            "arrival_time": final.arrival_time,
            "first_token_time": final.first_token_time,
            "token_times": final.token_times,
            "submit_step": collector.submit_step[arrival.request_id],
            "token_steps": collector.token_steps.get(arrival.request_id, []),
        }
    trace = [
        (
            t.step,
            t.kind.value,
            t.point.value,
            (t.group is not None) + (t.any_scheduled is not None),  # allreduce calls
            t.num_seqs,
            t.sync_s,
            t.step_s,
            t.slept_s,
        )
        for t in engine.trace
    ]
    assert engine.vote is not None
    return {"trace": trace, "vote_calls": engine.vote.num_calls, "requests": requests}


def _rank_main(
    rank: int, world: int, model_dir: str, jobs: list[tuple[str, Spec]]
) -> list[dict[str, Any]]:
    """One rank, inside `run_multirank`'s spawned process (default group already joined): the
    jobs in turn, one engine each, sharing the loaded model."""
    ctx = init_distributed(
        rank, world, current_store(), backend="gloo", timeout_s=COLLECTIVE_TIMEOUT_S
    )
    model = None
    results = []
    for job, (policy, spec) in enumerate(jobs):
        result, model = _serve(ctx, model_dir, policy, spec, job, model)
        result["bare_allreduce_s"] = _bare_allreduce(ctx)
        results.append(result)
    return results


# -- the parent --------------------------------------------------------------------------------
def run_jobs(
    model_dir: str, world: int, jobs: list[tuple[str, Spec]], cpu_binding: bool = True
) -> list[list[dict[str, Any]]]:
    """Spawn ``world`` ranks once and run ``jobs`` (policy, workload) in turn; returns, per job,
    the ranks' results. Each rank gets the host's cores split over the ranks, pinned as the
    launchers pin them."""
    per_rank = run_multirank(
        world,
        _rank_main,
        (model_dir, jobs),
        timeout_s=sum(spec.duration_s * 10 + 120 for _, spec in jobs) + 300,
        group_timeout_s=COLLECTIVE_TIMEOUT_S,
        num_threads=max(1, (os.cpu_count() or 2) // world),
        cpu_binding=cpu_binding,
    )
    return [[ranks[job] for ranks in per_rank] for job in range(len(jobs))]


def capacity_per_rank(ranks: list[dict[str, Any]]) -> float:
    """Requests per second per rank the group served when every rank had a full queue."""
    reqs = [req for r in ranks for req in r["requests"].values()]
    span = max(q["token_times"][-1] for q in reqs) - min(q["arrival_time"] for q in reqs)
    return len(reqs) / span / len(ranks)


# -- analysis ----------------------------------------------------------------------------------
def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _trace_metrics(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    traces = [r["trace"] for r in ranks]
    steps = len(traces[0])
    rank_steps = [row for trace in traces for row in trace]
    busy = [sum(row[6] for row in trace) for trace in traces]
    sync = [sum(row[5] for row in trace) for trace in traces]
    calls = [r["vote_calls"] for r in ranks]
    # Per vote step, the last rank to arrive waits for nobody: its time is the collective's.
    floors = [
        min(trace[i][5] for trace in traces) / traces[0][i][3]
        for i in range(steps)
        if traces[0][i][3]
    ]
    # Per rank, the median call: robust to the CPU-steal outliers that dominate the mean.
    medians = [_pct([row[5] / row[3] for row in trace if row[3]], 50) for trace in traces]
    kinds = [row[1] for row in traces[0]]
    points: dict[str, list[int]] = {}
    for row in traces[0]:  # per attempt point: [steps, of which prefill]
        counts = points.setdefault(row[2], [0, 0])
        counts[0] += 1
        counts[1] += row[1] == "prefill"
    return {
        "steps": steps,
        "same_steps_on_all_ranks": all(len(t) == steps for t in traces),
        "steps_per_s": steps / statistics.mean(busy),
        "busy_s": statistics.mean(busy),
        "sync_frac": statistics.mean(s / b for s, b in zip(sync, busy, strict=True)),
        "vote_calls": calls[0],
        "votes_per_step": calls[0] / steps,
        "vote_steps_per_step": sum(row[3] > 0 for row in traces[0]) / steps,
        "s_per_vote": statistics.mean(s / max(c, 1) for s, c in zip(sync, calls, strict=True)),
        "vote_p50_s": statistics.mean(medians),
        "vote_floor_s": _pct(floors, 50),
        "sync_frac_per_rank": [s / b for s, b in zip(sync, busy, strict=True)],
        "placeholder_frac": sum(r[4] == 0 and r[1] != "empty" for r in rank_steps)
        / len(rank_steps),
        "known_empty_frac": sum(r[1] == "empty" for r in rank_steps) / len(rank_steps),
        "prefill_steps": kinds.count("prefill"),
        "decode_steps": kinds.count("decode"),
        "empty_steps": kinds.count("empty"),
        "points": points,
        "slept_s": statistics.mean(sum(row[7] for row in trace) for trace in traces),
        "sleeps": sum(row[7] > 0 for row in traces[0]),
        "bare_allreduce_p50_s": statistics.mean(_pct(r["bare_allreduce_s"], 50) for r in ranks),
    }


def _latency_metrics(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    reqs = [req for r in ranks for req in r["requests"].values()]
    ttft_ms = [(q["first_token_time"] - q["arrival_time"]) * 1e3 for q in reqs]
    ttft_steps = [q["token_steps"][0] - q["submit_step"] + 1 for q in reqs]
    itl_ms = [(b - a) * 1e3 for q in reqs for a, b in pairwise(q["token_times"])]
    itl_steps = [b - a for q in reqs for a, b in pairwise(q["token_steps"])]
    tokens = sum(q["num_tokens"] for q in reqs)
    # A rank can draw no arrival at all in a short or light run.
    span = (
        max(q["token_times"][-1] for q in reqs) - min(q["arrival_time"] for q in reqs)
        if reqs
        else float("nan")
    )
    return {
        "requests": len(reqs),
        "all_complete": all(q["num_tokens"] == q["max_tokens"] for q in reqs),
        "output_tokens": tokens,
        "span_s": span,
        "output_tok_per_s": tokens / span,
        "ttft_ms_p50": _pct(ttft_ms, 50),
        "ttft_ms_p90": _pct(ttft_ms, 90),
        "ttft_ms_p99": _pct(ttft_ms, 99),
        "ttft_steps_p50": _pct(ttft_steps, 50),
        "ttft_steps_p90": _pct(ttft_steps, 90),
        "ttft_steps_p99": _pct(ttft_steps, 99),
        "itl_ms_p50": _pct(itl_ms, 50),
        "itl_ms_p99": _pct(itl_ms, 99),
        "itl_steps_p50": _pct(itl_steps, 50),
        "itl_steps_p99": _pct(itl_steps, 99),
    }


def _by_rank(ranks: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Rank skew shows here: the busiest rank's queue is where requests wait."""
    per_rank = [_latency_metrics([r]) for r in ranks]
    keys = ("requests", "ttft_ms_p50", "ttft_ms_p90", "ttft_steps_p50", "ttft_steps_p90")
    return {f"{key}_by_rank": [m[key] for m in per_rank] for key in keys}


def summarise(run: str, policy: str, world: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "run": run,
        "policy": policy,
        "dp": world,
        "oversubscribed": world > (os.cpu_count() or 1),
        **_trace_metrics(ranks),
        **_latency_metrics(ranks),
        **_by_rank(ranks),
    }


# -- output ------------------------------------------------------------------------------------
COLUMNS = (
    ("run", "run", "{}"),
    ("round", "round", "{}"),
    ("policy", "policy", "{}"),
    ("DP", "dp", "{}"),
    ("steps/s", "steps_per_s", "{:.1f}"),
    ("sync %", "sync_frac", "{:.2%}"),
    ("ms/vote", "s_per_vote", "ms"),
    ("p50 ms/vote", "vote_p50_s", "ms"),
    ("floor ms", "vote_floor_s", "ms"),
    ("bare ms", "bare_allreduce_p50_s", "ms"),
    ("votes/step", "votes_per_step", "{:.3f}"),
    ("placeh. %", "placeholder_frac", "{:.1%}"),
    ("empty %", "known_empty_frac", "{:.1%}"),
    (
        "TTFT p50/p90/p99 ms",
        ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99"),
        "{:.0f} / {:.0f} / {:.0f}",
    ),
    ("TTFT p50/p99 st", ("ttft_steps_p50", "ttft_steps_p99"), "{} / {}"),
    ("ITL p50/p99 ms", ("itl_ms_p50", "itl_ms_p99"), "{:.1f} / {:.1f}"),
    ("ITL p50/p99 st", ("itl_steps_p50", "itl_steps_p99"), "{} / {}"),
    ("out tok/s", "output_tok_per_s", "{:.0f}"),
)


def _cell(row: dict[str, Any], key: str | tuple[str, ...], fmt: str) -> str:
    if fmt == "ms":
        return f"{row[key] * 1e3:.3f}"
    keys = key if isinstance(key, tuple) else (key,)
    return fmt.format(*(row[k] for k in keys))


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(name for name, _, _ in COLUMNS) + " |",
        "| " + " | ".join("---" if i < 4 else "---:" for i in range(len(COLUMNS))) + " |",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row, k, f) for _, k, f in COLUMNS) + " |")
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]]) -> list[str]:
    """Target: under ``vote``, sync time <= 2% of step time."""
    lines = []
    for row in rows:
        if row["policy"] != "vote" or row["run"] != "skewed":
            continue
        met = "MET" if row["sync_frac"] <= 0.02 else "MISSED"
        note = " (oversubscribed: more ranks than cores)" if row["oversubscribed"] else ""
        lines.append(
            f"DP={row['dp']}{note}: vote sync {row['sync_frac']:.2%} of step time -> {met}; "
            f"{row['s_per_vote'] * 1e3:.3f} ms per vote (median {row['vote_p50_s'] * 1e3:.3f}) vs "
            f"{row['vote_floor_s'] * 1e3:.3f}"
            f" ms for the last rank to arrive and {row['bare_allreduce_p50_s'] * 1e3:.3f} ms bare"
        )
    return lines


def compare(rows: list[dict[str, Any]], policy: str = "deadline+mixed") -> list[str]:
    """Per run and DP: ``policy`` against vote and every_step with prefill-only steps, on the
    issue's terms (TTFT p99 vs every_step's, ITL p99 vs vote's, output rate and placeholder
    share vs the better)."""
    lines = []
    for run, world, round_ in sorted({(r["run"], r["dp"], r["round"]) for r in rows}):
        cell = {
            r["policy"]: r
            for r in rows
            if r["run"] == run and r["dp"] == world and r["round"] == round_
        }
        if not {"vote", "every_step+separate", policy} <= set(cell):
            continue
        new, vote, every = cell[policy], cell["vote"], cell["every_step+separate"]
        lines.append(
            f"{run} DP={world} round {round_}: {policy} TTFT p99 {new['ttft_ms_p99']:.0f} ms = "
            f"{new['ttft_ms_p99'] / every['ttft_ms_p99']:.2f}x every_step+separate's; ITL p99 "
            f"{new['itl_ms_p99']:.1f} ms = {new['itl_ms_p99'] / vote['itl_ms_p99']:.2f}x vote's; "
            f"{new['output_tok_per_s']:.0f} tok/s vs best "
            f"{max(vote['output_tok_per_s'], every['output_tok_per_s']):.0f}; placeholders "
            f"{new['placeholder_frac']:.1%} vs best "
            f"{min(vote['placeholder_frac'], every['placeholder_frac']):.1%}; sync "
            f"{new['sync_frac']:.2%} (vote {vote['sync_frac']:.2%}, every_step+separate "
            f"{every['sync_frac']:.2%})"
        )
    return lines


ROUND_KEYS = (
    ("TTFT p50 ms", "ttft_ms_p50"),
    ("TTFT p99 ms", "ttft_ms_p99"),
    ("ITL p50 ms", "itl_ms_p50"),
    ("ITL p99 ms", "itl_ms_p99"),
    ("out tok/s", "output_tok_per_s"),
)


def rounds_table(rows: list[dict[str, Any]]) -> str:
    """Per run, DP and policy: the median over rounds of each ROUND_KEYS figure, its range."""
    lines = [
        "| run | DP | policy | rounds | " + " | ".join(n for n, _ in ROUND_KEYS) + " |",
        "| --- | --- | --- | ---: | " + " | ".join("---:" for _ in ROUND_KEYS) + " |",
    ]
    cells: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault((row["run"], row["dp"], row["policy"]), []).append(row)
    for (run, world, policy), group in cells.items():
        figures = []
        for _, key in ROUND_KEYS:
            values = sorted(r[key] for r in group)
            figures.append(f"{statistics.median(values):.1f} ({values[0]:.1f}-{values[-1]:.1f})")
        lines.append(f"| {run} | {world} | {policy} | {len(group)} | " + " | ".join(figures) + " |")
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results/sync.json")
    parser.add_argument("--quick", action="store_true", help="a short run (a few seconds each)")
    parser.add_argument(
        "--no-cpu-binding",
        action="store_true",
        help="leave the rank processes unpinned (default: each on its own cores when they fit)",
    )
    parser.add_argument("--duration", type=float, default=None, help="arrival window, seconds")
    parser.add_argument("--rate", type=float, default=3.0, help="skewed: arrivals/s, light rank")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--dp", type=int, nargs="+", default=list(WORLD_SIZES))
    parser.add_argument(
        "--deadline-steps", type=int, nargs="+", default=[],
        help="also run deadline+mixed with these prefill_deadline_steps (as deadline+mixed@D)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="run every job this many times, the policies' order rotated each round",
    )  # fmt: skip
    parser.add_argument(
        "--capacity", type=float, default=None,
        help="online: requests/s per rank that 100%% stands for (default: probe it first)",
    )  # fmt: skip
    args = parser.parse_args()
    args.policies += [f"deadline+mixed@{steps}" for steps in args.deadline_steps]
    duration = args.duration or (4.0 if args.quick else 12.0)
    skewed = Spec(duration_s=duration, rate_per_s=args.rate)
    probe = Spec(duration_s=0.0, rate_per_s=0.0, kind="batch", batch=12 if args.quick else 48)
    cores = os.cpu_count() or 1
    rows = []
    capacities = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_checkpoint("qwen3_moe", tmp, seed=0, **MODEL_SIZES))
        for world in args.dp:
            if world > cores:
                print(
                    f"note: DP={world} runs {world} rank processes on {cores} cores "
                    "(oversubscribed): ranks time-share cores, so waits grow"
                )
            runs: list[tuple[str, Spec]] = []
            if "skewed" in args.runs:
                runs.append(("skewed", skewed))
            if "online" in args.runs:
                capacity = args.capacity
                if capacity is None:
                    started = time.monotonic()
                    (probe_ranks,) = run_jobs(model_dir, world, [(PROBE_POLICY, probe)])
                    capacity = capacity_per_rank(probe_ranks)
                    print(
                        f"DP={world}: capacity {capacity:.2f} requests/s per rank "
                        f"({time.monotonic() - started:.1f} s)",
                        flush=True,
                    )
                capacities[world] = capacity
                for load in ONLINE_LOADS:
                    spec = Spec(duration_s=duration, rate_per_s=load * capacity, kind="poisson")
                    runs.append((f"online{load:.0%}", spec))
            # Each round runs every run under every policy, the policies' order rotated by one
            # a round, so no policy always follows the same one on a machine that drifts.
            jobs: list[tuple[int, str, str, Spec]] = []
            for round_ in range(args.rounds):
                shift = round_ % len(args.policies)
                order = args.policies[shift:] + args.policies[:shift]
                jobs += [(round_, run, policy, spec) for run, spec in runs for policy in order]
            started = time.monotonic()
            results = run_jobs(
                model_dir, world, [(p, s) for _, _, p, s in jobs], not args.no_cpu_binding
            )
            for (round_, run, policy, _), ranks in zip(jobs, results, strict=True):
                row = {**summarise(run, policy, world, ranks), "round": round_}
                print(
                    f"{run} {policy} DP={world}: {row['steps']} steps, {row['requests']} requests",
                    flush=True,
                )
                rows.append(row)
            print(f"DP={world}: {len(jobs)} jobs in {time.monotonic() - started:.1f} s")
    print()
    print(markdown_table(rows))
    print()
    if args.rounds > 1:
        print(rounds_table(rows))
        print()
    print("\n".join(verdict(rows) + compare(rows)))
    _write(args.out, skewed, rows, not args.no_cpu_binding, capacities, args.rounds)


def _write(
    path: str,
    spec: Spec,
    rows: list[dict[str, Any]],
    cpu_binding: bool,
    capacities: dict[int, float],
    rounds: int,
) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "model": MODEL_SIZES,
        "scheduler": SCHEDULER,
        "spec": asdict(spec),
        # deadline+mixed's D: the engine's default for each group size (`for_group`)
        "prefill_deadline_steps": {
            world: SchedulerConfig().for_group(world).deadline_steps
            for world in sorted({row["dp"] for row in rows})
        },
        "mixed_prompt_tokens": SchedulerConfig().mixed_prompt_cap,
        "online_loads": ONLINE_LOADS,
        "capacity_requests_per_s_per_rank": capacities,
        "rounds": rounds,
        "cpu_binding": cpu_binding,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
