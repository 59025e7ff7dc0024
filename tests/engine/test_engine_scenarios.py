"""The vote-deadlock suite: DPEngines in real multi-process gloo groups (DP = 2 and 4).

Every scenario runs with check_lockstep on and a hard timeout, and asserts that (a) every
request ends with exactly one terminal result, (b) the step-kind trace is identical on every
rank, (c) greedy tokens equal a single-rank reference for every request that ran to its end,
and (d) the policy never starves a prefill. Under ``vote``: at an ANY or idle point where some
rank wants to prefill, the group prefills unless vote 2 found nothing admissible, and attempt
points are never further apart than the ALL interval. Under ``deadline``: no ready head has sat
out more than ``prefill_deadline_steps`` decode steps at any vote, the group prefills exactly
when its rule says so, and votes are never further apart than the deadline.

At DP = 2 each scenario also runs under ``deadline`` (its ``@deadline`` twin) in the same rank
processes, so the suite covers both policies for the price of one model load; DP = 4 runs the
twins (the default policy), the ``every_step`` scenario and a 300-request soak with aborts
under both policies.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import replace

import pytest
import torch
from engine_harness import MODEL_SIZES, Event, Scenario, run_scenarios
from model_fixtures import TINY_SIZES, make_hot_experts

from dist_engine.distributed.spawn import run_multirank
from dist_engine.engine.request import Request
from dist_engine.engine.runner import ModelRunner
from dist_engine.models.loader import load_model
from dist_engine.models.make_model import make_tiny_checkpoint
from moe import ExpertPlacement
from scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence

pytestmark = pytest.mark.multirank

VOCAB = MODEL_SIZES["vocab_size"]
ENDED_NORMALLY = ("length", "stop")
DEADLINE_STEPS = 3  # short, so the scenarios cross many due points
SLEEP_WAKE_CYCLES = 100  # sleep/wake round trips, each landing at a random point of the descent


class Reference:
    """Greedy tokens from one rank with everything local (float64), computed once per
    (prompt, max_tokens)."""

    def __init__(self, model_dir: str) -> None:
        self.model = load_model(model_dir, dtype=torch.float64)
        self.eos = self.model.config.eos_token_ids
        self.cache: dict[tuple, list[int]] = {}

    def tokens(self, requests: list[tuple[tuple[int, ...], int]]) -> list[list[int]]:
        missing = sorted({r for r in requests if r not in self.cache})
        if missing:
            self._run(missing)
        return [self.cache[r] for r in requests]

    def _run(self, requests) -> None:
        config = SchedulerConfig(
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            max_model_len=256,
            block_size=4,
            num_blocks=8192,
        )
        self.model.attach_kv_cache(self.model.new_kv_cache(8192, 4))
        runner = ModelRunner(self.model, 4)
        sched = Scheduler(config)
        seqs = [
            Sequence(str(i), list(prompt), SamplingParams(max_tokens=m), eos_token_id=self.eos)
            for i, (prompt, m) in enumerate(requests)
        ]
        for seq in seqs:
            sched.add_sequence(seq)
        records = {seq.request_id: Request.admit(seq, stream=False) for seq in seqs}
        while sched.num_unfinished:
            outputs = sched.schedule()
            sched.process_outputs(outputs, runner.execute(outputs, records)[0])
        for request, seq in zip(requests, seqs, strict=True):
            self.cache[request] = seq.output_token_ids


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


# -- scenarios -------------------------------------------------------------------------------
def _prompt(rng: random.Random, low: int = 1, high: int = 40) -> tuple[int, ...]:
    return tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(low, high)))


def _add(rank, step, rid, rng, **kwargs) -> Event:
    low, high = kwargs.pop("length", (1, 40))
    return Event(rank, step, "add", rid, _prompt(rng, low, high), **kwargs)


def build_scenarios(world: int) -> list[Scenario]:
    rng = random.Random(world)
    scenarios = [
        Scenario(
            "all_on_one_rank",
            tuple(
                _add(0, 2 * i, f"one-{i}", rng, max_tokens=rng.randint(1, 16)) for i in range(12)
            ),
        ),
        Scenario(
            "staggered",
            tuple(_add(r, 0, f"long-{r}", rng, max_tokens=40, stream=True) for r in range(world))
            + tuple(
                _add(
                    rng.randrange(world),
                    rng.randint(3, 60),
                    f"st-{i}",
                    rng,
                    max_tokens=rng.randint(1, 12),
                )
                for i in range(20)
            ),
        ),
        Scenario(
            "unschedulable_head",
            (
                _add(1, 0, "held", rng, schedulable=False, max_tokens=5),
                _add(1, 0, "behind", rng, max_tokens=5),
                Event(1, 25, "release", "held"),
            )
            + tuple(_add(r, 2 + r, f"uh-{r}", rng, max_tokens=20) for r in range(world) if r != 1),
        ),
        Scenario(
            "dead_head",
            (
                _add(1, 0, "doomed", rng, schedulable=False),
                _add(1, 0, "after-doomed", rng, max_tokens=6),
                Event(1, 9, "abort", "doomed"),
            )
            + tuple(_add(r, 0, f"dh-long-{r}", rng, max_tokens=30) for r in range(world))
            + tuple(_add(r, 4, f"dh-new-{r}", rng, max_tokens=4) for r in range(world)),
        ),
        Scenario(
            "abort_storm",
            tuple(
                _add(r, 0, f"as-{r}-{i}", rng, length=(20, 60), max_tokens=12)
                for r in range(world)
                for i in range(4)
            )
            + tuple(
                Event(r, rng.randint(1, 30), "abort", f"as-{r}-{i}")
                for r in range(world)
                for i in range(4)
                if (r + i) % 2 == 0
            ),
            scheduler={"max_num_batched_tokens": 16},
        ),
        Scenario(
            "too_long_prompt",
            (Event(world - 1, 3, "add", "too-long", tuple(range(1, 202)), 4),)
            + tuple(_add(r, 3, f"tl-{r}", rng, max_tokens=4) for r in range(world - 1)),
        ),
    ]
    for stop in (True, False):
        name = "watermark_stop" if stop else "watermark_recompute"
        scenarios.append(
            Scenario(
                name,
                tuple(
                    _add(0, 0, f"{name}-big-{i}", rng, length=(30, 40), max_tokens=40)
                    for i in range(4)
                )
                + tuple(
                    _add(r, 6 + r, f"{name}-{r}-{i}", rng, max_tokens=6)
                    for r in range(1, world)
                    for i in range(2)
                ),
                scheduler={"stop_preempted_request": stop},
                # Rank 0's pool is small: its long requests fill it past the watermark, and
                # their growth forces preemption.
                rank_scheduler={0: {"num_blocks": 41}},
            )
        )
    scenarios.append(
        Scenario(
            "sleep_wake",
            tuple(
                Event(
                    rng.randrange(world),
                    0,
                    "cycle",
                    f"sw-{i}",
                    _prompt(rng, 1, 6),
                    delay_s=rng.choice([0.0, 0.0005, 0.001, 0.002, 0.004]),
                    cycle=i,
                )
                for i in range(SLEEP_WAKE_CYCLES)
            ),
        )
    )
    scenarios.append(
        Scenario(
            "eplb",
            tuple(
                _add(rng.randrange(world), rng.randint(0, 20), f"eplb-{i}", rng, max_tokens=12)
                for i in range(12)
            ),
            # Decisions every 3 forward steps on the last 6: rebalances mid-stream, commits
            # at their checks, through prefill, mixed, decode and sleeping steps.
            moe=eplb_settings(world, window_steps=6, interval_steps=3),
        )
    )
    scenarios.append(
        Scenario(
            "every_step_policy",
            tuple(
                _add(
                    rng.randrange(world),
                    rng.randint(0, 30),
                    f"es-{i}",
                    rng,
                    max_tokens=rng.randint(1, 10),
                )
                for i in range(16)
            ),
            sync_policy="every_step",
        )
    )
    return scenarios + [deadline_twin(s) for s in scenarios]


def eplb_settings(world: int, window_steps: int, interval_steps: int, source: str = "auto") -> dict:
    """EPLB with one redundant slot per rank (8 experts + world slots split evenly)."""
    return {
        "enable_eplb": True,
        "eplb_num_redundant_experts": world,
        "eplb_window_steps": window_steps,
        "eplb_interval_steps": interval_steps,
        "eplb_expert_source": source,
    }


def deadline_twin(scenario: Scenario) -> Scenario:
    return replace(
        scenario,
        name=f"{scenario.name}@deadline",
        sync_policy="deadline",
        scheduler={**scenario.scheduler, "prefill_deadline_steps": DEADLINE_STEPS},
    )


SOAK_REQUESTS = 300


def soak_scenario(world: int, num_requests: int = SOAK_REQUESTS) -> Scenario:
    rng = random.Random(99)
    events = []
    for i in range(num_requests):
        step = rng.randint(0, num_requests * 2 // 5)  # the arrival density of 1,000 over 400
        events.append(
            _add(
                rng.randrange(world),
                step,
                f"soak-{i}",
                rng,
                length=(1, 48),
                max_tokens=rng.randint(1, 16),
            )
        )
        if rng.random() < 0.1:
            events.append(Event(events[-1].rank, step + rng.randint(0, 20), "abort", f"soak-{i}"))
    return Scenario(
        "soak",
        tuple(events),
        scheduler={"max_num_seqs": 32, "num_blocks": 600},
        timeout_s=240.0,
    )


# -- checks ----------------------------------------------------------------------------------
def check_scenario(scenario: Scenario, per_rank: list[dict], reference: Reference) -> None:
    name = scenario.name
    # Every rank's failure at once: the first rank's often only names the one that gave up.
    failures = {rank: r["failure"] for rank, r in enumerate(per_rank) if r["failure"]}
    assert not failures, f"{name}: ranks failed: {failures}"
    # (a) exactly one terminal result per request, on the rank it was sent to
    events = [e for e in scenario.events if e.action in ("add", "cycle")]
    for event in events:
        out = per_rank[event.rank]["outputs"].get(event.request_id)
        assert out is not None, f"{name}: {event.request_id} never reported"
        assert out["num_terminal"] == 1, f"{name}: {event.request_id} {out}"
        if event.stream and out["reason"] in ENDED_NORMALLY:
            assert out["streamed"] == out["tokens"] and out["num_outputs"] > 1, name
    # (b) the same step kinds, attempt points and votes on every rank
    kinds = [[(s, k, p, v, a) for s, k, p, v, a, _ in r["trace"]] for r in per_rank]
    assert all(k == kinds[0] for k in kinds), f"{name}: ranks' traces differ"
    # ... and the same EPLB collectives and outcomes at the same steps, to the same maps
    assert all(r["eplb"] == per_rank[0]["eplb"] for r in per_rank), f"{name}: EPLB differs"
    assert all(r["phy2log"] == per_rank[0]["phy2log"] for r in per_rank), name
    # (c) tokens equal the single-rank reference
    ran = [
        (e, per_rank[e.rank]["outputs"][e.request_id])
        for e in events
        if per_rank[e.rank]["outputs"][e.request_id]["reason"] in ENDED_NORMALLY
    ]
    expected = reference.tokens(
        [(e.prompt, 1 if e.action == "cycle" else e.max_tokens) for e, _ in ran]
    )
    for (event, out), tokens in zip(ran, expected, strict=True):
        assert out["tokens"] == tokens, f"{name}: {event.request_id} differs from the reference"
    # (d) the policy never starves a wanted prefill
    config = scenario.scheduler_config(0)
    if config.sync_policy == "deadline":
        _check_deadline(name, config.prefill_deadline_steps, per_rank[0]["trace"])
        return
    unvoted = 0
    for step, kind, point, view, any_scheduled, _ in per_rank[0]["trace"]:
        if view is None:
            unvoted += 1
            assert unvoted < config.prefill_attempt_interval, f"{name}: no vote by step {step}"
            continue
        unvoted = 0
        all_want, any_want, none_running, *_ = view
        wanted = any_want if point in ("any", "idle", "every") or none_running else all_want
        if wanted:
            assert kind == "prefill" or any_scheduled is False, f"{name}: step {step} starved"


def _check_deadline(name: str, deadline: int, trace: list) -> None:
    unvoted = 0
    for step, kind, point, view, any_scheduled, _ in trace:
        if view is None:
            unvoted += 1
            assert unvoted < deadline, f"{name}: no vote by step {step}"
            assert kind != "prefill", f"{name}: step {step} prefilled without a vote"
            continue
        unvoted = 0
        _, _, none_running, _, all_ready, max_wait, any_backlog = view
        assert max_wait <= deadline, f"{name}: step {step}: a ready head sat out {max_wait}"
        if none_running:
            due = max_wait >= 0
        else:
            due = max_wait >= deadline or all_ready or (point == "follow" and any_backlog)
        if due:
            assert kind == "prefill" or any_scheduled is False, f"{name}: step {step} starved"
        else:
            assert kind != "prefill", f"{name}: step {step} prefilled with nothing due"


# -- EPLB while serving ------------------------------------------------------------------------
# Experts 6 and 7 (of group 1) get most tokens: the rank holding them does most of the expert
# work until EPLB replicates them.
HOT_EXPERTS = {6: 0.3, 7: 0.15}


@pytest.fixture(scope="module")
def hot_deepseek_dir(tmp_path_factory) -> str:
    """DeepSeek-V3 (3 layers, 2 of them MoE) whose selection bias makes two experts hot."""
    out = tmp_path_factory.mktemp("deepseek-v3-hot")
    make_tiny_checkpoint("deepseek_v3", out, seed=7, num_layers=3, **TINY_SIZES)
    return str(make_hot_experts(out, HOT_EXPERTS))


def eplb_scenarios(world: int, model_dir: str, rank1_copy: str | None) -> list[Scenario]:
    """On `model_dir`, the same requests without EPLB, with it (decisions every 4 forward
    steps, while every request is decoding) with new experts read from the checkpoint and
    with them sent by peers, and (given a copy of the checkpoint for rank 1 to lose) with
    rank 1's staging failing."""
    rng = random.Random(300 + world)
    events = tuple(
        _add(r, 0, f"ep-{r}-{i}", rng, length=(4, 24), max_tokens=24)
        for r in range(world)
        for i in range(3)
    ) + tuple(_add(r, 10, f"ep-late-{r}", rng, max_tokens=10) for r in range(world))
    eplb = eplb_settings(world, window_steps=8, interval_steps=4, source="checkpoint")
    peers = eplb_settings(world, window_steps=8, interval_steps=4, source="peer")
    scenarios = [
        Scenario("eplb_off", events, model_dir=model_dir),
        Scenario("eplb_on", events, moe=eplb, model_dir=model_dir),
        Scenario("eplb_on_peer", events, moe=peers, model_dir=model_dir),
    ]
    if rank1_copy is not None:
        scenarios.append(
            Scenario(
                "eplb_staging_fails",
                (Event(1, 1, "remove_checkpoint"), *events),
                moe=eplb,
                model_dir=model_dir,
                rank_model_dir={1: rank1_copy},
            )
        )
    return scenarios


