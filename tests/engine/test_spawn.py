"""The spawn helper itself: results by rank, and no hang when a rank fails, dies or stalls."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from dist_engine.distributed.spawn import run_multirank


def failing_worker(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("rank one is broken")
    if rank == 2:
        os._exit(3)  # dies without a report
    dist.barrier()  # would wait for the others until the group timeout; the helper must not
    return rank


def stalling_worker(rank: int, world_size: int) -> int:
    time.sleep(60)
    return rank


@pytest.mark.multirank
def test_failing_and_dead_ranks_are_named() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError) as excinfo:
        run_multirank(3, failing_worker, timeout_s=60, group_timeout_s=60)
    message = str(excinfo.value)
    assert "--- rank 1 ---" in message and "rank one is broken" in message, message
    assert "--- rank 2 ---\nexited with code 3 without reporting" in message, message
    assert time.monotonic() - start < 30
    assert not mp.active_children()


@pytest.mark.multirank
def test_stalled_ranks_are_killed_at_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 never reported"):
        run_multirank(2, stalling_worker, timeout_s=4)
    assert time.monotonic() - start < 15
    assert not mp.active_children()
