"""The torchrun launcher: this process is one DP rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

Every process runs the same program with the same prompts; each rank serves its share
(prompt i goes to rank i mod world, unless pinned), and the results are exchanged so that every
rank returns all of them in input order: as JSON over a gloo group of their own, never through
the store (torchrun's agent store answers anyone who connects) and never pickled.
"""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dist_engine.backends import may_use_native
from dist_engine.distributed.cpu_binding import bind_process
from dist_engine.distributed.groups import describe_exchange, init_distributed, resolve_backend
from dist_engine.distributed.plain_data import all_gather_json
from dist_engine.engine.config import EngineConfig
from dist_engine.engine.outputs import RequestOutput, output_from_plain, output_to_plain
from dist_engine.errors import LockstepError
from dist_engine.kernels import compute
from dist_engine.log import get_logger
from launcher.clients import EngineHost, HostedClient, Submission


def torchrun_rank() -> tuple[int, int, str, int]:
    try:
        rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
        return rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as missing:
        raise RuntimeError(
            f"launcher 'torchrun' needs {missing} in the environment: start the job with "
            "`torchrun --nproc-per-node N -m launcher.cli run ...`"
        ) from None


def _bind_cpu_rank(config: EngineConfig, rank: int, world: int) -> list[int]:
    """Pin this CPU rank to its own cores among the ranks torchrun started on this host
    (LOCAL_RANK of LOCAL_WORLD_SIZE), as the Ray launcher does; before any process group, so
    gloo's threads inherit the pin. Returns the cores, [] where nothing was pinned (binding
    off, a GPU job, or more rank threads than cores)."""
    if not config.parallel.cpu_binding or resolve_backend(config.parallel.backend) != "gloo":
        return []
    # Build (or load) the CPU kernels first: a pinned rank would compile them on its own cores.
    if may_use_native(config.backend_settings):
        compute.prepare()
    threads = config.parallel.threads_per_rank or torch.get_num_threads()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    cores = bind_process(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world)), threads)
    get_logger(rank).info("pinned to cores %s" if cores else "not pinned%s", cores or "")
    return cores


class TorchrunClient(HostedClient):
    # No driver outlives a rank here: torchrun restarts the whole job (--max-restarts).
    _no_reform = (
        "a torchrun group cannot be re-formed from inside: every process is a rank; "
        "torchrun --max-restarts restarts the job"
    )

    def __init__(self, config: EngineConfig) -> None:
        rank, world, host, port = torchrun_rank()
        if world != config.parallel.dp_size:
            raise ValueError(
                f"torchrun started {world} processes but parallel.dp_size is "
                f"{config.parallel.dp_size}"
            )
        self.rank = rank
        self.num_ranks = world
        self.live_ranks = list(range(world))
        # torchrun's agent already serves a store on MASTER_PORT; otherwise rank 0 hosts it.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        timeout = timedelta(seconds=config.parallel.collective_timeout_s)
        self.cpu_cores = _bind_cpu_rank(config, rank, world)
        store = dist.TCPStore(
            host, port, world, is_master=rank == 0 and not agent_store, timeout=timeout
        )
        self._exchange = dist.TCPStore(host, store.port, world, is_master=False, timeout=timeout)
        ctx = init_distributed(
            rank,
            world,
            store,
            backend=config.parallel.backend,
            timeout_s=config.parallel.collective_timeout_s,
            local_rank=int(os.environ.get("LOCAL_RANK", rank)),
            moe_exchange=config.parallel.moe_exchange,
        )
        # The results exchange's own group: the engine loop uses the others concurrently.
        self._results_group = dist.new_group(backend="gloo", timeout=timeout)
        self._timeout_s = config.parallel.collective_timeout_s
        self.host = EngineHost(config, ctx)
        self.moe_exchange = describe_exchange(ctx)
        self.backends = self.host.engine.describe_compute()
        self._num_exchanges = 0

    def submit(self, rank: int, batch: list[Submission], generation: int | None = None) -> None:
        assert rank == self.rank, "under torchrun a process only serves its own rank"
        self.host.submit(batch)

    def stop_ranks(self) -> None:
        self.shutdown()

    def broadcast_json(self, value: object) -> object:
        """Rank 0's ``value`` (plain JSON data), on every rank: one all-gather on the results
        exchange's own gloo group, while no engine collective depends on it."""
        return all_gather_json(value, self._results_group)[0]

    def exchange(self, mine: dict[int, RequestOutput]) -> dict[int, RequestOutput]:
        """Give every rank every rank's results (keyed by prompt index).

        Ranks first say they are done through a store flag (its value is never read), waiting
        in slices so a failed group or a rank that never comes is noticed; then the results
        travel as JSON in one all-gather on the exchange's own gloo group.
        """
        self._num_exchanges += 1
        prefix = f"lockstep/results/{self._num_exchanges}"
        self._exchange.set(f"{prefix}/{self.rank}", b"done")
        keys = [f"{prefix}/{rank}" for rank in range(self.num_ranks)]
        idle_since = None
        while not self._exchange.check(keys):
            if self.host.error is not None:
                raise LockstepError(f"rank {self.rank}: the DP group failed: {self.host.error}")
            # A sleeping group has agreed that no rank has work left, so every rank should be
            # here; one that is not within the collective timeout has stopped.
            engine = self.host.engine
            idle_since = (idle_since or time.monotonic()) if engine and engine.sleeping else None
            if idle_since is not None and time.monotonic() - idle_since > self._timeout_s:
                missing = [r for r, key in enumerate(keys) if not self._exchange.check([key])]
                names = ", ".join(f"rank {r}" for r in missing)
                raise LockstepError(f"{names} did not deliver results within {self._timeout_s} s")
            time.sleep(0.01)
        mine_plain = {str(index): output_to_plain(output) for index, output in mine.items()}
        merged: dict[int, RequestOutput] = {}
        for theirs in all_gather_json(mine_plain, self._results_group):
            merged.update({int(index): output_from_plain(plain) for index, plain in theirs.items()})
        return merged

    def shutdown(self) -> None:
        self.host.shutdown(timeout_s=60.0)
        # Tear the process groups down now, while every thread can still run. Left to
        # interpreter exit, a gloo worker thread of a group still alive then can need the GIL
        # (releasing a tensor), and Python force-exits a thread that asks for it while it
        # finalizes; the forced unwind through gloo's loop aborts the process ("terminate called
        # without an active exception", seen in gdb) after the job succeeded. Destroying the
        # groups is not enough: the engine (its context, its MoE layers) still holds them, so it
        # is dropped too and the groups are freed here, their threads joined.
        # Only once the engine loop has stopped: a loop still inside a collective would block it.
        if not self.host.thread.is_alive() and dist.is_initialized():
            dist.destroy_process_group()
            self.host.engine = None
            gc.collect()
