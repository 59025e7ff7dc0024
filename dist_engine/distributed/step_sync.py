"""Step synchronisation over torch.distributed: the vote, the lock-step check, the settings
handshake, and telling which peers are gone when a collective fails."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dist_engine.distributed.plain_data import all_gather_json
from dist_engine.distributed.shm_exchange import SharedMemoryExchange
from dist_engine.errors import LockstepError, SettingsMismatchError
from scheduler import StepKind

_MODE_NAMES = {0: "normal", 1: "low_latency", 2: "none"}


class TorchVote:
    """``scheduler.Vote`` as a MIN-allreduce of an int64 vector on the CPU vote group, or
    through the shared-memory exchange where the ranks share a host (`shared`): the same
    result, without gloo's loopback TCP and the wake-up of a peer blocked in it, which cost
    more than the rest of a fast step.

    In a group of one (a DP=1 group under the Ray or torchrun launcher, or a group shrunk
    onto one survivor) the minimum is the rank's own vector and nothing is exchanged: gloo's
    allreduce over one rank still hands the tensor to its worker thread and back, ~0.5 ms a
    step on a busy 2-core host (docs/benchmark_notes.md, "A Ray rank against the same engine
    in-process").

    It also runs the lock-step check, and times itself: `take_seconds()` is the time spent in
    its collectives (waiting for the slowest rank included) since the previous call.
    """

    def __init__(
        self, group: dist.ProcessGroup, shared: SharedMemoryExchange | None = None
    ) -> None:
        self.group = group
        self.shared = shared
        self.alone = dist.get_world_size(group) == 1
        self.num_calls = 0  # votes (allreduce_min) so far
        self._seconds = 0.0

    def allreduce_min(self, values: list[int]) -> list[int]:
        self.num_calls += 1
        if self.alone:
            return list(values)
        start = time.perf_counter()
        tensor = torch.tensor(values, dtype=torch.int64)
        if self.shared is not None:
            tensor = self.shared.allreduce_min(tensor)
        else:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        self._seconds += time.perf_counter() - start
        return tensor.tolist()

    def check_lockstep(self, step_index: int, kind: StepKind, mode: int) -> None:
        """All-gather ``(step index, step kind, dispatch mode)``; raise LockstepError on any
        disagreement, with every rank's view. A mismatch would otherwise surface as a hang
        (or garbage) inside the MoE all-to-alls."""
        if self.alone:
            return
        start = time.perf_counter()
        try:
            check_lockstep(self.group, step_index, kind, mode)
        finally:
            self._seconds += time.perf_counter() - start

    def take_seconds(self) -> float:
        seconds, self._seconds = self._seconds, 0.0
        return seconds


def check_lockstep(group: dist.ProcessGroup, step_index: int, kind: StepKind, mode: int) -> None:
    """All-gather ``(step index, step kind, dispatch mode)``; raise on any disagreement."""
    world = dist.get_world_size(group)
    local = torch.tensor([step_index, kind.code, mode], dtype=torch.int64)
    gathered = torch.empty(world * 3, dtype=torch.int64)
    dist.all_gather_single(gathered, local, group=group)
    views = gathered.view(world, 3).tolist()
    if any(view != views[0] for view in views):
        kinds = list(StepKind)
        described = "; ".join(
            f"rank {rank}: step {step} {kinds[k].value if 0 <= k < len(kinds) else k} "
            f"{_MODE_NAMES.get(m, m)}"
            for rank, (step, k, m) in enumerate(views)
        )
        raise LockstepError(f"ranks diverged at step {step_index}: {described}")


def agree_settings(group: dist.ProcessGroup, settings: dict[str, object]) -> None:
    """Refuse to start unless every rank has the same ``settings``; names each differing key."""
    everyone: list[dict[str, object] | None] = all_gather_json(settings, group)
    differing = []
    for key in sorted({k for view in everyone if view for k in view}):
        values = [view.get(key) if view else None for view in everyone]
        if any(value != values[0] for value in values):
            per_rank = ", ".join(f"rank {r}={v!r}" for r, v in enumerate(values))
            differing.append(f"{key} ({per_rank})")
    if differing:
        raise SettingsMismatchError(
            "ranks were started with settings that must agree: " + "; ".join(differing)
        )


def find_failed_ranks(
    store: dist.Store, rank: int, world_size: int, *, tag: str, wait_s: float = 2.0
) -> list[int] | None:
    """After a failed collective, ask which peers still answer through the store.

    Each survivor announces itself under ``tag`` and waits up to ``wait_s`` for the others.
    Returns the ranks that did not answer, or None if the store itself is unreachable (it
    lives in rank 0's process, so that usually means rank 0 is gone).
    """
    keys = [f"lockstep/alive/{tag}/{other}" for other in range(world_size)]
    try:
        store.set(keys[rank], b"1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [other for other, key in enumerate(keys) if not store.check([key])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.05)
    except (RuntimeError, OSError, dist.DistError):
        return None