@pytest.fixture(scope="module", params=[2, 4], ids=["2", "4"])
def group_runs(request, model_dir, hot_deepseek_dir, tmp_path_factory) -> dict:
    """One DP group of each size runs the deadlock suite and the EPLB scenarios on the skewed
    DeepSeek-V3 (process start-up is most of a group's cost): world, scenarios and each
    rank's results."""
    world = request.param
    rank1_copy = None
    if world == 2:
        copies = tmp_path_factory.mktemp("rank1-checkpoint")
        rank1_copy = str(shutil.copytree(hot_deepseek_dir, copies / "deepseek-v3-hot"))
    suite = build_scenarios(world)
    if world > 2:  # the default policy only: DP = 2 covers `vote` (the suite's cost is CPU)
        suite = [s for s in suite if s.sync_policy == "deadline" or s.name == "every_step_policy"]
        # The soak, under both policies, in the same group (a group's start-up is seconds).
        suite += [soak_scenario(world), deadline_twin(soak_scenario(world))]
    eplb = eplb_scenarios(world, hot_deepseek_dir, rank1_copy)
    results = run_multirank(world, run_scenarios, (model_dir, suite + eplb), timeout_s=420)
    return {"world": world, "suite": suite, "eplb": eplb, "results": results}


def test_vote_deadlock_scenarios(group_runs, reference):
    world, scenarios, results = group_runs["world"], group_runs["suite"], group_runs["results"]
    for scenario in scenarios:
        check_scenario(scenario, [r[scenario.name] for r in results], reference)
    walls = {s.name: results[0][s.name]["wall_s"] for s in scenarios}
    twins = sum(wall for name, wall in walls.items() if name.endswith("@deadline"))
    print(f"DP={world}: scenarios {sum(walls.values()):.1f} s, of which @deadline {twins:.1f} s")
    # Scenario-specific facts, so each scenario provably exercised its hazard, per policy.
    names = {s.name for s in scenarios}
    suffixes = ("", "@deadline") if "sleep_wake" in names else ("@deadline",)
    for suffix in suffixes:
        by_name = {s.name: [r[s.name] for r in results] for s in scenarios}
        by_name = {n[: len(n) - len(suffix)]: v for n, v in by_name.items() if n.endswith(suffix)}
        assert by_name["too_long_prompt"][world - 1]["outputs"]["too-long"]["reason"] == (
            "prompt_length_exceeded"
        )
        assert by_name["dead_head"][1]["outputs"]["doomed"]["reason"] == "abort"
        stop_reasons = {o["reason"] for o in by_name["watermark_stop"][0]["outputs"].values()}
        assert "insufficient_system_resource" in stop_reasons, suffix
        assert by_name["watermark_recompute"][0]["num_preemptions"] > 0, suffix
        aborted = {o["reason"] for r in by_name["abort_storm"] for o in r["outputs"].values()}
        assert "abort" in aborted, suffix
        latencies = sorted(x for r in by_name["sleep_wake"] for x in r["latencies"])
        assert len(latencies) == SLEEP_WAKE_CYCLES
        # A wake that missed its bump would sit out the sleeper's 60 s poll; a loaded host
        # stretches a healthy round trip to tens of milliseconds, never to seconds.
        assert latencies[-1] < 5.0, f"{suffix}: a wake took {latencies[-1]:.1f} s"
        slept = sum(1 for _, kind, *_ in by_name["sleep_wake"][0]["trace"] if kind == "empty")
        assert slept > 0, suffix
        assert "decided" in by_name["eplb"][0]["eplb"], suffix
    for name in ("soak", "soak@deadline"):  # DP = 4: 300 requests, some aborted
        if name in names:
            reasons = [o["reason"] for r in results for o in r[name]["outputs"].values()]
            assert len(reasons) == SOAK_REQUESTS and reasons.count("abort") > 0, name


