"""The asyncio side of a DP group: requests in, each request's outputs out as an async stream.

A client (`LocalClient`, `RayClient`) is blocking, so two threads stand between it and the
event loop:

- the *poller* waits on `client.poll` and hands each batch of outputs to the loop, which puts
  every output in its request's queue;
- one *courier* per rank carries submissions and aborts to its rank in the order they were
  made (batched when several wait), so an abort never overtakes its request's submission,
  and a rank that stops answering holds up only its own requests;
- the *monitor* asks every rank for its stats once a second (with a short timeout), keeps the
  latest for `/metrics`, hands them to the server's stats line (`on_stats`), and notices a
  rank whose loop died without its process dying.

No request path waits on stats, and neither `/health` nor `/metrics` waits on a rank: both
answer from what the threads last saw. Every call into a rank is bounded by the client (a rank
silent past its limit is failed), so a stopped rank ends in a failed group, not a frozen one.

Every request is submitted with streaming on, so the server sees each token when the rank
reports it, whether or not the HTTP client streams. A request stays open here until its rank
reports its end, even after its HTTP client has gone: that is when its blocks are free, and
what `max_pending_requests` counts.

A failed group (`RankFailure` from the client, or a rank reporting its loop failed) ends every
open request with an error naming the rank, refuses new ones, and shuts the remaining ranks
down; `/health` then says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dist_engine.engine.outputs import ErrorKind, RequestOutput
from dist_engine.engine.stats import RankStats
from dist_engine.log import get_logger
from launcher.clients import Client, RankFailure, Submission
from launcher.routing import Router
from scheduler import SamplingParams

_POLL_S = 0.05
_RANK_CHECK_S = 1.0  # how often the monitor asks the ranks for their stats
_STATS_TIMEOUT_S = 1.0
_FRESH_STATS_TIMEOUT_S = 0.5  # /metrics: how long a scrape waits for fresh stats

log = get_logger()


class Unavailable(Exception):
    """The server cannot take a request now: overloaded, draining, or its group failed."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class _Submit:
    submission: Submission


@dataclass(frozen=True)
class _Abort:
    request_id: str


_Command = _Submit | _Abort  # what a courier carries to its rank


@dataclass
class _Open:
    rank: int
    prompt_token_ids: list[int]
    queue: asyncio.Queue[RequestOutput]
    abort_reason: str | None = None  # set when the server, not the client, ended it


class RequestStream:
    """One request's outputs, in order: new tokens as they come, then exactly one finished."""

    def __init__(self, frontend: EngineFrontend, request_id: str, entry: _Open) -> None:
        self.frontend = frontend
        self.request_id = request_id
        self.rank = entry.rank
        self._queue = entry.queue
        self.finished = False

    async def next(self) -> RequestOutput:
        output = await self._queue.get()
        self.finished = output.finished
        return output

    def abort(self) -> None:
        """The client is gone or has what it wanted: free the request's blocks on its rank."""
        if not self.finished:
            self.frontend.abort(self.request_id)
            self.finished = True


