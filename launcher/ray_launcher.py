"""The Ray launcher: a placement group with one bundle per DP rank and one actor per rank.

Each actor runs its rank's engine loop on a background thread. Rank 0's actor creates the
group's TCPStore on port 0 (so no port can be taken from under it) and hands the port to the
others. Works on an embedded Ray that we start (``ray.init`` with local resources) and inside an
existing cluster (``RAY_ADDRESS``, e.g. under ``ray job submit``), where we only connect.

What is reachable from outside the job: the store listens on loopback when every rank is on
one host (its socket is bound before the store takes it), else on rank 0's node address; every
key the group uses lives under a random per-job namespace that only the driver and the actors
know (handed over by Ray, never through the store). gloo's own sockets listen on loopback too
for a one-host group (GLOO_SOCKET_IFNAME=lo), else on the nodes' addresses.

The embedded Ray (one this launcher starts) takes only this job: it runs with Ray's token
authentication, a token made for the job and handed to Ray's processes through their
environment while Ray starts, then dropped from the driver's environment. A driver, job
submission or RPC without it is refused; what still listens, and where, is in the README.

A rank whose actor dies raises `RankFailure` at once. Every call into a rank has a timeout:
one that stops answering (its process stopped, or hung) is declared failed once it has not
answered for `collective_timeout_s + RANK_SILENCE_MARGIN_S`, and killed, whichever call
notices it. Stats are asked with a short timeout of their own and never fail a rank: a silent
rank's last stats come back with how long it has been silent.

After a failure `reform` heals the group (`on_rank_failure: heal`, driven by the front end,
launcher/healing.py). In place where it can: the surviving ranks' engines have abandoned the
failed step and wait with their requests and KV; the failed ranks' actors are killed and new
ones started in their bundles, each loading its share of the experts, and every rank joins a
new group (a new store on rank 0 under a new namespace). Otherwise (EPLB on, or no rank to
replace) every actor is killed, the placement group removed, and a new group placed and
started as at start-up. Each group is a generation; a call that names one reaches it or
nothing, and a kept rank is the same actor in the next generation (`kept_since`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dist_engine.engine.config import EngineConfig, code_identity, code_root
from dist_engine.engine.outputs import RequestOutput
from dist_engine.engine.stats import RankStats
from dist_engine.errors import LockstepError
from dist_engine.log import get_logger
from launcher import output_channel
from launcher.clients import (
    EngineHost,
    GroupLeft,
    RankFailure,
    RankLeftGroup,
    StaleGroup,
    Submission,
)

log = get_logger()

_STARTUP_TIMEOUT_S = 300.0
_TAKE_S = 0.5  # how long a rank's outstanding `take` waits for outputs before returning empty
# A rank whose take has not come back for this long, as a heal starts, is stopped or hung.
_SILENT_S = 4 * _TAKE_S
# A rank not heard from for the collective timeout plus this long is declared failed: by then
# its peers' collectives have timed out too, so the group is lost either way.
RANK_SILENCE_MARGIN_S = 10.0
STATS_TIMEOUT_S = 2.0  # how long `stats` waits for a rank before reporting its last stats
# The environment through which Ray's processes get their authentication.
_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@ray.remote(max_concurrency=8)
class RankActor:
    """One DP rank. Methods run on Ray's actor threads; the engine loop has its own thread."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.store: Any = None
        self.host: EngineHost | None = None
        self.generation = 0  # of the group this rank last joined (stamps "left" frames)
        self._outputs: tuple[socket.socket, threading.Thread] | None = None  # `open_outputs`
        # A take's outputs as an output frame: a running stream's after its first as deltas.
        self._take_encoder = output_channel.Encoder()
        self._take_lock = threading.Lock()

    def create_store(self, loopback: bool) -> tuple[str, int]:
        """Host the group's store, listening on loopback (every rank on this host) or on this
        node's address only; returns its address."""
        import torch.distributed as dist

        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        # TCPStore itself listens on every interface; a socket bound here first does not.
        listener = socket.create_server((host, 0), backlog=128)
        port = listener.getsockname()[1]
        world = self.config.parallel.dp_size
        # The store owns the socket from here (it closes it when it goes): a Python socket
        # object left to close it too closed the number twice, and a heal's second store
        # had been given that number meanwhile (a rank aborted on it).
        self.store = dist.TCPStore(
            host,
            port,
            world,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
        return host, port

    def start(
        self,
        host: str,
        port: int,
        namespace: str,
        cpu_slot: tuple[int, int] | None,
        loopback: bool,
        generation: int = 0,
    ) -> tuple[int, str, str, str]:
        """Join the group; returns this rank's process id, its Ray node id, how the group's
        MoE rows travel (`describe_exchange`) and the backends this rank resolved.

        namespace: the job's random key prefix in the store. loopback: every rank is on this
        host, so gloo listens on loopback only.
        cpu_slot: (this rank's index among the ranks on its host, their number), to pin the
        rank to its own cores (dist_engine/distributed/cpu_binding.py); None leaves the OS to
        place it.
        """
        import torch.distributed as dist

        if cpu_slot is not None:
            self._pin(cpu_slot)
        world = self.config.parallel.dp_size
        if self.store is None:
            self.store = dist.TCPStore(host, port, world, is_master=False)
        ctx = self._join_group(host, port, namespace, loopback, self.rank, world)
        self.host = EngineHost(self.config, ctx, rejoinable=_heals_in_place(self.config))
        self.generation = generation
        return self._started(ctx)

    def ping(self) -> int:
        """This actor's process id, once it has been placed and started."""
        return os.getpid()

    def code(self) -> tuple[str, str, str]:
        """(`code_identity()`, where this process imports Lockstep from, its host's name):
        what the front end compares with its own before the rank loads anything."""
        return code_identity(), str(code_root("launcher").parent), socket.gethostname()

    def _pin(self, cpu_slot: tuple[int, int]) -> None:
        from dist_engine.backends import may_use_native
        from dist_engine.distributed.cpu_binding import bind_process
        from dist_engine.kernels import compute
        from dist_engine.log import get_logger

        # Build (or load) the CPU kernels before pinning: a first build compiles its files
        # in parallel, and a pinned rank would have only its own cores for it: a fresh
        # machine's first start-up was much slower that way (docs/benchmark_notes.md,
        # "Start-up and failure detection").
        if may_use_native(self.config.backend_settings):
            compute.prepare()
        threads = self.config.parallel.threads_per_rank
        assert threads is not None, "RayClient fills in threads_per_rank"
        cores = bind_process(*cpu_slot, threads)
        get_logger(self.rank).info("pinned to cores %s", cores or "none (they do not fit)")

    def _join_group(
        self, host: str, port: int, namespace: str, loopback: bool, group_rank: int, size: int
    ) -> Any:
        """Join the process groups as ``group_rank`` of ``size``: this DP rank's place among
        the live ones (they differ once a group shrank onto its survivors)."""
        import torch.distributed as dist

        from dist_engine.distributed.groups import init_distributed

        if loopback:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # read when the gloo groups are created

        def connect_store() -> dist.Store:
            return dist.PrefixStore(namespace, dist.TCPStore(host, port, is_master=False))

        return init_distributed(
            group_rank,
            size,
            dist.PrefixStore(namespace, self.store),
            backend=self.config.parallel.backend,
            timeout_s=self.config.parallel.collective_timeout_s,
            moe_exchange=self.config.parallel.moe_exchange,
            connect_store=connect_store,
        )

    def _started(self, ctx: Any) -> tuple[int, str, str, str]:
        from dist_engine.distributed.groups import describe_exchange

        return (
            os.getpid(),
            ray.get_runtime_context().get_node_id(),
            describe_exchange(ctx),
            self.host.engine.describe_compute(),
        )

    # -- healing in place: survivors `detach` then `rejoin`; a replacement `prepare`s first ---
    def prepare(self, cpu_slot: tuple[int, int] | None) -> None:
        """A replacement for a failed rank: load this rank's share of the model without a
        group (`DPEngine(join_as=...)`); `rejoin` takes it into the re-formed group."""
        if cpu_slot is not None:
            self._pin(cpu_slot)
        world = self.config.parallel.dp_size
        self.host = EngineHost(self.config, join_as=(self.rank, world))

    def detach(self, timeout_s: float) -> str:
        """Whether this rank's engine has left its failed group and waits for a new one with
        its requests ("detached"), stopped, or still runs (`EngineHost.detach`)."""
        return self.host.detach(timeout_s) if self.host is not None else "stopped"

    def rejoin(
        self,
        host: str,
        port: int,
        namespace: str,
        loopback: bool,
        timeout_s: float,
        group_rank: int,
        size: int,
        generation: int = 0,
    ) -> tuple[int, str, str, str]:
        """Join the re-formed group (``generation``) whose store is at (host, port) as
        ``group_rank`` of ``size``: leave the failed group's process groups (a survivor),
        join the new ones, and wait for the engine to join (moving its experts if the group
        changed size)."""
        import torch.distributed as dist

        from dist_engine.distributed.groups import leave_group

        engine = self.host.engine
        if engine.dist is not None:
            leave_group(engine.dist)
        if group_rank != 0:  # group rank 0 made the new store (`create_store`) just before
            self.store = dist.TCPStore(host, port, size, is_master=False)
        ctx = self._join_group(host, port, namespace, loopback, group_rank, size)
        self.host.join(ctx, timeout_s)
        self.generation = generation
        return self._started(ctx)

    def regroup(self) -> None:
        """Ask the group to leave its process groups at its next vote (a planned re-form:
        growing back); this rank then waits, detached, with its requests."""
        self.host.engine.regroup()

    def leave(self) -> None:
        """No group will come: a detached engine fails its requests and stops."""
        if self.host is not None:
            self.host.leave()

    def submit(self, batch: list[Submission]) -> None:
        self.host.submit(batch)

    def abort(self, request_id: str) -> None:
        self.host.abort(request_id)

    def take(self, timeout_s: float) -> bytes:
        """The outputs since the last take (waiting up to ``timeout_s`` for some), as one
        output frame's JSON (launcher/output_channel.py: a running stream's outputs after
        its first carry only their new tokens, not every token so far each step, across
        nodes too). The driver decodes the takes in the order they were made: one at a time."""
        with self._take_lock:
            return self._take_encoder.payload(("out", self.host.take(timeout_s)))

    def open_outputs(self, path: str, key: bytes) -> bool:
        """Send this rank's takes to the driver's socket at ``path`` from now on, and take
        the driver's commands from it (launcher/output_channel.py); False where it cannot be
        reached (another host)."""
        try:
            conn = output_channel.connect(path, key)
        except OSError:
            return False
        host = self.host
        self._outputs = (
            conn,
            output_channel.start(
                "lockstep-outputs",
                output_channel.write_takes,
                conn,
                lambda: host.take(_TAKE_S),
                lambda: self.generation,
                host.wait_rejoined,
                GroupLeft,
                _TAKE_S,
            ),
        )
        # The driver's submissions and aborts come the other way on the same connection.
        output_channel.start(
            "lockstep-commands", output_channel.read_commands, conn, host.submit, host.abort
        )
        return True

    def stop_outputs(self, timeout_s: float) -> bool:
        """Stop sending takes to the socket (the driver went back to asking for them):
        shut the connection, so that the writer's next frame fails (and the command reader
        reads its end), and wait for the writer to end.
        Only before the group has any request: a take the writer holds then is empty."""
        if self._outputs is None:
            return True
        conn, writer = self._outputs
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        writer.join(timeout_s)
        return not writer.is_alive()

    def stats(self) -> RankStats:
        return self.host.stats()

    def shutdown(self, timeout_s: float) -> str | None:
        return self.host.shutdown(timeout_s) if self.host is not None else None

    def cpu_cores(self) -> list[int]:
        """The cores this rank's process may run on."""
        return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

    def num_threads(self) -> int:
        """Torch threads of this rank's engine."""
        return self.host.num_threads

    def scheduler_counts(self) -> dict[str, int]:
        """How often this rank's scheduler preempted, and how many prompt tokens it found in
        its prefix cache (tests read them to show a run exercised those paths)."""
        stats = self.host.stats()
        return {
            "num_preemptions": stats.num_preemptions,
            "prefix_hits": stats.num_prefix_cache_hit_tokens,
        }


# How many times a heal in place starts a failed rank's replacement (one that dies as it
# loads, say) before the whole group is replaced instead.
_IN_PLACE_TRIES = 2


class _ReplacementFailed(LockstepError):
    """A replacement rank did not start; the survivors still wait, untouched."""


def _check_code(actors: dict[int, Any]) -> None:
    """Refuse ranks whose Lockstep code is not the front end's (`code_identity`), naming
    each with where it imports the code from: a node left on another version otherwise
    fails every request with an error about some attribute, or runs another protocol."""
    ranks = list(actors)
    answers = ray.get([actors[rank].code.remote() for rank in ranks], timeout=_STARTUP_TIMEOUT_S)
    ours = code_identity()
    differing = [
        f"DP rank {rank} runs {identity} from {where} on {host}"
        for rank, (identity, where, host) in zip(ranks, answers, strict=True)
        if identity != ours
    ]
    if differing:
        raise LockstepError(
            f"ranks run other Lockstep code than this front end ({ours} from "
            f"{code_root('launcher').parent} on {socket.gethostname()}): "
            + "; ".join(differing)
            + ". Install the same version (the same files) on every node."
        )


def _heals_in_place(config: EngineConfig) -> bool:
    """Whether a rank survives its group's failure with its requests and KV, to be taken into
    the re-formed group (`RayClient.reform`): under `on_rank_failure: heal` or `shrink` (with
    EPLB on, a replacement takes the survivors' placement as it joins,
    `ExpertBalancer.join`)."""
    return config.parallel.on_rank_failure != "fail"


class _NoRoom(_ReplacementFailed):
    """No replacement could be placed in time: trying again would wait as long for nothing."""


def start_reaper() -> subprocess.Popen:
    """A process of its own (own session: a signal to the driver's group does not reach it)
    that stops this driver's embedded Ray if the driver dies without shutting it down."""
    return subprocess.Popen(
        [sys.executable, "-m", "launcher.reaper", str(os.getpid())],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )


def connect_ray(num_cpus: int | None = None) -> bool:
    """Connect to the cluster in RAY_ADDRESS, or start an embedded one. True if we started it.

    A cluster we join keeps its own authentication (the user's `RAY_AUTH_*` settings); one we
    start takes only this job (`_job_token`).

    The workers of a cluster we start (the ranks' actors) run at this process's priority:
    Ray's default `worker_niceness` of 15 puts a worker 15 nice levels below the raylet that
    forks it, so the driver, a server, its clients and Ray's own daemons would preempt a rank
    at once. On the 2-core hosts measured this made no difference beyond their noise
    (docs/benchmark_notes.md, "A Ray rank against the same engine in-process"); it keeps a
    rank from ever being below its own front end. A cluster we join keeps its own setting
    (start it with `RAY_worker_niceness=0` for the same).
    """
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=False)
        return False
    with _job_token():
        ray.init(
            address="local",  # a new private instance, even if another cluster runs on this host
            num_cpus=num_cpus,
            include_dashboard=False,
            object_store_memory=256 * 1024 * 1024,
            log_to_driver=False,
            _system_config={"worker_niceness": 0},  # added to the raylet's, which is ours
        )
    return True


