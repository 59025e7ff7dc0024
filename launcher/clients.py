"""How the LLM front end reaches its ranks: in this process, or as Ray actors.

A client submits requests to a given rank, aborts them, polls for outputs from every rank, and
shuts the group down. ``RankFailure`` means a rank's process is gone. A client that can heal
(`RayClient`) replaces a failed group by a new one of the same size (`reform`); each group it
has run is a *generation*, and calls that name one (`generation=`) reach that group or none
(`StaleGroup`), so a call racing a reform never lands in the new group by mistake.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dist_engine.engine.config import EngineConfig
from dist_engine.engine.engine import DPEngine
from dist_engine.engine.outputs import RequestOutput
from dist_engine.engine.stats import RankStats
from scheduler import SamplingParams


@dataclass(frozen=True)
class Submission:
    """A request handed to a rank.

    seed: the seed the driver fixed for a request whose params give none (so that a
    resubmission draws the same stream); None: the rank draws one. resumed_token_ids: the
    output tokens a resubmitted request had already committed; it continues after them
    (`DPEngine.submit`). sample_group: the key the samples of one `n` request share (its
    request id), so the rank computes their prompt once (scheduler/samples.py); they are
    routed to one rank."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool  # report new tokens as they come, not only the terminal result
    seed: int | None = None
    resumed_token_ids: tuple[int, ...] = ()
    sample_group: str | None = None


class Client(Protocol):
    """How a front end (the `LLM`, the server) reaches its group's ranks. Every call returns
    within a bound: a rank that stops answering is failed (`RankFailure`), never waited on
    forever."""

    num_ranks: int
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

    def reform(self) -> None:
        """Replace the group by a new one of the same size: stop every rank that is left,
        start new ones (each loading its share of the experts), and advance `generation`.
        Requests the old group held are gone; the caller resubmits them. Raises (and leaves
        no group running) if the new group cannot start."""
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


class StaleGroup(RuntimeError):
    """A call named a group that has been replaced; nothing was sent."""

    def __init__(self, asked: int, running: int) -> None:
        super().__init__(f"group {asked} has been replaced by group {running}")


class OutputBuffer:
    """Outputs of one engine, collected on its loop thread and handed out in batches."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def take(self, timeout_s: float) -> list[RequestOutput]:
        try:
            first = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return []
        items = [first]
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items


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

    def __init__(self, config: EngineConfig, dist_ctx: Any = None) -> None:
        self.outputs = OutputBuffer()
        self.error: str | None = None
        self.engine: DPEngine | None = None
        self.num_threads = 0  # torch threads of the engine thread, once built
        self._build_error: BaseException | None = None
        built = threading.Event()
        self.thread = threading.Thread(
            target=self._main, args=(config, dist_ctx, built), name="lockstep-engine", daemon=True
        )
        self.thread.start()
        built.wait()
        if self._build_error is not None:
            self.thread.join()
            raise self._build_error

    def _main(self, config: EngineConfig, dist_ctx: Any, built: threading.Event) -> None:
        try:
            # Set on this thread even when unchanged: MKL keeps its thread count per thread,
            # and a new thread otherwise takes OMP_NUM_THREADS (Ray actors and torchrun set it
            # to 1) whatever torch.get_num_threads() says.
            torch.set_num_threads(config.parallel.threads_per_rank or torch.get_num_threads())
            self.num_threads = torch.get_num_threads()
            self.engine = DPEngine(config, dist_ctx, on_output=self.outputs.put)
        except BaseException as error:  # raised again on the caller's thread
            self._build_error = error
            return
        finally:
            built.set()
        try:
            self.engine.run()
        except BaseException as error:  # reported through status(); the outputs carry it too
            self.error = f"{type(error).__name__}: {error}"

    def submit(self, batch: list[Submission]) -> None:
        for item in batch:
            self.engine.submit(
                item.request_id,
                item.prompt_token_ids,
                item.params,
                stream=item.stream,
                seed=item.seed,
                resumed_token_ids=item.resumed_token_ids,
                sample_group=item.sample_group,
            )

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def take(self, timeout_s: float) -> list[RequestOutput]:
        return self.outputs.take(timeout_s)

    def stats(self) -> RankStats:
        """The rank's queues, KV pool and counters, with the loop's error if it failed."""
        return self.engine.stats(self.error)

    def shutdown(self, timeout_s: float) -> str | None:
        self.engine.shutdown()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            return "engine loop did not stop"
        return self.error


class LocalClient:
    """A group of one, in this process."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.dp_size != 1:
            raise ValueError(
                f"the local launcher runs one rank; parallel.dp_size is {config.parallel.dp_size} "
                "(use launcher ray or torchrun)"
            )
        self.num_ranks = 1
        self.moe_exchange = "none"  # one rank: its MoE layers exchange nothing
        # The rank is this process: nothing is left to re-form a group with.
        self.generation = 0
        self.can_reform = False
        self.host = EngineHost(config)
        self.backends = self.host.engine.describe_compute()

    def submit(self, rank: int, batch: list[Submission], generation: int | None = None) -> None:
        self.host.submit(batch)

    def abort(self, rank: int, request_id: str, generation: int | None = None) -> None:
        self.host.abort(request_id)

    def poll(self, timeout_s: float, generation: int | None = None) -> list[RequestOutput]:
        return self.host.take(timeout_s)

    def reform(self) -> None:
        raise RuntimeError(
            "a group of one in this process cannot be re-formed (parallel.launcher local): "
            "its rank is this process"
        )

    def stats(self, timeout_s: float | None = None) -> list[RankStats]:
        """A snapshot taken on the caller's thread: it never waits on the engine's loop."""
        return [self.host.stats()]

    def silent_ranks(self) -> dict[int, float]:
        return {}  # in this process: a stopped rank is a stopped server

    def stop_ranks(self) -> None:
        self.host.shutdown(timeout_s=30.0)

    def shutdown(self) -> None:
        self.host.shutdown(timeout_s=30.0)
