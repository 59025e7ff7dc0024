"""How the LLM front end reaches its ranks: in this process, or as Ray actors.

A client submits requests to a given rank, aborts them, polls for outputs from every rank, and
shuts the group down. ``RankFailure`` means a rank's process is gone. A client that can heal
(`RayClient`) replaces a failed group by a new one of the same size (`reform`); each group it
has run is a *generation*, and calls that name one (`generation=`) reach that group or none
(`StaleGroup`), so a call racing a reform never lands in the new group by mistake.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dist_engine.engine.config import EngineConfig
from dist_engine.engine.engine import DPEngine
from dist_engine.engine.outputs import RequestOutput
from dist_engine.engine.stats import RankStats
from dist_engine.errors import LockstepError
from scheduler import SamplingParams


@dataclass(frozen=True)
class Submission:
    """A request handed to a rank.

    seed: the seed the driver fixed for a request whose params give none (so that a
    resubmission draws the same stream); None: the rank draws one. resumed_token_ids: the
    output tokens a resubmitted request had already committed; it continues after them
    (`DPEngine.submit`). sample_group: the key the samples of one `n` request share (its
    request id), so the rank computes their prompt once (scheduler/samples.py); they are
    routed to one rank. deferred: the caller reads this request's terminal output only
    with the rest of its batch (`LLM.generate`), so the rank may hold it back a while to
    hand it over with others (`EngineHost.take`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool  # report new tokens as they come, not only the terminal result
    seed: int | None = None
    resumed_token_ids: tuple[int, ...] = ()
    sample_group: str | None = None
    deferred: bool = False


class Client(Protocol):
    """How a front end (the `LLM`, the server) reaches its group's ranks. Every call returns
    within a bound: a rank that stops answering is failed (`RankFailure`), never waited on
    forever."""

    num_ranks: int  # DP ranks: requests are routed to `live_ranks` among range(num_ranks)
    live_ranks: list[int]  # the DP ranks of the group now running (fewer once it shrank)
    moe_exchange: str  # how the MoE all-to-alls travel (`LLM.moe_exchange`)
    backends: str  # the backends the ranks resolved (`LLM.backends`)
    generation: int  # the group now running: 0, then one more per `reform`
    can_reform: bool  # whether `reform` can replace a failed group

    def submit(self, rank: int, batch: list[Submission], generation: int | None = None) -> None:
        """Hand ``batch`` to ``rank``; with ``generation``, only if that group still runs
        (else `StaleGroup`)."""
        ...

    def abort(self, rank: int, request_id: str, generation: int | None = None) -> None: ...

    def poll(self, timeout_s: float, generation: int | None = None) -> list[RequestOutput]:
        """Outputs from any rank, waiting up to ``timeout_s`` for the first; with
        ``generation``, outputs of that group only (none once it has been replaced)."""
        ...

    def stats(self, timeout_s: float | None = None) -> list[RankStats]: ...

    def reform(self) -> set[int]:
        """Replace the failed group's failed ranks, or the whole group, by new ones (each
        loading its share of the experts), or shrink it onto its survivors, and advance
        `generation`. Returns the ranks whose requests are gone (the caller resubmits those,
        to `live_ranks`); the other ranks kept their processes and go on with their requests.
        Raises (and leaves no group running) if the new group cannot start."""
        ...

    def grow_ready(self) -> bool:
        """Whether a group that shrank can grow back now (its replacements have loaded)."""
        ...

    def grow(self) -> set[int]:
        """Grow a shrunk group back to its full size (a planned re-form that keeps every
        request where it is) and advance `generation`; returns the ranks that joined."""
        ...

    def kept_since(self, rank: int, generation: int) -> bool:
        """Whether ``rank`` is the same process as in group ``generation``: its outputs polled
        from that group still belong to its requests."""
        ...

    def give_up(self) -> None:
        """The failed group will not be re-formed: ranks waiting to be taken into a new one
        fail their requests now (`ErrorKind.GROUP_FAILED`) instead of waiting on."""
        ...

    def silent_ranks(self) -> dict[int, float]:
        """Live ranks that have not answered lately: rank -> seconds."""
        ...

    def stop_ranks(self) -> None:
        """Stop the ranks, leaving the client's runtime up (after a failure)."""
        ...

    def shutdown(self) -> None: ...


class RankFailure(RuntimeError):
    """A rank of group ``generation`` is gone or has stopped answering."""

    def __init__(self, rank: int, detail: str, generation: int = 0) -> None:
        super().__init__(f"DP rank {rank} died: {detail}")
        self.rank = rank
        self.generation = generation


class RankLeftGroup(RankFailure):
    """Rank ``rank`` of group ``generation`` is alive, but its group failed (a collective did):
    its engine abandoned the step and waits, with its requests and KV, to be taken into a
    re-formed group (`RayClient.reform`)."""

    def __init__(self, rank: int, detail: str, generation: int = 0) -> None:
        RuntimeError.__init__(self, f"DP rank {rank} left its failed group: {detail}")
        self.rank = rank
        self.generation = generation


class GroupLeft(RuntimeError):
    """What a rank's `take` raises, once its outputs are out, while its engine waits for a
    re-formed group: the driver learns of the failure even where no rank died."""


class StaleGroup(RuntimeError):
    """A call named a group that has been replaced; nothing was sent."""

    def __init__(self, asked: int, running: int) -> None:
        super().__init__(f"group {asked} has been replaced by group {running}")


# Who reads each client's outputs (`claim_outputs`): a client hands every output out once.
_readers: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_readers_lock = threading.Lock()


def claim_outputs(client: Any, reader: str) -> None:
    """Make ``reader`` (an `LLM.generate` call, a server) the one reader of ``client``'s
    outputs until `release_outputs`. `poll` hands each output to whoever polls first, so two
    readers would each take, and drop, outputs of the other's requests and wait for them
    forever; the second is refused at once instead (LockstepError, naming the first)."""
    with _readers_lock:
        holder = _readers.get(client)
        if holder is not None:
            raise LockstepError(
                f"{reader} cannot read this DP group's outputs while {holder} reads them (each "
                f"output goes to one reader); finish or close that first, or send the requests "
                f"through it. LLM is not thread-safe, as vLLM's is not."
            )
        _readers[client] = reader


def release_outputs(client: Any, reader: str) -> None:
    with _readers_lock:
        if _readers.get(client) == reader:
            del _readers[client]


@contextlib.contextmanager
def reading_outputs(client: Any, reader: str) -> Iterator[None]:
    """`claim_outputs` for the block."""
    claim_outputs(client, reader)
    try:
        yield
    finally:
        release_outputs(client, reader)


# How long a take that woke inside a step's burst of outputs waits for the burst's end.
_BURST_WAIT_S = 0.005
# How long a take may hold outputs of deferred requests back to gather more (EngineHost.take).
_HOLD_S = 0.25


class OutputBuffer:
    """Outputs of one engine, collected on its loop thread and handed out in batches.

    A step emits its outputs in one burst (`begin_burst` .. `end_burst`, the engine's
    `output_burst` hooks). A take that wakes at the burst's first output waits for its end
    (at most `_BURST_WAIT_S`) and takes the whole step's outputs at once: a take that woke
    at once took ~2 of 3 of them here and left the rest for another take (for a Ray rank
    another actor call, ~2 ms of CPU between the two ends). Nothing waits to be put: an
    output outside a burst is taken as soon as it comes, and one inside it as soon as the
    burst ends (or `burst_wait_s` after the take woke).

    A take may also be asked to hold what it has (`take`'s ``hold``) and gather more: it then
    wakes at the end of each burst that had outputs and at each output put outside one."""

    def __init__(self, burst_wait_s: float = _BURST_WAIT_S) -> None:
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        # Notified at the end of a burst that had outputs, and at each output outside one.
        self._burst = threading.Condition()
        self._in_burst = False
        self._burst_had_outputs = False
        self._burst_wait_s = burst_wait_s

    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)
        if self._in_burst:  # a burst's outputs wake a waiting take once, at its end
            self._burst_had_outputs = True
        else:
            with self._burst:
                self._burst.notify_all()

    def begin_burst(self) -> None:
        with self._burst:
            self._in_burst = True

    def end_burst(self) -> None:
        with self._burst:
            self._in_burst = False
            if self._burst_had_outputs:
                self._burst_had_outputs = False
                self._burst.notify_all()

    def take(
        self,
        timeout_s: float,
        hold: Callable[[list[RequestOutput]], bool] | None = None,
        hold_s: float = _HOLD_S,
    ) -> list[RequestOutput]:
        """The outputs there are, waiting up to ``timeout_s`` for the first. With ``hold``:
        while ``hold(outputs so far)`` is true, keep them and gather more, up to ``hold_s``
        after the first (asked again whenever more outputs came)."""
        try:
            first = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return []
        with self._burst:
            self._burst.wait_for(lambda: not self._in_burst, self._burst_wait_s)
        items = [first]
        self._drain(items)
        if hold is None or not hold(items):
            return items
        deadline = time.monotonic() + hold_s
        with self._burst:
            while (left := deadline - time.monotonic()) > 0:
                self._burst.wait(left)
                self._drain(items)
                if not self._in_burst and not hold(items):
                    break
            self._burst.wait_for(lambda: not self._in_burst, self._burst_wait_s)
        self._drain(items)
        return items

    def _drain(self, items: list[RequestOutput]) -> None:
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return


