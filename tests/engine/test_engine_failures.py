"""A rank that dies mid-run, and ranks started with settings that disagree (real gloo groups)."""

from __future__ import annotations

import random
import re
import time

import pytest
from engine_harness import Event, Scenario, run_scenarios

from dist_engine.distributed.spawn import run_multirank

pytestmark = pytest.mark.multirank


def _adds(world: int, rng: random.Random) -> tuple[Event, ...]:
    return tuple(
        Event(r, 0, "add", f"r{r}-{i}", tuple(rng.randrange(1, 300) for _ in range(8)), 60)
        for r in range(world)
        for i in range(3)
    )


@pytest.mark.parametrize("world", [2, 4])
def test_killed_rank_fails_the_group_fast_and_every_request_ends(world, model_dir):
    victim = world - 1
    scenario = Scenario(
        "kill", _adds(world, random.Random(world)) + (Event(victim, 12, "kill"),), timeout_s=60
    )
    start = time.monotonic()
    results = run_multirank(
        world, run_scenarios, (model_dir, [scenario]), timeout_s=120, may_exit=frozenset({victim})
    )
    elapsed = time.monotonic() - start
    assert results[victim] is None
    for rank in range(world - 1):
        result = results[rank]["kill"]
        assert any(f"rank {victim} stopped answering" in f for f in result["failure"]), result[
            "failure"
        ]
        for i in range(3):
            out = result["outputs"][f"r{rank}-{i}"]
            assert out["num_terminal"] == 1
            assert re.match(rf"error: .*rank {victim} stopped answering", out["reason"]), out
    # Well inside the 20 s collective timeout: a dead gloo peer fails the next collective.
    assert elapsed < 60


@pytest.mark.parametrize("world", [2, 4])
def test_mismatched_settings_refuse_to_start_naming_the_key(world, model_dir):
    scenario = Scenario(
        "mismatch", _adds(world, random.Random(1)), rank_scheduler={1: {"block_size": 8}}
    )
    with pytest.raises(RuntimeError) as info:
        run_multirank(world, run_scenarios, (model_dir, [scenario]), timeout_s=120)
    message = str(info.value)
    # Every rank refuses, and says which key differs and what each rank had.
    assert message.count("SettingsMismatchError: ranks were started with settings") == world
    assert "scheduler.block_size (rank 0=4, rank 1=8" in message
