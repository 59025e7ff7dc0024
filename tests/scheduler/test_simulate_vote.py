"""scripts/simulate_vote.py at N=8 on a tiny workload: the accounting and the protocol checks."""

import importlib.util
import sys
from pathlib import Path

import pytest

from scheduler import SchedulerConfig

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "simulate_vote.py"


def _load_script():
    # scripts/ is not a package; dataclasses need the module registered while it executes.
    spec = importlib.util.spec_from_file_location("simulate_vote", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


sim = _load_script()

# Short intervals so that a few hundred steps cross many ALL, ANY and drain points.
CONFIG = SchedulerConfig(
    max_num_seqs=8,
    max_num_batched_tokens=256,
    max_model_len=512,
    block_size=8,
    num_blocks=128,
    prefill_attempt_interval=7,
    prefill_any_attempt_interval=10,
    sync_policy="vote",
)
SPEC = sim.WorkloadSpec(
    requests_per_rank=3, duration_ms=400.0, prompt_len=(8, 96), max_tokens=(2, 30), bursts=3
)


@pytest.mark.parametrize("workload", sim.WORKLOADS)
def test_simulation_invariants_at_n8(workload):
    requests = sim.make_workload(workload, 8, SPEC)
    runs = {
        policy: sim.simulate(8, workload, policy, requests, CONFIG, sim.CostModel())
        for policy in sim.POLICIES
    }
    for run in runs.values():
        assert set(run.finish_counts) == {req.request_id for req in requests}
        assert set(run.finish_counts.values()) == {1}, "a request was reported twice"
        assert run.steps_checked == run.metrics["steps"] > 0, "ranks disagreed on a step"
        assert 0.0 <= run.metrics["idle_rank_frac"] <= run.metrics["placeholder_frac"] <= 1.0
        assert len(run.ttft_ms) == len(requests)
        assert min(run.ttft_ms) >= 0.0
        assert run.metrics["output_tokens"] == sum(req.max_tokens for req in requests)
    every, vote = runs["every_step+separate"].metrics, runs["vote"].metrics
    assert every["collectives_per_step"] >= max(1.0, vote["collectives_per_step"])
    # The deadline policy bounds TTFT in steps (every request here is ready at intake): the
    # deadline, the prefill step, and one more for a request behind a full prompt batch.
    # Mixed steps change what a prefill step carries, not when the group takes one.
    for name in ("deadline+separate", "deadline+mixed"):
        deadline = runs[name].metrics
        assert deadline["ttft_steps_p99"] <= CONFIG.deadline_steps + 2, name
        assert 0.0 <= deadline["itl_interrupted_frac"] <= 1.0
        assert deadline["itl_ms_max"] >= deadline["itl_ms_p99"]
    (check,) = sim.goal_check(list(runs.values()))
    assert check["policy"] == "deadline+mixed"
    assert check["workload"] == workload and check["num_ranks"] == 8
    assert sim.markdown_table(list(runs.values())).count("\n") == 1 + len(runs)


def _cell(policy: str, num_ranks: int, ttft: float, itl: float, tok_s: float, placeholder: float):
    metrics = dict(
        ttft_ms_p99=ttft, itl_ms_p99=itl, throughput_tok_s=tok_s, placeholder_frac=placeholder
    )
    return sim.RunResult(num_ranks, "uniform", policy, metrics=metrics)


def test_goal_check_on_hand_worked_cells():
    """The issue's goals (TTFT p99 <= 1.25x every_step+separate's, ITL p99 <= 1.1x vote's,
    throughput >= the better of the two, placeholders <= the better of the two), on metrics
    chosen so each verdict is known, both sides of each bound and on it."""
    runs = [
        # N = 8: TTFT 120 / 100 = 1.2 met; ITL 12 / 10 = 1.2 missed; 1000 tok/s against the
        # better 950 met; placeholders 0.30 against the better 0.25 missed by 0.05.
        _cell("vote", 8, ttft=900, itl=10, tok_s=900, placeholder=0.25),
        _cell("every_step+separate", 8, ttft=100, itl=60, tok_s=950, placeholder=0.40),
        _cell("deadline+mixed", 8, ttft=120, itl=12, tok_s=1000, placeholder=0.30),
        # N = 64, every value on its bound or past it the other way: TTFT 250 / 200 = 1.25 met;
        # ITL 22 / 20 = 1.1 met; 940 tok/s against the better 950 missed; placeholders equal
        # to the better (vote's 0.10) met.
        _cell("vote", 64, ttft=900, itl=20, tok_s=950, placeholder=0.10),
        _cell("every_step+separate", 64, ttft=200, itl=90, tok_s=800, placeholder=0.20),
        _cell("deadline+mixed", 64, ttft=250, itl=22, tok_s=940, placeholder=0.10),
        # N = 256 has no every_step+separate run: nothing to compare against, no check.
        _cell("vote", 256, ttft=900, itl=10, tok_s=900, placeholder=0.25),
        _cell("deadline+mixed", 256, ttft=120, itl=12, tok_s=1000, placeholder=0.30),
    ]
    light, heavy = sim.goal_check(runs)
    assert (light["num_ranks"], heavy["num_ranks"]) == (8, 64)
    assert light["ttft_p99_vs_every_step"] == pytest.approx(1.2) and light["ttft_met"]
    assert light["itl_p99_vs_vote"] == pytest.approx(1.2) and not light["itl_met"]
    assert light["throughput_vs_best"] == pytest.approx(1000 / 950) and light["throughput_met"]
    assert light["placeholder_vs_best"] == pytest.approx(0.05) and not light["placeholder_met"]
    assert heavy["ttft_p99_vs_every_step"] == pytest.approx(1.25) and heavy["ttft_met"]
    assert heavy["itl_p99_vs_vote"] == pytest.approx(1.1) and heavy["itl_met"]
    assert heavy["throughput_vs_best"] == pytest.approx(940 / 950)
    assert not heavy["throughput_met"]
    assert heavy["placeholder_vs_best"] == pytest.approx(0.0) and heavy["placeholder_met"]
    # Another policy is judged by the same goals against the same two.
    (other,) = sim.goal_check(runs[:3], policy="every_step+separate")
    assert other["ttft_p99_vs_every_step"] == pytest.approx(1.0) and other["ttft_met"]
    assert other["itl_p99_vs_vote"] == pytest.approx(6.0) and not other["itl_met"]


def test_mixed_step_cost_adds_prompt_tokens_to_the_decode_step():
    cost = sim.CostModel(a=5.0, b=0.5, c=8.0, d=0.25, v=0.0)
    mixed = sim.SchedulerOutputs(True, [], [], 9, num_decode_seqs=4)  # 5 prompt + 4 decode
    alone = sim.SchedulerOutputs(True, [], [], 6)  # a rank with prompt tokens only
    assert cost.step_ms("prefill", [mixed, alone], 0) == pytest.approx(8.0 + max(1 + 2.5, 3))
    assert cost.step_ms("prefill", [alone, alone], 0) == pytest.approx(5.0 + 3)


def test_policy_variants_set_the_step_kind():
    config = sim.policy_variant(CONFIG, "deadline+separate")
    assert config.sync_policy == "deadline" and not config.mixed
    assert sim.policy_variant(CONFIG, "every_step+mixed").mixed
    assert not sim.policy_variant(CONFIG, "vote").mixed
    with pytest.raises(ValueError, match="unknown policy variant"):
        sim.policy_variant(CONFIG, "vote+mixed")


def test_driver_reports_diverged_step_state():
    with sim.LockstepDriver(4, CONFIG) as driver:
        driver.step()
        driver.ranks[2].sched.decode_step += 1  # one rank's counter drifts
        with pytest.raises(sim.LockstepError, match="different step-policy state"):
            driver.step()
