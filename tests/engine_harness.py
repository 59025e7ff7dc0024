"""Drive DPEngines through scripted scenarios in real multi-process gloo groups.

Each rank runs its engine loop on a thread while the rank's main thread plays the scenario's
events for that rank (submit, abort, release a held request, die) at given step indices. When
every rank's requests have ended, rank 0 asks the group to shut down. Each rank returns its
outputs and its step trace; the test compares them across ranks and against a reference.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from model_fixtures import TINY_SIZES

from dist_engine.distributed.groups import init_distributed
from dist_engine.distributed.spawn import current_store
from dist_engine.engine.config import EngineConfig, MoEConfig, ParallelConfig
from dist_engine.engine.engine import DPEngine
from dist_engine.engine.eplb import moe_layers
from scheduler import SamplingParams, SchedulerConfig

MODEL_SIZES = {**TINY_SIZES, "num_layers": 2}  # the shared `model_dir` fixture's model
BASE_SCHEDULER = dict(
    max_num_seqs=16,
    max_num_batched_tokens=128,
    max_model_len=200,
    block_size=4,
    num_blocks=400,
    prefill_attempt_interval=7,
    prefill_any_attempt_interval=10,
)
COLLECTIVE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Event:
    rank: int
    step: int  # played once the group reaches this step (or sleeps)
    action: str  # add | abort | release | kill | cycle | remove_checkpoint
    request_id: str = ""
    prompt: tuple[int, ...] = ()
    max_tokens: int = 8
    schedulable: bool = True
    stream: bool = False
    delay_s: float = 0.0  # extra wait after the step is reached
    cycle: int = -1  # for "cycle": the index in a chain of sleep/wake round trips


@dataclass(frozen=True)
class Scenario:
    name: str
    events: tuple[Event, ...]
    scheduler: dict[str, Any] = field(default_factory=dict)
    rank_scheduler: dict[int, dict[str, Any]] = field(default_factory=dict)
    sync_policy: str = "vote"
    timeout_s: float = 90.0
    # MoEConfig settings (EPLB); a scenario with any, or with a model of its own, loads its
    # model and keeps it to itself.
    moe: dict[str, Any] = field(default_factory=dict)
    model_dir: str | None = None  # None: run_scenarios' model
    # A rank's own copy of the checkpoint (what EPLB reads while serving), by rank.
    rank_model_dir: dict[int, str] = field(default_factory=dict)

    def scheduler_config(self, rank: int) -> SchedulerConfig:
        settings = {**BASE_SCHEDULER, "sync_policy": self.sync_policy, **self.scheduler}
        return SchedulerConfig(**{**settings, **self.rank_scheduler.get(rank, {})})


def run_scenarios(rank: int, world_size: int, model_dir: str, scenarios: list[Scenario]) -> dict:
    ctx = init_distributed(
        rank, world_size, current_store(), backend="gloo", timeout_s=COLLECTIVE_TIMEOUT_S
    )
    model = None
    results = {}
    for scenario in scenarios:
        if scenario.moe or scenario.model_dir:  # a model of its own; the others share one
            own_dir = scenario.model_dir or model_dir
            results[scenario.name], _ = _run_one(ctx, own_dir, scenario, None)
        else:
            results[scenario.name], model = _run_one(ctx, model_dir, scenario, model)
    return results


def _run_one(ctx, model_dir: str, scenario: Scenario, model) -> tuple[dict, Any]:
    started = time.monotonic()
    rank, world = ctx.rank, ctx.world_size
    config = EngineConfig(
        model=scenario.rank_model_dir.get(rank, model_dir),
        dtype="float64",
        parallel=ParallelConfig(
            dp_size=world,
            launcher="local",
            backend="gloo",
            collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        ),
        scheduler=scenario.scheduler_config(rank),
        moe=MoEConfig(**scenario.moe),
        check_lockstep=True,
    )
    outputs: dict[str, list] = defaultdict(list)
    lock = threading.Lock()

    def collect(output) -> None:
        with lock:
            outputs[output.request_id].append(output)

    engine = DPEngine(config, ctx, model=model, on_output=collect)
    # The driver's own store connection: a client serves one request at a time.
    store = dist.TCPStore(ctx.store.host, ctx.store.port, is_master=False)
    failure: list[str] = []

    def loop() -> None:
        try:
            engine.run()
        except Exception as error:
            failure.append(f"{type(error).__name__}: {error}")

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    mine = sorted((e for e in scenario.events if e.rank == rank), key=lambda e: (e.step, e.cycle))
    added = []
    latencies = []
    deadline = time.monotonic() + scenario.timeout_s
    try:
        _play_events(engine, store, scenario, mine, outputs, lock, added, latencies, deadline, rank)
    except TimeoutError as error:
        failure.append(f"driver: {error}")
    try:
        _wait_for(
            lambda: engine.stopped or all(_ended(outputs, lock, rid) for rid in added), deadline
        )
    except TimeoutError:
        pending = [rid for rid in added if not _ended(outputs, lock, rid)]
        failure.append(f"requests never ended: {pending}")
    done_keys = [f"scenario/{scenario.name}/done/{r}" for r in range(world)]
    store.set(done_keys[rank], b"1")
    if rank == 0:
        if not engine.stopped and not failure:
            _wait_for(lambda: store.check(done_keys), deadline)
        engine.shutdown()
    thread.join(max(1.0, deadline - time.monotonic()))
    if thread.is_alive():
        failure.append("engine loop did not stop")
    result = {
        "outputs": {rid: _summarise(outs) for rid, outs in outputs.items()},
        "added": added,
        "trace": [
            (t.step, t.kind.value, t.point.value, _view(t.group), t.any_scheduled, t.num_seqs)
            for t in engine.trace
        ],
        "sync_s": sum(t.sync_s for t in engine.trace),
        "step_s": sum(t.step_s for t in engine.trace),
        "latencies": latencies,
        "wake": type(engine.wake).__name__,
        "failure": failure,
        "num_preemptions": engine.scheduler.num_preemptions,
        "wall_s": time.monotonic() - started,
        # EPLB: what it did after each step's forward, its stats, each MoE layer's final maps.
        "eplb": [t.eplb for t in engine.trace],
        "expert_stats": engine.stats().experts,
        "phy2log": [layer.placement.phy2log.tolist() for layer in moe_layers(engine.model)],
    }
    return result, engine.model


def _play_events(
    engine, store, scenario, events, outputs, lock, added, latencies, deadline, rank
) -> None:
    name = scenario.name
    for event in events:
        _wait_for(
            lambda ev=event: (
                engine.scheduler.step_index >= ev.step or engine.sleeping or engine.stopped
            ),
            deadline,
        )
        if event.action == "cycle":
            latencies.append(_play_cycle(engine, store, name, event, outputs, lock, deadline))
            added.append(event.request_id)
            continue
        if event.delay_s:
            time.sleep(event.delay_s)
        if event.action == "add":
            engine.submit(
                event.request_id,
                list(event.prompt),
                SamplingParams(max_tokens=event.max_tokens),
                stream=event.stream,
                schedulable=event.schedulable,
            )
            added.append(event.request_id)
        elif event.action == "abort":
            engine.abort(event.request_id)
        elif event.action == "release":
            engine.set_schedulable(event.request_id)
        elif event.action == "kill":
            os._exit(17)
        elif event.action == "remove_checkpoint":  # the copy this rank reads while serving
            shutil.rmtree(scenario.rank_model_dir[rank])


def _play_cycle(engine, store, name, event, outputs, lock, deadline) -> float:
    """One sleep/wake round trip: wait for the previous cycle's request to end anywhere in the
    group, pause ``delay_s`` so the request lands while the group is deciding to sleep, submit,
    and wait for the answer. Returns submit-to-first-token seconds."""
    if event.cycle > 0:
        _wait_for(lambda: store.check([f"scenario/{name}/cycle/{event.cycle - 1}"]), deadline)
    time.sleep(event.delay_s)
    start = time.monotonic()
    engine.submit(event.request_id, list(event.prompt), SamplingParams(max_tokens=1))
    try:
        _wait_for(lambda: _ended(outputs, lock, event.request_id), deadline)
    except TimeoutError:
        raise TimeoutError(
            f"cycle {event.cycle} ({event.request_id}) never ended; epoch seen "
            f"{engine.wake.seen_epoch}, sleep epoch {engine._sleep_epoch}, sleeping "
            f"{engine.sleeping}, step {engine.scheduler.step_index}"
        ) from None
    first = outputs[event.request_id][-1].first_token_time
    store.set(f"scenario/{name}/cycle/{event.cycle}", b"1")
    return (first if first is not None else time.monotonic()) - start


def _wait_for(condition, deadline: float) -> None:
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("scenario step did not happen in time")
        time.sleep(0.0005)


def _ended(outputs, lock, request_id: str) -> bool:
    with lock:
        return any(o.finished for o in outputs.get(request_id, ()))


def _summarise(outs: list) -> dict:
    final = [o for o in outs if o.finished]
    streamed = [t for o in outs if not o.finished for t in o.new_token_ids]
    last = final[-1] if final else outs[-1]
    if final:
        streamed += final[-1].new_token_ids
    return {
        "num_terminal": len(final),
        "reason": last.finish_reason,
        "tokens": last.output_token_ids,
        "prompt": last.prompt_token_ids,
        "streamed": streamed,
        "num_outputs": len(outs),
    }


def _view(group) -> tuple | None:
    if group is None:
        return None
    return (
        group.all_want,
        group.any_want,
        group.none_running,
        group.none_work,
        group.all_ready,
        group.max_ready_wait,
        group.any_backlog,
    )
