"""The shared-memory all-to-all (dist_engine/shm_exchange.py) in real multi-process groups.

Every result is compared with gloo's `all_to_all_single` on the same inputs, in the same
processes. Failure rules are checked as the engine relies on them: a peer that diverges, stays
away past the timeout or exits makes every waiting rank raise with a message naming it, fast.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_engine.distributed import shm_exchange
from dist_engine.distributed.shm_exchange import SharedMemoryExchange, open_shared_memory_exchange
from dist_engine.distributed.spawn import run_multirank
from dist_engine.engine.config import ParallelConfig
from scheduler import StepKind

pytestmark = pytest.mark.multirank

SMALL_SLOT = 4096  # forces multi-chunk messages through the two-slot pipeline


def equal_to_gloo_worker(rank: int, world: int) -> dict:
    exchanges = {
        "default": open_shared_memory_exchange(dist.group.WORLD, "shared_memory", timeout_s=30),
        "small_slots": open_shared_memory_exchange(
            dist.group.WORLD, "shared_memory", timeout_s=30, slot_bytes=SMALL_SLOT
        ),
    }
    dist.barrier()
    assert all(e.path.startswith("/dev/shm/lockstep-") for e in exchanges.values())
    leftover = [e.path for e in exchanges.values() if Path(e.path).exists()]
    checked = 0
    for name, exchange in exchanges.items():
        assert isinstance(exchange, SharedMemoryExchange)
        for step in range(12):
            gen = torch.Generator().manual_seed(step)  # the same split matrix on every rank
            counts = torch.randint(0, 700, (world, world), generator=gen)
            if step % 3 == 0:
                counts[:, step % world] = 0  # a rank that receives nothing
            if step % 4 == 1:
                counts[step % world, :] = 0  # a rank that sends nothing
            if step == 5:
                counts.zero_()
            dtype = (torch.float32, torch.int64, torch.bfloat16, torch.uint8)[step % 4]
            width = (33, 1, 7, 260)[step % 4]
            send_splits = counts[rank].tolist()
            recv_splits = counts[:, rank].tolist()
            data_gen = torch.Generator().manual_seed(100 * step + rank)
            send = (torch.randn(sum(send_splits), width, generator=data_gen) * 50).to(dtype)
            got = torch.full((sum(recv_splits), width), 7, dtype=dtype)
            want = torch.empty_like(got)
            exchange.all_to_all_single(got, send, recv_splits, send_splits)
            dist.all_to_all_single(want, send, recv_splits, send_splits)
            assert torch.equal(got, want), (name, step)
            checked += 1
        # Equal splits (the low-latency mode's call), 1-D tensors too.
        send = torch.arange(world * 5, dtype=torch.int64) + 1000 * rank
        got, want = torch.empty_like(send), torch.empty_like(send)
        exchange.all_to_all_single(got, send)
        dist.all_to_all_single(want, send)
        assert torch.equal(got, want), name
        checked += 1
    return {"checked": checked, "leftover": sorted(leftover)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_equals_gloo_and_leaves_no_file(world_size: int) -> None:
    results = run_multirank(world_size, equal_to_gloo_worker, timeout_s=120, num_threads=1)
    for rank, result in enumerate(results):
        assert result["checked"] == 26, (rank, result)
        assert result["leftover"] == [], (rank, result)  # the name is gone once all mapped it


def vote_worker(rank: int, world: int) -> list[str]:
    """The engine's vote through shared memory equals gloo's MIN-allreduce; abort() makes the
    peers' next call fail at once, naming the rank."""
    from dist_engine.distributed.step_sync import TorchVote

    exchange = open_shared_memory_exchange(dist.group.WORLD, "shared_memory", timeout_s=30)
    shared, plain = TorchVote(dist.group.WORLD, exchange), TorchVote(dist.group.WORLD)
    for step in range(20):
        gen = torch.Generator().manual_seed(10 * step + rank)
        values = torch.randint(-5, 5, (7,), generator=gen).tolist()
        assert shared.allreduce_min(values) == plain.allreduce_min(values), step
    dist.barrier()
    messages = []
    if rank == 0:
        exchange.abort()
    dist.barrier()
    start = time.monotonic()
    try:
        shared.allreduce_min([1] * 7)
    except RuntimeError as exc:
        messages.append(str(exc))
    assert time.monotonic() - start < 5
    return messages


