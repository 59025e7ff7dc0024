"""Process groups of a DP group: the CPU vote group and the MoE (expert-parallel) group.

The vote is a few integers per attempt point; it runs on a gloo (CPU) group so that it needs
no device synchronisation, also where the MoE all-to-alls run on NCCL. Rendezvous goes through
a TCPStore that rank 0 creates on port 0 (no port race) and hands out.

The MoE layers exchange rows through `DistContext.moe_exchange`: the MoE group, or a
shared-memory exchange (distributed/shm_exchange.py) where CPU ranks share one host; the votes
then go through that exchange too (distributed/step_sync.py, `TorchVote`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dist_engine.distributed.shm_exchange import SharedMemoryExchange, open_shared_memory_exchange
from dist_engine.log import get_logger
from moe.exchange import Exchange, GroupExchange


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    store: dist.Store
    vote_group: dist.ProcessGroup
    moe_group: dist.ProcessGroup
    moe_backend: str
    device: torch.device
    timeout_s: float
    # What the MoE layers use: moe_group's all-to-all, or shared memory. The segment is
    # unmapped when the last reference goes (its file name is gone once every rank mapped it).
    moe_exchange: Exchange
    # A new connection to the group's store, with the same key namespace as `store` (a store
    # client serves one request at a time; a thread that blocks on a key needs its own).
    connect_store: Callable[[], dist.Store]

    @property
    def shared_memory(self) -> SharedMemoryExchange | None:
        """The shared-memory exchange when the group uses one (the votes go through it too)."""
        return self.moe_exchange if isinstance(self.moe_exchange, SharedMemoryExchange) else None


def describe_exchange(ctx: DistContext | None) -> str:
    """How this group's MoE rows travel, for people: "shared memory", the process group's
    backend ("gloo", "nccl"), or "none" for a group of one."""
    if ctx is None or ctx.world_size == 1:
        return "none"
    return ctx.moe_backend if ctx.shared_memory is None else "shared memory"


def resolve_backend(backend: str) -> str:
    """``auto`` means NCCL where CUDA is available, gloo otherwise."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("parallel.backend is 'nccl' but CUDA is not available; use auto or gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"parallel.backend must be auto, nccl or gloo, got {backend!r}")
    return backend


def rank_device(backend: str, rank: int, local_rank: int | None = None) -> torch.device:
    """The device a rank computes on: its GPU under NCCL (``local_rank``, else the rank
    modulo the GPUs it sees), the CPU under gloo. ``backend``: a resolved one."""
    if backend == "nccl":
        return torch.device(
            "cuda", rank % torch.cuda.device_count() if local_rank is None else local_rank
        )
    return torch.device("cpu")


def leave_group(ctx: DistContext) -> None:
    """Drop this process's part of a failed group, so that it can join a new one
    (`init_distributed` again, with a new store): its shared-memory exchange is closed (its
    peers were told by `abort` when the failure was seen) and every process group is
    destroyed. Nothing here waits for a peer."""
    shared = ctx.shared_memory
    if shared is not None:
        shared.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def side_group(ctx: DistContext, namespace: str) -> dist.ProcessGroup:
    """A gloo group of the same ranks for traffic off the step's path (EPLB's expert
    transfers): its own connections, rendezvous under `namespace` in the group's store. It is not
    registered with torch.distributed, so `leave_group` does not destroy it while a thread
    still waits on it; an operation waits at most the group's timeout, and fails at once when
    the peer's process is gone. Collective: every rank calls it with the same `namespace`, a
    store key prefix no other group of this store used (gloo's rendezvous keys are there)."""
    store = dist.PrefixStore(f"{namespace}/", ctx.connect_store())
    return dist.ProcessGroupGloo(store, ctx.rank, ctx.world_size, timedelta(seconds=ctx.timeout_s))


def init_distributed(
    rank: int,
    world_size: int,
    store: dist.Store,
    *,
    backend: str = "auto",
    timeout_s: float = 60.0,
    local_rank: int | None = None,
    moe_exchange: str = "auto",
    connect_store: Callable[[], dist.Store] | None = None,
) -> DistContext:
    """Join the group (if this process has not yet), create the MoE group and choose how the
    MoE all-to-alls travel (`parallel.moe_exchange`; shared memory only on gloo).

    Every rank must call this in the same order: ``new_group`` is itself collective.
    connect_store: opens another connection to `store` (same namespace); by default a new
    client of `store`'s address, which needs `store` to be a TCPStore.
    """
    if connect_store is None:
        if not isinstance(store, dist.TCPStore):
            raise ValueError(f"pass connect_store for a {type(store).__name__}")
        host, port = store.host, store.port

        def connect_store() -> dist.Store:
            return dist.TCPStore(host, port, is_master=False)

    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise ValueError(
            f"this process is rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"not rank {rank} of {world_size}"
        )
    moe_backend = resolve_backend(backend)
    moe_group = dist.new_group(backend=moe_backend, timeout=timeout)
    device = rank_device(moe_backend, rank, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if moe_backend == "nccl" and moe_exchange == "shared_memory":
        raise ValueError("parallel.moe_exchange 'shared_memory' needs the gloo backend")
    shared = None
    if moe_backend == "gloo" and world_size > 1:
        shared = open_shared_memory_exchange(dist.group.WORLD, moe_exchange, timeout_s=timeout_s)
    exchange = shared if shared is not None else GroupExchange(moe_group)
    ctx = DistContext(
        rank=rank,
        world_size=world_size,
        store=store,
        vote_group=dist.group.WORLD,
        moe_group=moe_group,
        moe_backend=moe_backend,
        device=device,
        timeout_s=timeout_s,
        moe_exchange=exchange,
        connect_store=connect_store,
    )
    get_logger(rank).info(
        "joined a group of %d; MoE all-to-alls through %s, votes through %s",
        world_size,
        describe_exchange(ctx),
        "shared memory" if shared is not None else "gloo",
    )
    return ctx