@contextlib.contextmanager
def _job_token() -> Iterator[None]:
    """Token authentication with a token made for this job, while an embedded Ray starts.

    Ray's processes (GCS, raylet, agents, and the workers the raylet forks) read the mode and
    token from the environment they start with, and this driver's core worker caches them
    when it connects; afterwards the driver's environment gets its old values back, so
    processes it starts later (the reaper, a user's subprocesses) do not carry the token.
    A token file (`RAY_AUTH_TOKEN_PATH`, ~/.ray/auth_token) is never read or written.
    """
    saved = {name: os.environ.get(name) for name in _AUTH_ENV}
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    _reload_auth_settings()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _reload_auth_settings() -> None:
    """Make this process's Ray read the authentication mode and token from the environment
    again: Ray caches both per process, and a process may start several embedded Rays in
    turn (each with its own token) or join a cluster of another mode in between."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@dataclass(eq=False)
class _Group:
    """One generation of the group: its placement group, its actors, and what the driver
    knows of each rank. A reform of the whole group replaces the whole object, so a call
    that captured an old one can only reach (dead) old actors; a heal in place keeps it,
    replacing the failed ranks' actors and advancing `generation`."""

    generation: int
    pg: Any
    actors: list[Any] = field(default_factory=list)
    # rank -> (the actor asked, its outstanding `take`, the generation it was asked in): an
    # answer from an actor since replaced is not that rank's any more, and a survivor's
    # "left the group" from before a heal is old news.
    takes: dict[int, tuple[Any, Any, int]] = field(default_factory=dict)
    # rank -> (the actor, the decoder of its takes' frames): a new actor gets a new one.
    take_decoders: dict[int, tuple[Any, output_channel.Decoder]] = field(default_factory=dict)
    # With every rank on the driver's host, each rank's takes come over a socket instead
    # (launcher/output_channel.py): rank -> (the actor writing, its channel).
    channeled: bool = False
    channels: dict[int, tuple[Any, output_channel.Channel]] = field(default_factory=dict)
    # Outputs polled from live ranks in a poll that then found a rank failed: the next poll
    # returns them (a heal in place keeps the survivors').
    stash: list[RequestOutput] = field(default_factory=list)
    # rank -> the generation its actor started in (a survivor keeps its own).
    since: dict[int, int] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)  # rank -> why; never asked again
    heard: dict[int, float] = field(default_factory=dict)  # rank -> when it last answered
    last_stats: dict[int, RankStats] = field(default_factory=dict)
    pids: dict[int, int] = field(default_factory=dict)
    node_ids: dict[int, str] = field(default_factory=dict)
    store_address: tuple[str, int] | None = None
    moe_exchange: str = "none"
    backends: str = ""
    # DP ranks the group shrank away from (their experts are on the others) until it grows
    # back; requests are not routed there and nothing asks them.
    absent: set[int] = field(default_factory=set)
    # A planned re-form (growing back) is under way: a rank's "left the group" is expected.
    planned: bool = False

    @property
    def live(self) -> list[int]:
        """The DP ranks in the group, ascending: their group ranks are their positions."""
        return [rank for rank in range(len(self.actors)) if rank not in self.absent]


