"""Pin each CPU rank to its own cores, so ranks that share a host stop trading cores.

A DP group on CPU runs one process per rank, and every MoE layer ends in an all-to-all that
waits for the slowest rank. Left to the OS scheduler, the rank processes (and their helper
threads: gloo, Ray) migrate between cores and preempt each other, so some rank is always late.
Pinned, two ranks on a 2-core machine ran shorter decode steps and waited far less in each
all-to-all for the last rank to arrive (docs/benchmark_notes.md, "End to end", "Pinning").

The cores a host offers (this process's affinity) are split into consecutive runs of `threads`
cores, one run per rank on the host, in local-rank order. If the ranks do not fit
(oversubscribed: local ranks x threads > cores) nothing is pinned, because overlapping pins
would be worse than none. vLLM's CPU backend binds its workers the same way.

Used by both launchers (`parallel.cpu_binding`, on by default): the Ray actors and the torchrun
processes (LOCAL_RANK of LOCAL_WORLD_SIZE) pin themselves before joining the process group, so
gloo's threads inherit the pin. Two groups on one host pin to the same cores: set
`cpu_binding: false` where ranks of several groups share a machine.
"""

from __future__ import annotations

import os


def cores_for(local_rank: int, local_world: int, threads: int, available: list[int]) -> list[int]:
    """The cores local rank `local_rank` of `local_world` ranks on a host should use: a disjoint
    run of `threads` of `available` (sorted), or [] when the ranks do not all fit."""
    if not 0 <= local_rank < local_world or threads < 1:
        raise ValueError(
            f"need 0 <= local_rank < local_world and threads >= 1, got local_rank={local_rank}, "
            f"local_world={local_world}, threads={threads}"
        )
    if local_world * threads > len(available):
        return []
    ordered = sorted(available)
    return ordered[local_rank * threads : (local_rank + 1) * threads]


def bind_process(local_rank: int, local_world: int, threads: int) -> list[int]:
    """Pin every thread of this process (and, by inheritance, every later one) to this rank's
    cores. Returns the cores, or [] where nothing was pinned (ranks do not fit, or the platform
    has no `sched_setaffinity`)."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    cores = cores_for(local_rank, local_world, threads, list(os.sched_getaffinity(0)))
    if not cores:
        return []
    for thread_id in _thread_ids():
        try:
            os.sched_setaffinity(thread_id, cores)
        except OSError:  # a thread that ended meanwhile
            continue
    return cores


def _thread_ids() -> list[int]:
    """Linux: every thread of this process (the affinity call works per thread)."""
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