def test_a_group_of_one_sleeps_and_wakes_in_its_process(model_dir, reference):
    """DP=1 with a process group, as under the Ray and torchrun launchers: the sleep/wake
    round trips under both policies, each request waking the sleeping rank at once, through
    a wake held in the process (no store round trips per request), and the two groups of
    DP=2 keep the store's."""
    (sleep_wake,) = [s for s in build_scenarios(1) if s.name == "sleep_wake"]
    scenarios = [sleep_wake, deadline_twin(sleep_wake)]
    (result,) = run_multirank(1, run_scenarios, (model_dir, scenarios), timeout_s=300)
    for scenario in scenarios:
        check_scenario(scenario, [result[scenario.name]], reference)
        assert result[scenario.name]["wake"] == "LocalWake", scenario.name
        latencies = sorted(result[scenario.name]["latencies"])
        assert len(latencies) == SLEEP_WAKE_CYCLES and latencies[-1] < 5.0, latencies[-3:]
        slept = sum(1 for _, kind, *_ in result[scenario.name]["trace"] if kind == "empty")
        assert slept > 0, scenario.name


def test_groups_of_more_wake_through_their_store(group_runs):
    name = "sleep_wake@deadline"
    assert {r[name]["wake"] for r in group_runs["results"]} == {"StoreWake"}