def test_vote_through_shared_memory_and_abort() -> None:
    for rank, messages in enumerate(run_multirank(3, vote_worker, timeout_s=60, num_threads=1)):
        assert len(messages) == 1 and "rank 0 gave up" in messages[0], (rank, messages)


def alone_worker(rank: int, world: int) -> dict:
    """A vote in a group of one: the rank's own vector, and no collective at all (gloo's would
    hand the tensor to its worker thread and back every step)."""
    from dist_engine.distributed.step_sync import TorchVote

    vote = TorchVote(dist.group.WORLD)

    def refuse(*args, **kwargs):
        raise AssertionError("a collective in a group of one")

    dist.all_reduce = dist.all_gather_single = refuse
    answers = [vote.allreduce_min([3, -1, 7]), vote.allreduce_min([0, 5, -2])]
    vote.check_lockstep(4, StepKind.DECODE, 1)
    return {"answers": answers, "calls": vote.num_calls, "seconds": vote.take_seconds()}


def test_a_group_of_one_votes_without_a_collective() -> None:
    (result,) = run_multirank(1, alone_worker, timeout_s=60, num_threads=1)
    assert result == {"answers": [[3, -1, 7], [0, 5, -2]], "calls": 2, "seconds": 0.0}


def plain_alone_worker(rank: int, world: int) -> dict:
    """Plain data in a group of one: the value as a peer would get it (through JSON), and no
    collective (gloo's would copy the bytes on its worker thread, which starts an OpenMP pool
    there for a large payload)."""
    from dist_engine.distributed.plain_data import all_gather_json, broadcast_json

    def refuse(*args, **kwargs):
        raise AssertionError("a collective in a group of one")

    dist.all_reduce = dist.all_gather_single = dist.all_gather = refuse
    value = {"results": (1, "a", None), "sizes": [2.5, 3]}
    return {
        "gathered": all_gather_json(value, dist.group.WORLD),
        "broadcast": broadcast_json("only", src=0, group=dist.group.WORLD),
    }


def test_plain_data_in_a_group_of_one_needs_no_collective() -> None:
    (result,) = run_multirank(1, plain_alone_worker, timeout_s=60, num_threads=1)
    assert result == {
        "gathered": [{"results": [1, "a", None], "sizes": [2.5, 3]}],
        "broadcast": "only",
    }


def _fresh(timeout_s: float) -> SharedMemoryExchange:
    exchange = open_shared_memory_exchange(
        dist.group.WORLD, "shared_memory", timeout_s=timeout_s, slot_bytes=SMALL_SLOT
    )
    assert exchange is not None
    return exchange


def _error_of(fn) -> tuple[str, float]:
    start = time.monotonic()
    try:
        fn()
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start
    return "", time.monotonic() - start