class EngineFrontend:
    def __init__(
        self,
        client: Client,
        *,
        routing: str,
        max_pending_requests: int,
        on_stats: Callable[[list[RankStats], float], object] | None = None,
    ) -> None:
        """``on_stats(stats, now)`` runs on the event loop with each of the monitor's fresh
        stats (about once a second; never on a request's path)."""
        self.client = client
        self.on_stats = on_stats
        self.num_ranks: int = client.num_ranks
        self.router = Router(self.num_ranks, routing)
        self.max_pending_requests = max_pending_requests
        self.failure: str | None = None
        self.draining = False
        self.latest_stats: list[RankStats] = []
        self._open: dict[str, _Open] = {}
        self._num_admitted = 0  # requests being read and tokenized (see `admission`)
        self._idle = asyncio.Event()
        # One queue per rank's courier; None tells it to stop.
        self._commands: list[queue.SimpleQueue[_Command | None]] = [
            queue.SimpleQueue() for _ in range(self.num_ranks)
        ]
        self._stopping = threading.Event()
        self._ranks_stopping = threading.Event()  # set when a failure starts stopping the ranks
        self._ranks_down = threading.Event()  # set once they are stopped
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []

    # -- lifetime ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the poller and the courier; call from the event loop that will serve."""
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        threads = [(self._poll_loop, (), "poller"), (self._monitor_loop, (), "monitor")]
        threads += [
            (self._courier_loop, (rank,), f"courier-{rank}") for rank in range(self.num_ranks)
        ]
        for target, args, name in threads:
            thread = threading.Thread(
                target=target, args=args, name=f"lockstep-{name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    async def drain(self, timeout_s: float) -> int:
        """Take no new requests; wait up to ``timeout_s`` for the open ones to end, then end
        the rest with an error. Returns how many had to be ended."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return 0
        except asyncio.TimeoutError:
            pass
        left = list(self._open)
        reason = f"the server shut down before the request finished (drain timeout {timeout_s} s)"
        for request_id in left:
            self.abort(request_id, reason)
        try:  # the ranks answer aborts within a step; don't hang on a stuck one
            await asyncio.wait_for(self._idle.wait(), 10.0)
        except asyncio.TimeoutError:
            self._end_all(reason)
        return len(left)

    async def close(self) -> None:
        """Stop the threads and shut the group down.

        Waits on threads of its own, never the loop's executor: threads stuck in a call to a
        silent rank (each bounded by the client) must not hold up the shutdown."""
        self._stopping.set()
        for commands in self._commands:
            commands.put(None)
        await _in_thread(lambda: [thread.join(5.0) for thread in self._threads])
        if self._ranks_stopping.is_set():  # a failure began stopping the ranks: let it finish
            await _in_thread(lambda: self._ranks_down.wait(120.0))
        await _in_thread(self._shutdown_client)

    def _shutdown_client(self) -> None:
        try:
            self.client.shutdown()
        except Exception as error:  # the group is going away anyway; say so and move on
            log.warning("shutting the DP group down failed: %s", error)

    def _stop_ranks(self) -> None:
        """After a failure: stop what is left of the group, keeping the client's runtime (an
        embedded Ray) up until the server stops. Ray's shutdown resets the process's SIGTERM
        handler, so shutting it down here would leave the server unable to stop cleanly."""
        try:
            self.client.stop_ranks()
        except Exception as error:
            log.warning("stopping the rest of the DP group failed: %s", error)
        finally:
            self._ranks_down.set()

    # -- requests (event loop thread) -------------------------------------------------------
    @contextlib.contextmanager
    def admission(self) -> Iterator[None]:
        """Hold a place for a request while its body is read and tokenized: it counts toward
        `max_pending_requests` from before its first byte is read until it is open (or
        refused), so a flood of large bodies waits in no unbounded queue."""
        self._check_available()
        num_held = len(self._open) + self._num_admitted
        if num_held >= self.max_pending_requests:
            raise Unavailable(
                f"{num_held} requests are open, which is the limit "
                f"(server.max_pending_requests = {self.max_pending_requests}); retry later",
                retry_after_s=1,
            )
        self._num_admitted += 1
        try:
            yield
        finally:
            self._num_admitted -= 1

    def _check_available(self) -> None:
        if self.failure is not None:
            raise Unavailable(f"the DP group failed: {self.failure}")
        if self.draining:
            raise Unavailable("the server is shutting down")

    def open_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        dp_rank: int | None,
    ) -> RequestStream:
        """Open an admitted request (see `admission`) on a rank."""
        self._check_available()  # the group may have failed while the request was prepared
        rank = self.router.assign(request_id, len(prompt_token_ids) + params.max_tokens, dp_rank)
        entry = _Open(rank, prompt_token_ids, asyncio.Queue())
        self._open[request_id] = entry
        self._idle.clear()
        # Streaming on, whatever the HTTP client asked: the server sees every token as it comes.
        submission = Submission(request_id, prompt_token_ids, params, stream=True)
        self._commands[rank].put(_Submit(submission))
        return RequestStream(self, request_id, entry)

    def abort(self, request_id: str, reason: str | None = None) -> None:
        entry = self._open.get(request_id)
        if entry is None:
            return
        if reason is not None:
            entry.abort_reason = reason
        self._commands[entry.rank].put(_Abort(request_id))

    @property
    def num_open(self) -> int:
        return len(self._open)

    def health(self) -> tuple[bool, str]:
        """Never waits on a rank: the failure the threads recorded, or the ranks that have
        not answered lately (still healthy until the client declares them failed)."""
        if self.failure is not None:
            return False, f"the DP group failed: {self.failure}"
        if self.draining:
            return False, "draining: the server is shutting down"
        silent = self.client.silent_ranks()
        if silent:
            named = ", ".join(f"DP rank {r} for {s:.0f} s" for r, s in sorted(silent.items()))
            return True, f"ok; not answering: {named}"
        return True, "ok"

    async def stats(self, timeout_s: float = _FRESH_STATS_TIMEOUT_S) -> list[RankStats]:
        """Every rank's stats: asked afresh, waiting at most ``timeout_s`` (the client's own
        timeout bounds the thread that asks); else the monitor's latest, at most about a
        second old (a silent rank's are its last, with `silent_s` set)."""
        if self.failure is None and not self._stopping.is_set():
            try:
                stats = await asyncio.wait_for(
                    _in_thread(lambda: self.client.stats(timeout_s)), timeout_s + 0.2
                )
            except RankFailure as failure:
                self._fail_group(str(failure))
            except (asyncio.TimeoutError, Exception) as error:
                log.debug("fresh stats unavailable: %r", error)
            else:
                self._check_stats(stats)
        return self.latest_stats

    # -- outputs and failures (event loop thread) -------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            entry = self._open.get(output.request_id)
            if entry is None:
                continue
            if output.finished:
                self._close(output.request_id)
                if entry.abort_reason is not None and output.finish_reason == "abort":
                    output = dataclasses.replace(
                        output,
                        finish_reason=f"error: {entry.abort_reason}",
                        error_kind=ErrorKind.ENGINE_STOPPED,
                    )
            entry.queue.put_nowait(output)

    def _close(self, request_id: str) -> None:
        del self._open[request_id]
        self.router.finished(request_id)
        if not self._open:
            self._idle.set()

    def _check_stats(self, stats: list[RankStats]) -> None:
        self.latest_stats = stats
        for rank_stats in stats:
            if rank_stats.error is not None:
                self._fail_group(f"DP rank {rank_stats.dp_rank} stopped: {rank_stats.error}")
                return

    def _monitor_report(self, stats: list[RankStats]) -> None:
        self._check_stats(stats)
        if self.on_stats is not None and self.failure is None:
            self.on_stats(stats, time.monotonic())

    def _fail_group(self, message: str) -> None:
        if self.failure is not None:
            return
        self.failure = message
        log.error("the DP group failed: %s; ending %d open request(s)", message, len(self._open))
        self._end_all(message)
        # Free what is left of the group; the server keeps answering, unhealthy, until stopped.
        self._ranks_stopping.set()
        threading.Thread(target=self._stop_ranks, name="lockstep-stop-ranks").start()

    def _end_all(self, reason: str) -> None:
        for request_id, entry in list(self._open.items()):
            self._close(request_id)
            entry.queue.put_nowait(
                RequestOutput.failed(
                    request_id,
                    entry.prompt_token_ids,
                    reason,
                    entry.rank,
                    time.monotonic(),
                    ErrorKind.ENGINE_STOPPED if self.failure is None else ErrorKind.GROUP_FAILED,
                )
            )

    def _from_thread(self, callback: Any, *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            # The loop may close in between: then nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(callback, *args)

    # -- threads ----------------------------------------------------------------------------
    def _poll_loop(self) -> None:
        while not self._stopping.is_set() and self.failure is None:
            try:
                outputs = self.client.poll(_POLL_S)
                if outputs:
                    self._from_thread(self._deliver, outputs)
            except RankFailure as failure:
                self._from_thread(self._fail_group, str(failure))
                return
            except Exception as error:
                if self._stopping.is_set():
                    return
                self._from_thread(self._fail_group, f"polling the ranks failed: {error!r}")
                return

    def _monitor_loop(self) -> None:
        while not self._stopping.is_set() and self.failure is None:
            try:
                self._from_thread(self._monitor_report, self.client.stats(_STATS_TIMEOUT_S))
            except RankFailure as failure:
                self._from_thread(self._fail_group, str(failure))
                return
            except Exception as error:
                if not self._stopping.is_set():
                    log.warning("the ranks did not report their stats: %r", error)
            self._stopping.wait(_RANK_CHECK_S)

    def _courier_loop(self, rank: int) -> None:
        commands = self._commands[rank]
        while True:
            batch = [commands.get()]
            while True:
                try:
                    batch.append(commands.get_nowait())
                except queue.Empty:
                    break
            if None in batch:
                return
            self._carry(rank, [c for c in batch if c is not None])

    def _carry(self, rank: int, batch: list[_Command]) -> None:
        # Submissions first, then aborts: an abort in this batch may be for a request
        # submitted in it, never the other way round.
        submissions = [c.submission for c in batch if isinstance(c, _Submit)]
        try:
            if submissions:
                self.client.submit(rank, submissions)
            for command in batch:
                if isinstance(command, _Abort):
                    self.client.abort(rank, command.request_id)
        except RankFailure as failure:
            self._from_thread(self._fail_group, str(failure))
        except Exception as error:
            if not self._stopping.is_set():
                self._from_thread(self._fail_group, f"reaching the ranks failed: {error!r}")


async def _in_thread(function: Any) -> Any:
    """Run a blocking call on a thread of its own (not the loop's executor, whose few threads
    a stuck call could all hold) and await it."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def run() -> None:
        try:
            result = function()
        except BaseException as error:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, done, None, error)
        else:
            loop.call_soon_threadsafe(_settle, done, result, None)

    threading.Thread(target=run, name="lockstep-blocking", daemon=True).start()
    return await done


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