def test_eplb_rebalances_mid_stream_with_unchanged_tokens(group_runs, hot_deepseek_dir):
    """A skewed router at DP = 2 and 4: EPLB moves experts while every request decodes, every
    rank adopts the same maps at the same step, balance improves, and the greedy tokens equal
    the single-rank reference's (as without EPLB). At DP = 2, a rank whose checkpoint vanished
    fails every staging: the group keeps its placement and serves on."""
    world, scenarios, results = group_runs["world"], group_runs["eplb"], group_runs["results"]
    reference = Reference(hot_deepseek_dir)
    for scenario in scenarios:
        check_scenario(scenario, [r[scenario.name] for r in results], reference)
    walls = {s.name: round(results[0][s.name]["wall_s"], 1) for s in scenarios}
    print(f"DP={world}: EPLB scenarios {walls} s")
    initial = [ExpertPlacement.with_redundancy(8, world, world).phy2log.tolist()] * 2
    for name, source in (("eplb_on", "checkpoint"), ("eplb_on_peer", "peer")):
        on = results[0][name]
        adopted = [i for i, event in enumerate(on["eplb"]) if event == "adopted"]
        assert adopted, (name, on["eplb"])
        assert on["phy2log"] != initial
        # Mid-stream: every rank still had requests running in the step after the first swap.
        for r in range(world):
            assert results[r][name]["trace"][adopted[0] + 1][5] > 0, (name, r)
        stats = [r[name]["expert_stats"] for r in results]
        assert all(s.num_rebalances == stats[0].num_rebalances >= 1 for s in stats), stats
        first = stats[0]
        before, after = first.last_balancedness_before, first.last_balancedness_after
        assert sum(after) > sum(before), first
        assert sum(s.last_bytes for s in stats) > 0 and first.last_pause_s > 0.0
        assert all(s.expert_source == source for s in stats), stats
        received = sum(s.last_received_bytes for s in stats)
        # Peers sent every expert new to a rank; the checkpoint's ranks received nothing.
        if source == "peer":
            assert received == sum(s.last_staged_bytes for s in stats) > 0, stats
            assert all(s.peer_bytes_per_s > 0 and s.checkpoint_bytes_per_s > 0 for s in stats)
        else:
            assert received == 0, stats
    if world == 2:
        failing = [r["eplb_staging_fails"] for r in results]
        assert failing[0]["phy2log"] == initial  # nothing was ever adopted
        assert "dropped" in failing[0]["eplb"] and "adopted" not in failing[0]["eplb"]
        assert all(r["expert_stats"].num_failed >= 1 for r in failing)
        assert all(r["expert_stats"].num_rebalances == 0 for r in failing)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("deepseek-v3")
    return str(make_tiny_checkpoint("deepseek_v3", out, seed=5, num_layers=2, **TINY_SIZES))


# Rank 0's small pool fills past the watermark and preempts with recompute while rank 1
# keeps prefilling: latent entries written, freed and rewritten, under both step kinds.
DEEPSEEK_SCENARIOS = ("watermark_recompute",)


def test_scenarios_on_deepseek_v3(deepseek_dir):
    """The protocol with MLA (latent cache), sigmoid grouped routing and shared experts in the
    model: DP = 2 with EP over both ranks, against a single-rank reference."""
    scenarios = [s for s in build_scenarios(2) if s.name in DEEPSEEK_SCENARIOS]
    results = run_multirank(2, run_scenarios, (deepseek_dir, scenarios), timeout_s=300)
    reference = Reference(deepseek_dir)
    for scenario in scenarios:
        check_scenario(scenario, [r[scenario.name] for r in results], reference)
    assert results[0]["watermark_recompute"]["num_preemptions"] > 0