# How long an engine whose group failed waits to be taken into a re-formed one.
_REJOIN_WAIT_S = 900.0


class EngineHost:
    """One rank's engine on a thread of its own; used in-process and inside Ray actors.

    The thread builds the engine (model load) as well as running its loop, so every parallel
    torch op of the rank runs on that one thread. OpenMP (libgomp) keeps a worker pool per
    thread that has run a parallel region; once two pools exist and their threads outnumber
    the cores, it stops spinning between regions and every parallel op pays a futex wake-up:
    loading on the caller's thread and stepping on this one slowed every step of a 2-thread
    rank on 2 cores (docs/benchmark_notes.md, "End to end", has the measurement). Torch work
    the caller does on its own threads still costs that.
    """

    def __init__(
        self,
        config: EngineConfig,
        dist_ctx: Any = None,
        *,
        rejoinable: bool = False,
        join_as: tuple[int, int] | None = None,
    ) -> None:
        """rejoinable: when the group fails, the engine keeps its requests and waits for a
        re-formed group (`detach`, then `join`) instead of failing them. join_as: (rank,
        group size) of a replacement rank, built without a group; it runs once `join`ed."""
        self.outputs = OutputBuffer()
        self.error: str | None = None
        self.engine: DPEngine | None = None
        self.num_threads = 0  # torch threads of the engine thread, once built
        self._build_error: BaseException | None = None
        self._rejoinable = rejoinable or join_as is not None
        # The re-formed group's context, handed from `join` to the engine thread (None: none
        # will come); `_waiting` is set while the engine thread waits for one, `_joined` once it
        # joined (or failed to: `_join_error`).
        self._groups: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waiting = threading.Event()
        self._joined = threading.Event()
        self._join_error: BaseException | None = None
        self._deferred: set[str] = set()  # the ids of deferred requests not yet taken as ended
        built = threading.Event()
        self.thread = threading.Thread(
            target=self._main,
            args=(config, dist_ctx, built, join_as),
            name="lockstep-engine",
            daemon=True,
        )
        self.thread.start()
        built.wait()
        if self._build_error is not None:
            self.thread.join()
            raise self._build_error

    def _main(
        self,
        config: EngineConfig,
        dist_ctx: Any,
        built: threading.Event,
        join_as: tuple[int, int] | None,
    ) -> None:
        try:
            # Set on this thread even when unchanged: MKL keeps its thread count per thread,
            # and a new thread otherwise takes OMP_NUM_THREADS (Ray actors and torchrun set it
            # to 1) whatever torch.get_num_threads() says.
            torch.set_num_threads(config.parallel.threads_per_rank or torch.get_num_threads())
            self.num_threads = torch.get_num_threads()
            self.engine = DPEngine(config, dist_ctx, on_output=self.outputs.put, join_as=join_as)
            self.engine.output_burst = (self.outputs.begin_burst, self.outputs.end_burst)
            if self._rejoinable:
                self.engine.rejoin = self._await_group
                self.engine.on_joined = self._joined.set
        except BaseException as error:  # raised again on the caller's thread
            self._build_error = error
            return
        finally:
            built.set()
        try:
            if join_as is not None:
                ctx = self._await_group(None)
                if ctx is None:
                    self.error = "no group to join came"
                    return
                self.engine.join_group(ctx)
                self._joined.set()
            self.engine.run()
        except BaseException as error:  # reported through status(); the outputs carry it too
            self.error = f"{type(error).__name__}: {error}"
            self._join_error = self._join_error or error
            self._joined.set()  # a `join` waiting for this thread learns it failed

    # -- healing in place (launcher/ray_launcher.py drives it) ------------------------------
    def _await_group(self, old_ctx: Any) -> Any:
        """On the engine thread, after its group failed: wait for `join` to hand over the
        re-formed group's context (None: there will be none)."""
        self._joined.clear()
        self._join_error = None
        self._waiting.set()
        try:
            return self._groups.get(timeout=_REJOIN_WAIT_S)
        except queue.Empty:
            return None
        finally:
            self._waiting.clear()

    def detach(self, timeout_s: float) -> str:
        """Wait (up to ``timeout_s``) for the engine to leave its failed group: "detached" once
        it waits for a new one with its requests, "stopped" if its loop ended, "running" if
        it has not noticed the failure (its next collective will fail). A sleeping loop is
        woken, so that it notices."""
        if not self._rejoinable:
            return "stopped" if not self.thread.is_alive() else "running"
        if not self._waiting.is_set():
            # A sleeping loop wakes on the store, which may be gone or held by a stopped rank
            # (a call into it would then block): bumped on a thread of its own.
            threading.Thread(target=self._bump, name="lockstep-detach", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._waiting.is_set():
                return "detached"
            if not self.thread.is_alive():
                return "stopped"
            self._waiting.wait(0.05)
        return "detached" if self._waiting.is_set() else "running"

    def _bump(self) -> None:
        with contextlib.suppress(Exception):  # the loop notices the failure anyway
            self.engine.wake.bump()

    def join(self, ctx: Any, timeout_s: float) -> None:
        """Hand the re-formed group's context to the waiting engine thread and wait until it
        has joined (`DPEngine.join_group`); raises what went wrong."""
        if not self._waiting.wait(timeout_s):
            raise RuntimeError("the engine is not waiting for a group to join")
        self._groups.put(ctx)
        if not self._joined.wait(timeout_s):
            raise RuntimeError(f"the engine did not join within {timeout_s:.0f} s")
        if self._join_error is not None:
            raise RuntimeError(f"joining failed: {self._join_error}") from self._join_error

    def wait_rejoined(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for an engine that left its group to join another."""
        self._joined.wait(timeout_s)

    def leave(self) -> None:
        """Tell a waiting engine that no group will come: it fails its requests and stops."""
        self._groups.put(None)

    def submit(self, batch: list[Submission]) -> None:
        """Post every request of the batch, then wake the group once."""
        if not batch:
            return
        self._deferred.update(item.request_id for item in batch if item.deferred)
        try:
            for item in batch:
                self.engine.submit(
                    item.request_id,
                    item.prompt_token_ids,
                    item.params,
                    stream=item.stream,
                    seed=item.seed,
                    resumed_token_ids=item.resumed_token_ids,
                    sample_group=item.sample_group,
                    wake=False,
                )
        finally:
            self.engine.wake_up()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def take(self, timeout_s: float) -> list[RequestOutput]:
        """The engine's outputs, waiting up to ``timeout_s`` for one; raises `GroupLeft`, once
        they are all out, while the engine waits for a re-formed group.

        Terminal outputs of deferred requests (`Submission.deferred`: `LLM.generate`, whose
        caller reads nothing before the whole batch ends) are held back, at most `_HOLD_S`,
        while the engine still has requests, so that they leave together: every take is a
        round trip between processes for a Ray rank, and one per finishing step cost a
        DP=1 group ~10% of its tok/s on a 2-core host (docs/benchmark_notes.md, "A Ray rank
        against the same engine in-process"). Any other output ends the hold at once."""
        waiting = self._waiting.is_set()
        outputs = self.outputs.take(0.0 if waiting else timeout_s, None if waiting else self._hold)
        for output in outputs:
            if output.finished:
                self._deferred.discard(output.request_id)
        if not outputs and self._waiting.is_set():
            raise GroupLeft(self.engine.left_because or "its group failed")
        return outputs

    def _hold(self, outputs: list[RequestOutput]) -> bool:
        """Whether a take should keep ``outputs`` and gather more: all are deferred requests'
        ends, and the engine runs and still has requests."""
        engine = self.engine
        return (
            all(o.finished and o.request_id in self._deferred for o in outputs)
            and engine is not None
            and engine.scheduler.num_unfinished > 0
            and not self._waiting.is_set()
            and self.thread.is_alive()
        )

    def stats(self) -> RankStats:
        """The rank's queues, KV pool and counters, with the loop's error if it failed."""
        return self.engine.stats(self.error)

    def shutdown(self, timeout_s: float) -> str | None:
        if self._rejoinable and self._waiting.is_set():
            # Waiting for a re-formed group: none will come (the failed group's store, which
            # a shutdown message would wake it through, may be gone).
            self._groups.put(None)
        else:
            self.engine.shutdown()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            return "engine loop did not stop"
        return self.error


class HostedClient:
    """A client whose rank runs in this process (`EngineHost`): its calls go straight to the
    host, and the group is never re-formed from here. Subclasses set the group's shape, build
    `self.host`, and say why `reform` cannot be done (`_no_reform`)."""

    num_ranks: int
    live_ranks: list[int]
    moe_exchange: str
    backends: str
    host: EngineHost
    generation = 0
    can_reform = False
    _no_reform: str  # why `reform` cannot be done, set by each subclass

    def submit(self, rank: int, batch: list[Submission], generation: int | None = None) -> None:
        self.host.submit(batch)

    def abort(self, rank: int, request_id: str, generation: int | None = None) -> None:
        self.host.abort(request_id)

    def poll(self, timeout_s: float, generation: int | None = None) -> list[RequestOutput]:
        return self.host.take(timeout_s)

    def reform(self) -> set[int]:
        raise RuntimeError(self._no_reform)

    def kept_since(self, rank: int, generation: int) -> bool:
        return True  # never re-formed

    def grow_ready(self) -> bool:
        return False  # never shrinks

    def grow(self) -> set[int]:
        return set()

    def give_up(self) -> None:
        pass  # its engine never waits for a new group

    def stats(self, timeout_s: float | None = None) -> list[RankStats]:
        """This process's rank, a snapshot taken on the caller's thread: it never waits on the
        engine's loop (under torchrun the other ranks are other processes' to report)."""
        return [self.host.stats()]

    def silent_ranks(self) -> dict[int, float]:
        # In this process a stopped rank is a stopped server; under torchrun a silent peer
        # surfaces as this rank's collective timeout.
        return {}


class LocalClient(HostedClient):
    """A group of one, in this process."""

    # The rank is this process: nothing is left to re-form a group with.
    _no_reform = (
        "a group of one in this process cannot be re-formed (parallel.launcher local): "
        "its rank is this process"
    )

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.dp_size != 1:
            raise ValueError(
                f"the local launcher runs one rank; parallel.dp_size is {config.parallel.dp_size} "
                "(use launcher ray or torchrun)"
            )
        self.num_ranks = 1
        self.live_ranks = [0]
        self.moe_exchange = "none"  # one rank: its MoE layers exchange nothing
        self.host = EngineHost(config)
        self.backends = self.host.engine.describe_compute()

    def stop_ranks(self) -> None:
        self.host.shutdown(timeout_s=30.0)

    def shutdown(self) -> None:
        self.host.shutdown(timeout_s=30.0)


def group_max_model_len(client: Client, engine_config: EngineConfig) -> int:
    """The group's max_model_len: the configured one, or, when the config leaves it unset,
    the one the ranks resolved at start-up (the model's, capped by the KV pool; the ranks
    agree on it), which they report in their stats."""
    configured = engine_config.scheduler.max_model_len
    if configured is not None:
        return configured
    resolved = {stats.max_model_len for stats in client.stats()} - {None}
    if len(resolved) != 1:
        raise LockstepError(
            f"the ranks did not report one max_model_len (got {sorted(resolved)}); "
            f"set scheduler.max_model_len"
        )
    return resolved.pop()
