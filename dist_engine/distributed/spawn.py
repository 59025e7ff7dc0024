"""Run a function on every rank of a real multi-process gloo group, and never hang doing it.

    results = run_multirank(world_size, fn, args, timeout_s=60)

`fn(rank, world_size, *args)` runs in a fresh spawned process after the default process group
is initialised (gloo, rendezvous through a TCPStore that the parent owns on a free port; inside
`fn`, `current_store()` is this rank's client of it). Its return value comes back by value
(`torch.save`, so tensors are fine). If any rank raises, the parent raises a RuntimeError
carrying every failed rank's traceback; if a rank dies silently or the whole run passes
`timeout_s`, the survivors are killed and the error names the ranks involved.

The tests' multi-rank cases and the benchmarks that spawn groups (scripts/bench_sync.py) use
this one harness. `fn` must be importable by the children (a module-level function).
"""

from __future__ import annotations

import gc
import io
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_POLL_S = 0.2
_STORE: dist.Store | None = None  # the child's client of the parent's TCPStore
# After the first failure, how long to wait for the other ranks' reports (on gloo a peer's error
# usually follows well within it: docs/benchmark_notes.md, "Start-up and failure detection") so
# the message shows every traceback, not only the first.
_ERROR_GRACE_S = 2.0
# After every rank reported, how long they get to leave the group on their own: killing one
# mid-teardown makes its peers' gloo threads fail (std::terminate) while they still exit.
_EXIT_GRACE_S = 15.0


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    group_timeout_s: float,
    num_threads: int,
    cpu_binding: bool,
) -> None:
    try:
        torch.set_num_threads(num_threads)
        if cpu_binding:  # as the launchers do by default (parallel.cpu_binding)
            from dist_engine.distributed.cpu_binding import bind_process

            bind_process(rank, world_size, num_threads)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        global _STORE
        _STORE = store
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=group_timeout_s),
        )
        value = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        del value
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Free the groups now (whatever `fn` built may hold them): at interpreter exit a gloo
        # thread that needs the GIL aborts the process (see TorchrunClient.shutdown).
        gc.collect()


def current_store() -> dist.Store:
    """Inside `fn`: this rank's client of the group's TCPStore."""
    assert _STORE is not None, "current_store() is only available inside run_multirank's fn"
    return _STORE


def _context() -> Any:
    """Children fork from a server that imported torch once for this process (torch's import
    is most of a child's start-up, seconds on a small host); the server itself initialises
    nothing (no threads, no device), so a fork of it is as clean as a spawned interpreter."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "dist_engine.distributed.spawn"])
    return ctx


def run_multirank(
    world_size: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    timeout_s: float = 60.0,
    group_timeout_s: float = 60.0,
    num_threads: int | None = None,
    may_exit: frozenset[int] = frozenset(),
    cpu_binding: bool = False,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` child processes (forked from a server
    that imported torch; see `_context`); return results by rank.

    timeout_s: hard limit for the whole run (start-up included); children are killed after it.
    group_timeout_s: the process group's collective timeout.
    num_threads: torch threads per child (default: CPU cores // world_size, at least 1).
    may_exit: ranks allowed to exit without reporting (a test that kills them); their result is
    None.
    cpu_binding: pin each child to its own cores, as the launchers pin ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if num_threads is None:
        num_threads = max(1, (os.cpu_count() or 1) // world_size)
    # The parent owns the store so the port is free by construction (port 0 = pick one);
    # wait_for_workers=False, or the constructor would block until the children connect.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    ctx = _context()
    results = ctx.Queue()
    settings = (results, group_timeout_s, num_threads, cpu_binding)
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, store.port, fn, args, *settings),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    clean = False
    try:
        reports = _collect(procs, results, timeout_s, may_exit)
        clean = True
    finally:
        if clean:
            deadline = time.monotonic() + _EXIT_GRACE_S
            for proc in procs:
                proc.join(timeout=max(0.1, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=5)
    return [
        None if reports[rank] is None else torch.load(io.BytesIO(reports[rank]), weights_only=False)
        for rank in range(world_size)
    ]


def _collect(
    procs: list[Any], results: Any, timeout_s: float, may_exit: frozenset[int] = frozenset()
) -> dict[int, bytes | None]:
    """Wait for one report per rank; raise on any error, a silent death or the deadline."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout_s
    payloads: dict[int, bytes | None] = {}
    errors: dict[int, str] = {}
    exited_at: dict[int, float] = {}  # ranks seen exited without a report yet
    stop_at = deadline
    while len(payloads) + len(errors) < world_size:
        now = time.monotonic()
        if now > stop_at:
            break
        try:
            rank, status, payload = results.get(timeout=_POLL_S)
        except queue.Empty:
            _note_silent_deaths(procs, payloads, errors, exited_at, may_exit)
            if errors:
                stop_at = min(stop_at, time.monotonic() + _ERROR_GRACE_S)
            continue
        if status == "ok":
            payloads[rank] = payload
        else:
            errors[rank] = payload
            stop_at = min(stop_at, time.monotonic() + _ERROR_GRACE_S)
    if errors:
        details = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(errors.items()))
        raise RuntimeError(f"ranks {sorted(errors)} of {world_size} failed:\n{details}")
    if len(payloads) < world_size:
        missing = sorted(set(range(world_size)) - payloads.keys())
        raise TimeoutError(
            f"multirank run timed out after {timeout_s} s; ranks {missing} of {world_size} "
            "never reported"
        )
    return payloads


def _note_silent_deaths(
    procs: list[Any],
    payloads: dict[int, bytes | None],
    errors: dict[int, str],
    exited_at: dict[int, float],
    may_exit: frozenset[int] = frozenset(),
) -> None:
    """Turn a rank that exited without reporting into an error, after a moment's grace: its
    report may still be in the pipe if it exited right after sending it."""
    now = time.monotonic()
    for rank, proc in enumerate(procs):
        if rank in payloads or rank in errors or proc.exitcode is None:
            continue
        exited_at.setdefault(rank, now)
        if now - exited_at[rank] > 1.0:
            if rank in may_exit:
                payloads[rank] = None
            else:
                errors[rank] = f"exited with code {proc.exitcode} without reporting\n"
