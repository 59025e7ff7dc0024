"""The asyncio side of a DP group: requests in, each request's outputs out as an async stream.

A client (`LocalClient`, `RayClient`) is blocking, so two threads stand between it and the
event loop:

- the *poller* waits on `client.poll` and hands each batch of outputs to the loop, which puts
  every output in its request's queue; once a second, between polls, it also asks every rank
  for its stats, which is how a rank whose loop died without its process dying is noticed;
- the *courier* carries submissions and aborts to the ranks in the order they were made
  (batched per rank when several wait), so an abort never overtakes its request's submission.

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
from dataclasses import dataclass
from typing import Any

from dist_engine.engine.outputs import RequestOutput
from dist_engine.engine.stats import RankStats
from dist_engine.log import get_logger
from launcher.clients import RankFailure, Submission
from launcher.routing import Router
from scheduler import SamplingParams

_POLL_S = 0.05
_RANK_CHECK_S = 1.0  # how often the poller asks the ranks for their stats
_STATS_TIMEOUT_S = 5.0

log = get_logger()


class Unavailable(Exception):
    """The server cannot take a request now: overloaded, draining, or its group failed."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


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
    def __init__(self, client: Any, *, routing: str, max_pending_requests: int) -> None:
        self.client = client
        self.num_ranks: int = client.num_ranks
        self.router = Router(self.num_ranks, routing)
        self.max_pending_requests = max_pending_requests
        self.failure: str | None = None
        self.draining = False
        self.latest_stats: list[RankStats] = []
        self._open: dict[str, _Open] = {}
        self._idle = asyncio.Event()
        self._commands: queue.SimpleQueue[tuple[str, int, Any] | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._client_shut = threading.Lock()
        self._client_is_shut = False
        self._client_down = threading.Event()  # set once client.shutdown() has returned
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []

    # -- lifetime ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the poller and the courier; call from the event loop that will serve."""
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        for target, name in ((self._poll_loop, "poller"), (self._courier_loop, "courier")):
            thread = threading.Thread(target=target, name=f"lockstep-{name}", daemon=True)
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
        """Stop the threads and shut the group down."""
        self._stopping.set()
        self._commands.put(None)
        loop = asyncio.get_running_loop()
        for thread in self._threads:
            await loop.run_in_executor(None, thread.join, 5.0)
        await loop.run_in_executor(None, self._shutdown_client)
        # A failure may have started the shutdown on another thread: wait for it too.
        await loop.run_in_executor(None, self._client_down.wait, 120.0)

    def _shutdown_client(self) -> None:
        with self._client_shut:
            if self._client_is_shut:
                return
            self._client_is_shut = True
        try:
            self.client.shutdown()
        except Exception as error:  # the group is going away anyway; say so and move on
            log.warning("shutting the DP group down failed: %s", error)
        finally:
            self._client_down.set()

    # -- requests (event loop thread) -------------------------------------------------------
    def open_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        dp_rank: int | None,
    ) -> RequestStream:
        if self.failure is not None:
            raise Unavailable(f"the DP group failed: {self.failure}")
        if self.draining:
            raise Unavailable("the server is shutting down")
        if len(self._open) >= self.max_pending_requests:
            raise Unavailable(
                f"{len(self._open)} requests are open, which is the limit "
                f"(server.max_pending_requests = {self.max_pending_requests}); retry later",
                retry_after_s=1,
            )
        rank = self.router.assign(request_id, len(prompt_token_ids) + params.max_tokens, dp_rank)
        entry = _Open(rank, prompt_token_ids, asyncio.Queue())
        self._open[request_id] = entry
        self._idle.clear()
        submission: Submission = (request_id, prompt_token_ids, params, True)
        self._commands.put(("submit", rank, submission))
        return RequestStream(self, request_id, entry)

    def abort(self, request_id: str, reason: str | None = None) -> None:
        entry = self._open.get(request_id)
        if entry is None:
            return
        if reason is not None:
            entry.abort_reason = reason
        self._commands.put(("abort", entry.rank, request_id))

    @property
    def num_open(self) -> int:
        return len(self._open)

    def health(self) -> tuple[bool, str]:
        if self.failure is not None:
            return False, f"the DP group failed: {self.failure}"
        if self.draining:
            return False, "draining: the server is shutting down"
        return True, "ok"

    async def stats(self) -> list[RankStats]:
        """Every rank's stats, fresh when the group answers (else the last ones seen)."""
        if self.failure is None and not self._client_is_shut:
            loop = asyncio.get_running_loop()
            try:
                stats = await asyncio.wait_for(
                    loop.run_in_executor(None, self.client.stats), _STATS_TIMEOUT_S
                )
            except RankFailure as failure:
                self._fail_group(str(failure))
            except (asyncio.TimeoutError, Exception) as error:
                log.warning("the ranks did not report their stats: %r", error)
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
                        output, finish_reason=f"error: {entry.abort_reason}"
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

    def _fail_group(self, message: str) -> None:
        if self.failure is not None:
            return
        self.failure = message
        log.error("the DP group failed: %s; ending %d open request(s)", message, len(self._open))
        self._end_all(message)
        # Free what is left of the group; the server keeps answering, unhealthy, until stopped.
        threading.Thread(target=self._shutdown_client, name="lockstep-shutdown").start()

    def _end_all(self, reason: str) -> None:
        for request_id, entry in list(self._open.items()):
            self._close(request_id)
            entry.queue.put_nowait(
                RequestOutput.failed(
                    request_id, entry.prompt_token_ids, reason, entry.rank, time.monotonic()
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
        last_check = time.monotonic()
        while not self._stopping.is_set() and self.failure is None:
            try:
                outputs = self.client.poll(_POLL_S)
                if outputs:
                    self._from_thread(self._deliver, outputs)
                if time.monotonic() - last_check >= _RANK_CHECK_S:
                    last_check = time.monotonic()
                    self._from_thread(self._check_stats, self.client.stats())
            except RankFailure as failure:
                self._from_thread(self._fail_group, str(failure))
                return
            except Exception as error:
                if self._stopping.is_set():
                    return
                self._from_thread(self._fail_group, f"polling the ranks failed: {error!r}")
                return

    def _courier_loop(self) -> None:
        while True:
            command = self._commands.get()
            batch = [command]
            while True:
                try:
                    batch.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            if None in batch:
                return
            self._carry([c for c in batch if c is not None])

    def _carry(self, batch: list[tuple[str, int, Any]]) -> None:
        # Submissions first, then aborts: an abort in this batch may be for a request
        # submitted in it, never the other way round.
        submissions: dict[int, list[Submission]] = {}
        for kind, rank, payload in batch:
            if kind == "submit":
                submissions.setdefault(rank, []).append(payload)
        try:
            for rank, items in submissions.items():
                self.client.submit(rank, items)
            for kind, rank, payload in batch:
                if kind == "abort":
                    self.client.abort(rank, payload)
        except RankFailure as failure:
            self._from_thread(self._fail_group, str(failure))
        except Exception as error:
            if not self._stopping.is_set():
                self._from_thread(self._fail_group, f"reaching the ranks failed: {error!r}")