def failures_worker(rank: int, world: int) -> dict:
    out: dict[str, object] = {}
    ones = torch.ones(world * 3, 4)

    # 1. Divergence: rank 0 sends rank 1 four rows where rank 1 expects three. Rank 1 sees the
    # chunk header and raises with both views; the others may finish that call, but fail on
    # their next one, told that rank 1 gave up, instead of waiting for their timeout.
    exchange = _fresh(timeout_s=30)
    send_splits = [4 if (rank, dst) == (0, 1) else 3 for dst in range(world)]
    recv_splits = [3] * world
    send = torch.ones(sum(send_splits), 4)
    recv = torch.empty(sum(recv_splits), 4)
    message, _ = _error_of(lambda: exchange.all_to_all_single(recv, send, recv_splits, send_splits))
    if not message:
        message, _ = _error_of(lambda: exchange.all_to_all_single(torch.empty_like(ones), ones))
    out["diverged"] = message
    dist.barrier()

    # 2. A rank that never comes: the others time out and name it, within about the timeout.
    exchange = _fresh(timeout_s=1.0)
    if rank == world - 1:
        out["late"] = ("", 0.0)
    else:
        out["late"] = _error_of(lambda: exchange.all_to_all_single(torch.empty_like(ones), ones))
    dist.barrier()

    # 3. A rank whose process exits: the others name it long before their timeout.
    exchange = _fresh(timeout_s=60.0)
    dist.barrier()
    if rank == world - 1:
        os._exit(0)
    out["exited"] = _error_of(lambda: exchange.all_to_all_single(torch.empty_like(ones), ones))
    out["exited_pid"] = exchange._handle.pids()[world - 1]
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_failures_raise_naming_the_rank(world_size: int) -> None:
    last = world_size - 1
    results = run_multirank(
        world_size, failures_worker, timeout_s=120, num_threads=1, may_exit=frozenset({last})
    )
    assert results[last] is None  # it exited
    for rank in range(last):
        message = results[rank]["diverged"]
        if rank == 1:
            assert "out of step" in message and "expecting 48 bytes from rank 0" in message
            assert "carrying 64 bytes" in message, message
        else:
            assert "rank 1 gave up" in message, (rank, message)
        # The first rank to time out names the absent one; a peer may hear of it from the mark.
        message, waited = results[rank]["late"]
        assert "timed out after" in message or "gave up" in message, (rank, message)
        assert 0.9 < waited < 10, (rank, message, waited)
    late = [results[rank]["late"][0] for rank in range(last)]
    assert any(f"waiting for rank(s) {last}" in message for message in late), late
    for rank in range(last):
        message, waited = results[rank]["exited"]
        pid = results[rank]["exited_pid"]
        assert f"rank {last} (pid {pid}) has exited" in message or "gave up" in message, message
        assert waited < 10, (rank, waited)
    exited = [results[rank]["exited"][0] for rank in range(last)]
    assert any(f"rank {last} (pid " in message for message in exited), exited


def setup_worker(rank: int, world: int, case: str) -> object:
    if case == "modes_differ":
        mode = "auto" if rank == 0 else "process_group"
        try:
            open_shared_memory_exchange(dist.group.WORLD, mode, timeout_s=10)
        except ValueError as exc:
            return str(exc)
        return "no error"
    if case == "hosts_differ":
        shm_exchange.host_identity = lambda: f"host-{rank}"  # as if each rank had its own host
        auto = open_shared_memory_exchange(dist.group.WORLD, "auto", timeout_s=10)
        try:
            open_shared_memory_exchange(dist.group.WORLD, "shared_memory", timeout_s=10)
        except RuntimeError as exc:
            return auto, str(exc)
        return auto, "no error"
    assert case == "process_group"
    return open_shared_memory_exchange(dist.group.WORLD, "process_group", timeout_s=10)


def test_setup_agrees_on_every_rank() -> None:
    for message in run_multirank(2, setup_worker, ("modes_differ",), timeout_s=60):
        assert "rank 0: auto, rank 1: process_group" in message, message
    for auto, message in run_multirank(2, setup_worker, ("hosts_differ",), timeout_s=60):
        assert auto is None  # several hosts: the process group, without a fuss
        assert "shared_memory, but the ranks are not on one host" in message, message
    assert run_multirank(2, setup_worker, ("process_group",), timeout_s=60) == [None, None]


def init_worker(rank: int, world: int) -> list[str]:
    from dist_engine.distributed.groups import init_distributed
    from dist_engine.distributed.spawn import current_store

    names = []
    for mode in ("auto", "process_group", "shared_memory"):
        ctx = init_distributed(rank, world, current_store(), backend="gloo", moe_exchange=mode)
        names.append(type(ctx.moe_exchange).__name__)
    return names


def test_init_distributed_picks_the_exchange() -> None:
    """On one host, `auto` is shared memory; `process_group` keeps the MoE group's."""
    expected = ["SharedMemoryExchange", "GroupExchange", "SharedMemoryExchange"]
    assert run_multirank(2, init_worker, timeout_s=60) == [expected, expected]


def test_config_rejects_bad_exchange_values() -> None:
    with pytest.raises(ValueError, match=r"parallel\.moe_exchange"):
        ParallelConfig(moe_exchange="tcp")
    with pytest.raises(ValueError, match=r"shared_memory.*nccl"):
        ParallelConfig(backend="nccl", moe_exchange="shared_memory")