class RayClient:
    def __init__(self, config: EngineConfig) -> None:
        world = config.parallel.dp_size
        self.num_ranks = world
        self.can_reform = True
        self.started_ray = connect_ray(num_cpus=max(world, os.cpu_count() or 1))
        self._reaper = start_reaper() if self.started_ray else None
        if self.started_ray:
            # Every rank runs on this host: build the native code here, where the first build's
            # progress reaches the user's terminal, and the ranks load the cached files.
            _prepare_native(config)
        self._use_gpu = config.parallel.backend != "gloo" and _cluster_has_gpus()
        self._bundle = {"GPU": 1, "CPU": 1} if self._use_gpu else {"CPU": 1}
        # Each actor's EngineHost sets its torch threads from the config.
        threads = config.parallel.threads_per_rank or max(1, (os.cpu_count() or 1) // world)
        self._config = config.with_overrides(threads_per_rank=threads)
        self._silence_limit_s = config.parallel.collective_timeout_s + RANK_SILENCE_MARGIN_S
        # poll, submit/abort and stats may each run on a thread of their own (the server); the
        # lock guards the group's bookkeeping and which group is current.
        self._lock = threading.Lock()
        self._reform_lock = threading.Lock()
        # The last heal in place's wait for the live ranks to detach, in seconds (tests and
        # bench_faults read it: a stopped rank should not cost the whole detach limit).
        self.last_detach_wait_s: float | None = None
        # Growing back after a shrink: the thread that readies replacements, and what it
        # readied: (the generation they are for, DP rank -> loaded actor).
        self._grower: threading.Thread | None = None
        self._grown_actors: tuple[int, dict[int, Any]] | None = None
        self._closing = threading.Event()
        # The ranks' output channels (made at the first group on this host), the lock that
        # lets one poll read them at a time, and the channels dropped since the last poll:
        # only the reader closes a channel, so that no descriptor it reads is reused under it.
        self._listener: output_channel.Listener | None = None
        self._read_lock = threading.Lock()
        self._dropped: list[output_channel.Channel] = []
        self._group = _Group(generation=0, pg=None)
        try:
            self._group = self._start_group(0)
        except BaseException:
            self.shutdown()
            raise

    # -- the current group, as the callers and tests see it ---------------------------------
    @property
    def generation(self) -> int:
        return self._group.generation

    @property
    def actors(self) -> list[Any]:
        return self._group.actors

    @property
    def pg(self) -> Any:
        return self._group.pg

    @property
    def failed(self) -> dict[int, str]:
        return self._group.failed

    @property
    def pids(self) -> dict[int, int]:
        return self._group.pids

    @property
    def node_ids(self) -> dict[int, str]:
        return self._group.node_ids

    @property
    def store_address(self) -> tuple[str, int] | None:
        return self._group.store_address

    @property
    def moe_exchange(self) -> str:
        return self._group.moe_exchange

    @property
    def backends(self) -> str:
        return self._group.backends

    def _start_group(self, generation: int) -> _Group:
        """Place and start a group of `num_ranks` new actors: a placement group of its own, a
        store on new rank 0 under a new random namespace, every rank loading its share of the
        experts. Leaves nothing running if it fails."""
        config, world, bundle = self._config, self.num_ranks, self._bundle
        group = _Group(
            generation, placement_group([bundle] * world, config.parallel.placement_strategy)
        )
        try:
            try:
                ray.get(group.pg.ready(), timeout=_STARTUP_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise LockstepError(
                    f"Ray could not place {world} rank(s) of {bundle} with placement_strategy "
                    f"{config.parallel.placement_strategy} within {_STARTUP_TIMEOUT_S:.0f} s; "
                    f"the cluster has {_describe_nodes()}"
                ) from None
            group.actors = [self._new_actor(group, rank) for rank in range(world)]
            _check_code(dict(enumerate(group.actors)))
            hosts = _rank_hosts(group.pg, range(world))
            loopback = len(set(hosts.values())) == 1
            host, port = ray.get(
                group.actors[0].create_store.remote(loopback), timeout=_STARTUP_TIMEOUT_S
            )
            group.store_address = (host, port)
            pin = config.parallel.cpu_binding and not self._use_gpu
            slots = _cpu_slots(hosts) if pin else {}
            namespace = f"lockstep/{secrets.token_hex(16)}/"
            started = ray.get(
                [
                    actor.start.remote(host, port, namespace, slots.get(rank), loopback, generation)
                    for rank, actor in enumerate(group.actors)
                ],
                timeout=_STARTUP_TIMEOUT_S,
            )
            here = ray.get_runtime_context().get_node_id()
            if all(node == here for _, node, *_ in started):
                self._try_channels(group)
        except BaseException:
            self._kill_group(group)
            raise
        group.heard = dict.fromkeys(range(world), time.monotonic())
        group.since = dict.fromkeys(range(world), generation)
        group.pids = {rank: pid for rank, (pid, *_) in enumerate(started)}
        group.node_ids = {rank: node for rank, (_, node, *_) in enumerate(started)}
        group.moe_exchange = started[0][2]  # a group decision: the same on every rank
        group.backends = describe_per_rank([backends for *_, backends in started])
        for rank, pid in group.pids.items():
            log.info("DP rank %d: pid %d, Ray node %s", rank, pid, group.node_ids[rank][:12])
        return group

    @property
    def live_ranks(self) -> list[int]:
        """The DP ranks of the group now running: every rank, unless it shrank."""
        return self._group.live

    def reform(self) -> set[int]:
        """Re-form the failed group and return the DP ranks whose requests are gone (the
        caller resubmits those, to `live_ranks`; the others' requests go on where they were).

        In place where it can (`_heal_in_place`): the survivors keep their processes,
        requests and KV. Under `on_rank_failure: heal` the failed ranks are started again
        (a replacement that does not start is started once more); where none can be placed
        within `replacement_wait_s`, or it fails twice, the group shrinks onto the survivors
        instead (they take over the lost ranks' experts) and grows back once replacements
        can start (`grow`). Under `shrink`, and in a group that has shrunk, it shrinks at
        once. Where every rank is alive and detached (the group failed, no rank did), they
        re-form as they are. Otherwise (the heal in place failed) every rank of the group is
        killed, its placement group freed, and a new group of the full
        size started (`_start_group`): new actors, a new store and namespace; every rank is
        returned. The time is a rank's start-up time (model load included), or for a shrink
        the survivors' reading of the experts they take over."""
        with self._reform_lock:
            old = self._group
            plan: list[str] = []  # "replace" or "shrink", tried in turn
            if _heals_in_place(self._config):
                replaces = self._config.parallel.on_rank_failure == "heal" and not old.absent
                plan = ["replace"] * _IN_PLACE_TRIES + ["shrink"] if replaces else ["shrink"]
            while plan:
                replace = plan.pop(0) == "replace"
                try:
                    return self._heal_in_place(old, replace)
                except _NoRoom as error:  # waiting again would wait as long for nothing
                    log.error("%s; the group goes on without them", error)
                    plan = ["shrink"]
                except _ReplacementFailed as error:
                    then = (
                        "starting the replacement again"
                        if plan[0] == "replace"
                        else "going on without it"
                    )
                    log.error("%s; %s", error, then)
                except Exception as error:
                    log.error(
                        "the survivors cannot be kept (%s: %s); replacing every rank",
                        type(error).__name__, error,
                    )  # fmt: skip
                    break
            self._kill_group(old)
            group = self._start_group(old.generation + 1)
            with self._lock:
                self._group = group
            return set(range(self.num_ranks))

    def _heal_in_place(self, group: _Group, replace: bool) -> set[int]:
        """Keep the ranks that survived the failure, in `group`, and replace the others
        (``replace``) or go on without them:

        1. every live rank not yet declared failed is asked to `detach` (its engine abandons
           the step the failure hit and waits, keeping its requests and KV); one that does
           not within the collective timeout + 5 s is failed too, and one that was already
           silent as the heal began (`_SILENT_S`) as soon as every other has detached;
        2. the failed ranks' actors are killed; replacing, new ones are started in their
           bundles, each loading its share of the model without a group (`prepare`);
        3. the first member makes a new store, and every member joins a new group under a
           new namespace (`rejoin`): new process groups and exchange, settings agreed, the
           step policy restarted at the highest step index, as a new group's; a group that
           changed size moves its experts to the new placement (engine/resize.py).

        Returns the failed ranks. Raises (leaving the group to be replaced whole) if none
        survived; `_ReplacementFailed` (`_NoRoom`) if a replacement did not start (could not
        be placed), the survivors untouched."""
        # A live rank leaves its failed group within the collective timeout of the failure
        # (its collective fails at once on a dead peer, after T on a stopped one).
        limit = self._config.parallel.collective_timeout_s + 2.0
        live = [rank for rank in group.live if rank not in group.failed]
        now = time.monotonic()
        # A live rank's actor answers its outstanding take within _TAKE_S whatever its engine
        # does; one silent for several of those as the heal starts is stopped or hung.
        silent = {rank for rank in live if now - group.heard.get(rank, now) > _SILENT_S}
        asked = {rank: group.actors[rank].detach.remote(limit) for rank in live}
        states = self._detach_states(asked, silent, deadline=now + limit + 3.0)
        self.last_detach_wait_s = time.monotonic() - now
        survivors = [rank for rank in live if states[rank] == "detached"]
        lost = {rank for rank in group.live if rank not in survivors}
        if not survivors:
            raise LockstepError(f"no rank survived to be kept ({states})")
        replace = replace and bool(lost)  # every rank alive and detached: they re-form as is
        for rank in lost:
            self._declare_failed(group, rank, group.failed.get(rank) or states.get(rank, ""))
            self._kill(group, rank)
        members = group.live if replace else survivors
        log.warning(
            "healing in place: keeping DP rank(s) %s with their requests, %s %s",
            survivors, "replacing" if replace else "going on without (shrinking onto them)",
            sorted(lost),
        )  # fmt: skip
        new = self._start_replacements(group, sorted(lost)) if replace else {}
        actors = [new.get(rank, actor) for rank, actor in enumerate(group.actors)]
        try:
            started = self._rejoin(group, actors, members)
        except BaseException:
            self._kill_actors(new)  # the caller kills the rest with the group
            raise
        with self._lock:
            if not replace:
                group.absent |= lost
                for rank in lost:  # never signalled again: its pid may be reused
                    group.pids.pop(rank, None)
                    group.node_ids.pop(rank, None)
            self._took_members(group, actors, started, lost)
        self._open_replacement_channels(group, sorted(new))
        self._log_started(started, new)
        if not replace and self._config.parallel.on_rank_failure == "heal":
            self._start_grower()
        return lost

    def _start_replacements(self, group: _Group, ranks: list[int]) -> dict[int, Any]:
        """New actors for ``ranks`` in their bundles, each loading its share of the model
        without a group (`prepare`). Raises `_NoRoom` if they are not placed and started
        within `replacement_wait_s`, `_ReplacementFailed` if one dies as it loads; leaves
        none running then."""
        config = self._config
        actors = {rank: self._new_actor(group, rank) for rank in ranks}
        wait_s = config.parallel.replacement_wait_s
        try:
            pings = [actor.ping.remote() for actor in actors.values()]
            ready, _ = ray.wait(pings, num_returns=len(pings), timeout=wait_s)
            if len(ready) < len(pings):
                raise _NoRoom(
                    f"no replacement for DP rank(s) {ranks} could be placed and started within "
                    f"parallel.replacement_wait_s={wait_s:g} s; the cluster has "
                    f"{_describe_nodes()}"
                )
            _check_code(actors)
            hosts = _rank_hosts(group.pg, group.live)
            pin = config.parallel.cpu_binding and not self._use_gpu
            slots = _cpu_slots(hosts) if pin else {}
            ray.get(
                [actors[rank].prepare.remote(slots.get(rank)) for rank in ranks],
                timeout=_STARTUP_TIMEOUT_S,
            )
        except _NoRoom:
            self._kill_actors(actors)
            raise
        except Exception as error:  # no survivor has been touched yet
            self._kill_actors(actors)
            raise _ReplacementFailed(
                f"a replacement for DP rank(s) {ranks} did not start "
                f"({type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]})"
            ) from error
        return actors

    def _new_actor(self, group: _Group, rank: int) -> Any:
        return RankActor.options(
            num_cpus=1,
            num_gpus=1 if self._use_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group.pg, placement_group_bundle_index=rank
            ),
        ).remote(self._config, rank)

    @staticmethod
    def _kill_actors(actors: dict[int, Any]) -> None:
        for actor in actors.values():
            ray.kill(actor, no_restart=True)

    def _rejoin(self, group: _Group, actors: list[Any], members: list[int]) -> dict[int, tuple]:
        """Take ``members`` (DP ranks, ascending; their positions are their group ranks) into
        a new group: a new store on the first, a new namespace. Returns each member's
        `_started` answer."""
        hosts = _rank_hosts(group.pg, members)
        loopback = len(set(hosts.values())) == 1
        host, port = ray.get(
            actors[members[0]].create_store.remote(loopback), timeout=_STARTUP_TIMEOUT_S
        )
        group.store_address = (host, port)
        namespace = f"lockstep/{secrets.token_hex(16)}/"
        size = len(members)
        started = ray.get(
            [
                actors[rank].rejoin.remote(
                    host,
                    port,
                    namespace,
                    loopback,
                    _STARTUP_TIMEOUT_S,
                    group_rank,
                    size,
                    group.generation + 1,
                )
                for group_rank, rank in enumerate(members)
            ],
            timeout=_STARTUP_TIMEOUT_S + 10.0,
        )
        return dict(zip(members, started, strict=True))

    def _took_members(
        self, group: _Group, actors: list[Any], started: dict[int, tuple], gone: set[int]
    ) -> None:
        """The group's bookkeeping once ``started`` (DP rank -> `_started`) joined it as its
        next generation; ``gone``: ranks whose requests did not survive (replaced or absent).
        Called with the lock held."""
        now = time.monotonic()
        group.generation += 1
        group.actors = actors
        group.failed.clear()
        for rank in gone:
            group.takes.pop(rank, None)
            group.take_decoders.pop(rank, None)
            self._close_channel(group, rank)
            group.last_stats.pop(rank, None)
            group.since[rank] = group.generation
        for rank, (pid, node, *_) in started.items():
            if group.since[rank] == group.generation:  # a new process
                group.pids[rank], group.node_ids[rank] = pid, node
        group.stash = [out for out in group.stash if out.dp_rank not in gone]
        group.heard = dict.fromkeys(started, now)

    def _log_started(self, started: dict[int, tuple], new: dict[int, Any]) -> None:
        for rank in sorted(new):
            pid, node, *_ = started[rank]
            log.info("DP rank %d replaced: pid %d, Ray node %s", rank, pid, node[:12])

    # -- growing back after a shrink ---------------------------------------------------------
    def _start_grower(self) -> None:
        """Keep replacements for the absent ranks ready on a thread of its own: each is
        placed as soon as its bundle has room again, then loads its share of the model;
        `grow_ready` says when all have, and the front end then calls `grow`."""
        with self._lock:
            stale = self._grown_actors
            if stale is not None and stale[0] != self._group.generation:
                self._grown_actors = None  # readied for a group that has changed since
                self._kill_actors(stale[1])
            if self._grower is not None and self._grower.is_alive():
                return
            self._grower = threading.Thread(
                target=self._prepare_growth, name="lockstep-grow", daemon=True
            )
            self._grower.start()

    def _prepare_growth(self) -> None:
        while not self._closing.is_set():
            group = self._group
            generation, absent = group.generation, sorted(group.absent)
            if not absent or self._grown_actors is not None:
                return

            def unchanged(group: _Group = group, generation: int = generation) -> bool:
                # A heal or a grow since makes these replacements for the wrong ranks.
                return self._group is group and group.generation == generation

            actors = {rank: self._new_actor(group, rank) for rank in absent}
            pings = [actor.ping.remote() for actor in actors.values()]
            while not self._closing.is_set() and unchanged():
                ready, _ = ray.wait(pings, num_returns=len(pings), timeout=1.0)
                if len(ready) == len(pings):
                    break
            else:
                self._kill_actors(actors)
                continue
            try:
                ray.get(pings)
                hosts = _rank_hosts(group.pg, range(self.num_ranks))
                pin = self._config.parallel.cpu_binding and not self._use_gpu
                slots = _cpu_slots(hosts) if pin else {}
                ray.get(
                    [actors[rank].prepare.remote(slots.get(rank)) for rank in absent],
                    timeout=_STARTUP_TIMEOUT_S,
                )
            except Exception as error:
                log.error(
                    "a replacement for DP rank(s) %s did not start (%s: %s); trying again",
                    absent, type(error).__name__, error,
                )  # fmt: skip
                self._kill_actors(actors)
                self._closing.wait(self._config.parallel.replacement_wait_s)
                continue
            with self._lock:
                if unchanged():
                    self._grown_actors = (generation, actors)
                    log.info("replacements for DP rank(s) %s are ready to join", absent)
                    return
            self._kill_actors(actors)  # the group changed meanwhile: start over

    def grow_ready(self) -> bool:
        """Whether replacements for every absent rank have loaded and wait to join (`grow`)."""
        ready = self._grown_actors
        return ready is not None and ready[0] == self._group.generation

    def grow(self) -> set[int]:
        """Take the ready replacements into the group, back at its full size: every rank
        leaves its process groups at the same step (its next vote), keeping its requests and
        KV, and they all join a new group, the survivors moving their experts back to the
        initial placement. Returns the DP ranks that joined (none if nothing was ready).
        Raises if the group could not be re-formed: the front end then heals it."""
        with self._reform_lock:
            group = self._group
            with self._lock:
                ready, self._grown_actors = self._grown_actors, None
            if ready is None:
                return set()
            generation, new = ready
            if generation != group.generation:
                self._kill_actors(new)
                self._start_grower()
                return set()
            survivors = group.live
            limit = self._config.parallel.collective_timeout_s + 2.0
            group.planned = True
            try:
                ray.get(
                    [group.actors[rank].regroup.remote() for rank in survivors],
                    timeout=self._silence_limit_s,
                )
                asked = {rank: group.actors[rank].detach.remote(limit) for rank in survivors}
                states = self._detach_states(asked, set(), time.monotonic() + limit + 3.0)
                if any(states[rank] != "detached" for rank in survivors):
                    raise LockstepError(f"the survivors did not leave their group ({states})")
                actors = [new.get(rank, actor) for rank, actor in enumerate(group.actors)]
                started = self._rejoin(group, actors, list(range(self.num_ranks)))
            except BaseException:
                self._kill_actors(new)
                with self._lock:
                    group.planned = False
                raise
            with self._lock:
                group.absent.clear()
                self._took_members(group, actors, started, set(new))
                group.planned = False
        self._open_replacement_channels(group, sorted(new))
        self._log_started(started, new)
        log.warning(
            "the group grew back to %d ranks (DP ranks %s joined)", len(started), sorted(new)
        )
        return set(new)

    @staticmethod
    def _detach_states(asked: dict[int, Any], silent: set[int], deadline: float) -> dict[int, str]:
        """Each asked rank's answer to `detach`, waiting for all together until ``deadline``,
        or less: once some rank has detached, every other that answered has detached or is
        gone, and the rest are all ``silent``, those are not coming back (a stopped
        process), so their wait is over."""
        states: dict[int, str] = {}
        pending = dict(asked)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            answers = states.values()
            settled = all(a == "detached" or a.startswith("no answer") for a in answers)
            if settled and "detached" in answers and set(pending) <= silent:
                break
            refs = list(pending.values())
            ready, _ = ray.wait(refs, num_returns=1, timeout=min(left, 0.2))
            for rank, ref in list(pending.items()):
                if ref in ready:
                    del pending[rank]
                    try:
                        states[rank] = ray.get(ref)
                    except Exception as error:  # gone
                        states[rank] = f"no answer ({type(error).__name__})"
        for rank in pending:
            states[rank] = "no answer (silent)" if rank in silent else "no answer (timeout)"
        return states

    def kept_since(self, rank: int, generation: int) -> bool:
        """Whether ``rank``'s process is the one it was in group ``generation`` (it survived
        every heal since): its outputs from then are still its requests'."""
        return self._group.since.get(rank, -1) <= generation

    def _current(self, generation: int | None) -> _Group:
        group = self._group
        if generation is not None and generation != group.generation:
            raise StaleGroup(generation, group.generation)
        return group

    def submit(self, rank: int, batch: list[Submission], generation: int | None = None) -> None:
        group = self._current(generation)
        actor = self._actor(group, rank)
        if not self._command(group, rank, actor, ("submit", batch)):
            self._get(group, rank, actor.submit.remote(batch))

    def abort(self, rank: int, request_id: str, generation: int | None = None) -> None:
        group = self._current(generation)
        actor = self._actor(group, rank)
        if not self._command(group, rank, actor, ("abort", request_id)):
            self._get(group, rank, actor.abort.remote(request_id))

    def _command(self, group: _Group, rank: int, actor: Any, command: tuple) -> bool:
        """Send ``command`` over ``rank``'s channel, where it has one: True once written.
        False where it has none, or it closed meanwhile (its rank failing): the actor call
        then carries the command, or says how the rank failed. A rank that takes nothing
        for the silence limit (stopped) is failed, as an unanswered call would be."""
        with self._lock:
            entry = group.channels.get(rank)
        if entry is None or entry[0] is not actor:
            return False
        try:
            entry[1].send(output_channel.encode_command(command), self._silence_limit_s)
        except TimeoutError:
            self._fail_silent(group, rank, time.monotonic() - group.heard.get(rank, 0.0))
        except OSError:
            return False
        return True

    def stats(self, timeout_s: float = STATS_TIMEOUT_S) -> list[RankStats]:
        """Every live rank's queues, KV pool and counters, in rank order.

        A rank that does not answer within ``timeout_s`` is reported by its last stats with
        `silent_s` set (or left out, if it never answered one); it is not failed here: the
        calls that carry requests, and `poll`, decide that.
        """
        group = self._group
        asked = {
            rank: group.actors[rank].stats.remote()
            for rank in group.live
            if rank not in group.failed
        }
        ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=timeout_s)
        done = set(ready)
        stats: list[RankStats] = []
        now = time.monotonic()
        for rank, ref in asked.items():
            if ref in done:
                group.last_stats[rank] = self._get(group, rank, ref)
                stats.append(group.last_stats[rank])
            elif rank in group.last_stats:
                silent_s = now - group.heard.get(rank, now)
                stats.append(dataclasses.replace(group.last_stats[rank], silent_s=silent_s))
        return stats

    def poll(self, timeout_s: float, generation: int | None = None) -> list[RequestOutput]:
        """Outputs from whichever ranks have some, waiting up to ``timeout_s``; with
        ``generation``, from that group only (none once it has been replaced).

        Each live rank always has one ``take`` outstanding, which returns as soon as that rank
        has outputs (or after ``_TAKE_S``); we wait on all of them together. Asking every rank
        again every few milliseconds instead cost a clear share of DP=1 throughput on a 2-core
        machine (docs/benchmark_notes.md, "End to end").
        The takes are also the ranks' heartbeat: a rank whose take has not come back for
        `collective_timeout_s + RANK_SILENCE_MARGIN_S` has stopped answering and is failed.
        """
        try:
            group = self._current(generation)
        except StaleGroup:
            return []
        with self._lock:
            stashed, group.stash = group.stash, []
        if stashed:
            return stashed
        if group.channeled:
            return self._poll_channels(group, timeout_s)
        for rank in group.live:
            if rank not in group.takes and rank not in group.failed:
                actor = group.actors[rank]
                group.takes[rank] = (actor, actor.take.remote(_TAKE_S), group.generation)
        takes = dict(group.takes)
        if not takes:
            return []
        ready, _ = ray.wait([ref for _, ref, _ in takes.values()], num_returns=1, timeout=timeout_s)
        outputs: list[RequestOutput] = []
        failure: RankFailure | None = None
        for rank, (actor, ref, asked_in) in takes.items():
            if ref not in ready:
                continue
            with self._lock:
                if group.takes.get(rank, (None, None, None))[1] is not ref:
                    continue  # another poll took it, or its rank has been replaced
                del group.takes[rank]
            try:
                answer = self._get(group, rank, ref, actor, asked_in)
                outputs.extend(self._taken(group, rank, actor, answer))
            except RankFailure as error:
                failure = failure or error
        return self._end_poll(group, list(group.takes), outputs, failure)

    def _taken(self, group: _Group, rank: int, actor: Any, answer: Any) -> list[RequestOutput]:
        """A take's outputs: its frame decoded by the decoder of the actor that made it
        (`RankActor.take`); nothing for a take `_get` answered for (old news). A malformed
        frame fails its rank, as on a channel."""
        if not isinstance(answer, bytes):
            return answer
        with self._lock:
            mine = group.take_decoders.get(rank)
            if mine is None or mine[0] is not actor:
                mine = group.take_decoders[rank] = (actor, output_channel.Decoder())
        try:
            frame = mine[1].decode(answer)
            if frame[0] != "out":
                raise output_channel.MalformedFrame(f"a take answered {frame[0]!r}")
            return frame[1]
        except output_channel.MalformedFrame as error:
            raise self._fail_and_kill(
                group, rank, f"it sent a malformed output frame: {error}"
            ) from None

    def _end_poll(
        self,
        group: _Group,
        ranks: list[int],
        outputs: list[RequestOutput],
        failure: RankFailure | None,
    ) -> list[RequestOutput]:
        """A poll's end: any of ``ranks`` silent past the limit is failed; on a failure the
        outputs polled are stashed and it is raised, else they are returned."""
        if failure is None:
            now = time.monotonic()
            for rank in ranks:
                silent_s = now - group.heard.get(rank, now)
                if silent_s > self._silence_limit_s and rank not in group.failed:
                    try:
                        self._fail_silent(group, rank, silent_s)
                    except RankFailure as error:
                        failure = error
                        break
        if failure is not None:
            # The live ranks' outputs are theirs whatever happens next: a heal in place
            # keeps those ranks, so the next poll hands them out.
            with self._lock:
                group.stash = outputs + group.stash
            raise failure
        return outputs

    # -- the ranks' output channels ------------------------------------------------------
    def _open_channels(self, group: _Group, ranks: Iterable[int]) -> None:
        """Have each of ``ranks`` send its takes over a socket of its own from now on.
        Raises if one cannot (the caller decides what that costs)."""
        if self._listener is None:
            self._listener = output_channel.Listener()
        for rank in ranks:
            actor = group.actors[rank]
            key = output_channel.new_key()
            opened = ray.get(
                actor.open_outputs.remote(self._listener.path, key), timeout=_STARTUP_TIMEOUT_S
            )
            if not opened:
                raise LockstepError(f"DP rank {rank} could not reach {self._listener.path}")
            channel = self._listener.accept(key, timeout_s=_STARTUP_TIMEOUT_S)
            with self._lock:
                self._close_channel(group, rank)
                group.channels[rank] = (actor, channel)

    def _try_channels(self, group: _Group) -> None:
        """A new group, every rank on this host: channels for all, or (where one cannot be
        made) takes for all; no request has been handed to the group yet."""
        try:
            self._open_channels(group, range(len(group.actors)))
        except Exception as error:
            log.warning(
                "outputs come by actor calls: a rank's output channel did not open (%s: %s)",
                type(error).__name__, error,
            )  # fmt: skip
            # The group is not current yet, so no poll reads these: closed here. Every writer
            # started is stopped before any request can reach its rank (a writer left running
            # would take outputs the driver then asks for by takes).
            with self._lock:
                for rank in list(group.channels):
                    group.channels.pop(rank)[1].close()
            stopped = ray.get(
                [actor.stop_outputs.remote(10.0) for actor in group.actors],
                timeout=_STARTUP_TIMEOUT_S,
            )
            if not all(stopped):
                raise LockstepError("a rank's output writer did not stop") from error
            return
        group.channeled = True

    def _open_replacement_channels(self, group: _Group, ranks: list[int]) -> None:
        """After a heal or a grow: the new actors' channels. One that does not open fails
        its rank (the front end heals again), so no rank is left unread."""
        if not group.channeled or not ranks:
            return
        try:
            self._open_channels(group, ranks)
        except Exception as error:
            for rank in ranks:
                if rank not in group.channels:
                    why = f"its output channel did not open ({type(error).__name__}: {error})"
                    self._fail_and_kill(group, rank, why)

    def _close_channel(self, group: _Group, rank: int) -> None:
        """Stop reading ``rank``'s channel; the next poll closes it. Called with the lock."""
        entry = group.channels.pop(rank, None)
        if entry is not None:
            self._dropped.append(entry[1])

    def _close_dropped(self) -> None:
        """Close the channels dropped since; called by the reader (with `_read_lock`)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        for channel in dropped:
            channel.close()

    def _poll_channels(self, group: _Group, timeout_s: float) -> list[RequestOutput]:
        """`poll` for a group whose ranks write their takes to sockets: every frame that
        has come, each answered as the take it stands for would be (`_on_frame`)."""
        outputs: list[RequestOutput] = []
        failure: RankFailure | None = None
        with self._read_lock:
            self._close_dropped()
            with self._lock:
                channels = {
                    rank: entry
                    for rank, entry in group.channels.items()
                    if rank in group.live and rank not in group.failed
                }
            if not channels:
                return []
            waiting = select.poll()  # not select(): a server may hold descriptors past 1024
            by_fd = {}
            for rank, (_, channel) in channels.items():
                fd = channel.fileno()
                if fd >= 0:  # else closed meanwhile (its rank failed): the next poll skips it
                    by_fd[fd] = rank
                    waiting.register(fd, select.POLLIN)
            ready = {by_fd[fd] for fd, _ in waiting.poll(max(0, int(timeout_s * 1000)))}
            for rank, (actor, channel) in channels.items():
                if rank not in ready:
                    continue
                try:
                    frames = channel.read()
                except output_channel.MalformedFrame as error:
                    frames = []
                    why = f"it sent a malformed output frame: {error}"
                    failed = self._fail_and_kill(group, rank, why)
                    failure = failure or failed
                for frame in frames:
                    try:
                        outputs.extend(self._on_frame(group, rank, actor, frame))
                    except RankFailure as error:
                        failure = failure or error
                if channel.closed and _is_current(group, rank, actor) and rank not in group.failed:
                    why = "its process is gone (its output channel closed)"
                    failed = self._fail_and_kill(group, rank, why)
                    failure = failure or failed
        return self._end_poll(group, list(channels), outputs, failure)

    def _on_frame(self, group: _Group, rank: int, actor: Any, frame: tuple) -> list[RequestOutput]:
        """What the take a frame stands for answers: its outputs; or, for a rank that left
        its group, `RankLeftGroup`, unless that group has been healed since or the leaving
        was planned (a grow). A frame from an actor since replaced is old news."""
        if not _is_current(group, rank, actor):
            return []
        group.heard[rank] = time.monotonic()
        if frame[0] == "out":
            return frame[1]
        _, joined, reason = frame
        if joined != group.generation or group.planned:
            return []
        raise RankLeftGroup(rank, reason, group.generation)

    def silent_ranks(self) -> dict[int, float]:
        """Live ranks whose last answer is more than two heartbeats old: rank -> seconds."""
        group = self._group
        now = time.monotonic()
        return {
            rank: now - heard
            for rank, heard in group.heard.items()
            if rank not in group.failed and now - heard > _SILENT_S
        }

    def _actor(self, group: _Group, rank: int) -> Any:
        if rank in group.failed:
            raise RankFailure(rank, group.failed[rank], group.generation)
        if rank in group.absent:
            raise ValueError(f"DP rank {rank} left the group; live ranks: {group.live}")
        return group.actors[rank]

    def _get(
        self, group: _Group, rank: int, ref: Any, actor: Any = None, asked_in: int | None = None
    ) -> Any:
        """A rank's answer, waiting at most the silence limit; a rank that has not answered
        anything for that long is failed (and killed), whichever call noticed; a rank whose
        engine left its failed group raises `RankLeftGroup` (it is not failed: a heal in
        place keeps it). ``actor`` and ``asked_in``: the one asked for a `take` and the
        generation then: if the rank has been replaced since, its death is old news, and if
        the group has been healed since, so is its leaving; either answers nothing."""
        healed_since = asked_in is not None and asked_in != group.generation
        try:
            value = ray.get(ref, timeout=self._silence_limit_s)
        except GroupLeft as error:
            group.heard[rank] = time.monotonic()
            if healed_since or group.planned:
                return []
            raise RankLeftGroup(rank, str(error), group.generation) from error
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as error:
            if actor is not None and group.actors[rank] is not actor:
                return []
            self._declare_failed(group, rank, f"its Ray actor is gone ({type(error).__name__})")
            raise RankFailure(rank, group.failed[rank], group.generation) from error
        except ray.exceptions.GetTimeoutError:
            self._fail_silent(group, rank, time.monotonic() - group.heard.get(rank, 0.0))
        group.heard[rank] = time.monotonic()
        return value

    def _fail_silent(self, group: _Group, rank: int, silent_s: float) -> None:
        """Declare a rank that stopped answering failed, kill it (a stopped process too) and
        raise `RankFailure`."""
        if self._declare_failed(group, rank, f"it stopped answering for {silent_s:.0f} s"):
            log.error("DP rank %d has not answered for %.0f s: killing it", rank, silent_s)
            self._kill(group, rank)
        raise RankFailure(rank, group.failed[rank], group.generation)

    def _fail_and_kill(self, group: _Group, rank: int, why: str) -> RankFailure:
        """Declare ``rank`` failed and kill its actor (if no other call did first); the
        `RankFailure` that says so, for the caller to raise."""
        if self._declare_failed(group, rank, why):
            self._kill(group, rank)
        return RankFailure(rank, group.failed[rank], group.generation)

    def _declare_failed(self, group: _Group, rank: int, why: str) -> bool:
        """Mark ``rank`` failed; True if this call did (another thread may have first)."""
        with self._lock:
            first = rank not in group.failed
            group.failed.setdefault(rank, why)
            group.takes.pop(rank, None)
            group.take_decoders.pop(rank, None)
            self._close_channel(group, rank)
        return first

    def shutdown(self) -> None:
        """Stop every rank, free the placement group, and stop the embedded Ray if we
        started it: nothing stays."""
        self.stop_ranks()
        with self._read_lock:
            self._close_dropped()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
            _reload_auth_settings()  # back to this environment's mode for a later ray.init
        if self._reaper is not None:
            self._reaper.terminate()
            self._reaper.wait(timeout=10)
            self._reaper = None

    def give_up(self) -> None:
        group = self._group
        for rank in group.live:
            if rank not in group.failed:
                group.actors[rank].leave.remote()  # not waited on: a stopped rank would not answer

    def stop_ranks(self) -> None:
        """Stop every rank, then kill the actors and free the placement group; Ray itself
        stays up. Ranks that have gone silent are killed without being asked (they would not
        answer). Waits for a reform under way, and stops the group it started."""
        self._closing.set()
        with self._reform_lock:
            with self._lock:
                ready, self._grown_actors = self._grown_actors, None
            if ready is not None:
                self._kill_actors(ready[1])
            self._stop_group(self._group)

    def _stop_group(self, group: _Group) -> None:
        if group.actors:
            silent = self.silent_ranks() if group.heard else {}
            refs = [
                group.actors[rank].shutdown.remote(30.0)
                for rank in group.live
                if rank not in group.failed and rank not in silent
            ]
            # A dead actor's ref counts as ready; killing below is enough for it.
            ray.wait(refs, num_returns=len(refs), timeout=40.0)
        self._kill_group(group)

    @staticmethod
    def _kill(group: _Group, rank: int) -> None:
        """Kill ``rank``'s actor (`ray.kill`), and SIGKILL its process where it runs on the
        driver's node: a stopped process cannot act on Ray's request, and Ray frees its
        bundle for a replacement only once it has given up asking (about 6 s more of a heal,
        measured); elsewhere `ray.kill` alone does it."""
        ray.kill(group.actors[rank], no_restart=True)
        pid, node = group.pids.get(rank), group.node_ids.get(rank)
        if pid is None or node != ray.get_runtime_context().get_node_id():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

    def _kill_group(self, group: _Group) -> None:
        """Kill every actor of ``group`` without asking it (the calls waiting on one return
        at once, failed) and free its placement group."""
        with self._lock:
            for rank in range(len(group.actors)):
                group.failed.setdefault(rank, "its group was stopped")
                self._close_channel(group, rank)
            group.takes.clear()
        for rank in range(len(group.actors)):
            self._kill(group, rank)
        group.actors = []
        if group.pg is not None:
            remove_placement_group(group.pg)
            group.pg = None


def _is_current(group: _Group, rank: int, actor: Any) -> bool:
    """Whether ``actor`` is still ``rank``'s in ``group`` (not replaced, the group not
    stopped)."""
    actors = group.actors
    return rank < len(actors) and actors[rank] is actor


def describe_per_rank(values: list[str]) -> str:
    """One value when every rank agrees; else each rank's (the backends may differ by host)."""
    if len(set(values)) == 1:
        return values[0]
    return "; ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))


