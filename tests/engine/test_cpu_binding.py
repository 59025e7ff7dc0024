"""Pinning CPU ranks to their own cores: the split, the pinning itself, and the config switch."""

from __future__ import annotations

import os
import threading

import pytest
import torch.multiprocessing as mp

from dist_engine.distributed.cpu_binding import bind_process, cores_for
from dist_engine.engine.config import EngineConfig


def test_cores_are_split_into_disjoint_runs_in_rank_order() -> None:
    available = [5, 1, 3, 7, 2, 6]  # any order, any ids: the process's affinity
    assert cores_for(0, 2, 3, available) == [1, 2, 3]
    assert cores_for(1, 2, 3, available) == [5, 6, 7]
    assert cores_for(2, 3, 2, available) == [6, 7]
    assert cores_for(0, 1, 1, available) == [1]


def test_nothing_is_pinned_when_the_ranks_do_not_fit() -> None:
    assert cores_for(0, 4, 1, [0, 1]) == []  # 4 ranks, 2 cores: oversubscribed
    assert cores_for(1, 2, 2, [0, 1, 2]) == []  # 2 ranks x 2 threads > 3 cores
    with pytest.raises(ValueError, match=r"local_rank=2, local_world=2"):
        cores_for(2, 2, 1, [0, 1])
    with pytest.raises(ValueError, match=r"threads=0"):
        cores_for(0, 1, 0, [0, 1])


def _bind_and_report(local_rank: int, local_world: int, queue) -> None:
    pinned = bind_process(local_rank, local_world, 1)
    seen: list[list[int]] = []
    thread = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
    thread.start()
    thread.join()
    queue.put((pinned, sorted(os.sched_getaffinity(0)), seen[0]))


@pytest.mark.multirank
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity here")
def test_bind_process_pins_every_thread_of_the_process() -> None:
    """In a child process (pinning the test runner would slow every later test)."""
    available = sorted(os.sched_getaffinity(0))
    context = mp.get_context("spawn")
    queue = context.Queue()
    last = len(available) - 1
    child = context.Process(target=_bind_and_report, args=(last, len(available), queue))
    child.start()
    pinned, main_thread, new_thread = queue.get(timeout=60)
    child.join(timeout=60)
    assert pinned == main_thread == new_thread == [available[-1]]
    oversubscribed = context.Process(target=_bind_and_report, args=(0, len(available) + 1, queue))
    oversubscribed.start()
    pinned, main_thread, _ = queue.get(timeout=60)
    oversubscribed.join(timeout=60)
    assert pinned == [] and main_thread == available


def test_cpu_binding_is_a_bool_setting() -> None:
    assert EngineConfig(model="m").parallel.cpu_binding is True
    assert EngineConfig(model="m").with_overrides(cpu_binding=False).parallel.cpu_binding is False
    with pytest.raises(ValueError, match=r"parallel.cpu_binding must be true or false, got 'no'"):
        EngineConfig(model="m").with_overrides(cpu_binding="no")