def _prepare_native(config: EngineConfig) -> None:
    from dist_engine.backends import may_use_native
    from dist_engine.distributed.shm_exchange import transport_library
    from dist_engine.kernels import compute

    if config.parallel.dp_size > 1 and config.parallel.moe_exchange != "process_group":
        transport_library()
    if may_use_native(config.backend_settings):
        compute.prepare()


def _describe_nodes() -> str:
    alive = [node for node in ray.nodes() if node.get("Alive")]
    totals = [{k: v for k, v in node["Resources"].items() if k in ("CPU", "GPU")} for node in alive]
    return f"{len(alive)} node(s) with {totals}"


def _cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def _rank_hosts(pg: Any, ranks: Iterable[int]) -> dict[int, str]:
    """rank -> the address of the host its bundle was placed on. Hosts by address, not Ray
    node: several raylets on one machine (a test cluster) share its cores and loopback."""
    nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    address = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    return {rank: address[nodes[rank]] for rank in ranks}


def _cpu_slots(hosts: dict[int, str]) -> dict[int, tuple[int, int]]:
    """rank -> (its index among the ranks placed on the same host, how many there are)."""
    by_host: dict[str, list[int]] = {}
    for rank in sorted(hosts):
        by_host.setdefault(hosts[rank], []).append(rank)
    return {rank: (ranks.index(rank), len(ranks)) for ranks in by_host.values() for rank in ranks}
