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

A failed group (`RankFailure` from the client, a rank ending its requests because its group
failed, or a rank reporting its loop failed) is healed under `on_rank_failure: heal` while
the recovery budget lasts (launcher/healing.py): the client re-forms the group on a thread of
its own, keeping the ranks that survived with their requests; the replaced ranks' open
requests are resubmitted with the tokens they have streamed (a poison request of any rank is
ended alone), and new requests wait for the new group; `/health` says `degraded` until it is
up. Otherwise the failure ends every open request with an error naming the rank, refuses new
ones, and shuts the remaining ranks down; `/health` then says why.

Each group the client runs is a generation. Commands carry the generation they are for and
outputs the generation they came from. Once a failure is seen, the old group's outputs are
held until the heal says which ranks it kept: a kept rank's are delivered (it goes on with
its requests), a replaced rank's dropped (the heal resubmits what they were about); a command
not yet carried to a kept rank is carried to it in the new group. Nothing of a replaced rank
reaches the new group or a caller.
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
from typing import Any, Protocol

from dist_engine.engine.outputs import ErrorKind, RequestOutput
from dist_engine.engine.stats import RankStats
from dist_engine.log import get_logger
from launcher.clients import (
    Client,
    RankFailure,
    StaleGroup,
    Submission,
    claim_outputs,
    release_outputs,
)
from launcher.healing import (
    DriverSeeds,
    GroupFault,
    RecoveryBudget,
    ResumeLedger,
    describe_reform,
    is_group_failure,
)
from launcher.routing import Router
from scheduler import SamplingParams

_POLL_S = 0.05
_RANK_CHECK_S = 1.0  # how often the monitor asks the ranks for their stats
_STATS_TIMEOUT_S = 1.0
_FRESH_STATS_TIMEOUT_S = 0.5  # /metrics: how long a scrape waits for fresh stats
_READY_WAIT_S = 0.1  # how often a thread held by a heal looks whether it should stop

log = get_logger()


class Unavailable(Exception):
    """The server cannot take a request now: overloaded, draining, or its group failed."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class HealMetrics(Protocol):
    """Where a heal is counted (`ServerMetrics`)."""

    def rank_failed(self) -> None: ...

    def recovered(self, seconds: float, num_resumed: int) -> None: ...

    def resized(self, num_live: int) -> None: ...


@dataclass(frozen=True)
class _Submit:
    submission: Submission
    generation: int  # the group it is for


@dataclass(frozen=True)
class _Abort:
    request_id: str
    generation: int


_Command = _Submit | _Abort  # what a courier carries to its rank


@dataclass
class _Open:
    rank: int
    prompt_token_ids: list[int]
    queue: asyncio.Queue[RequestOutput]
    abort_reason: str | None = None  # set when the server, not the client, ended it
    aborted: bool = False  # an abort was asked for


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
        on_rank_failure: str = "fail",
        max_recoveries_per_hour: int = 3,
        poison_failure_threshold: int = 2,
        job_seed: int | None = None,
        heal_metrics: HealMetrics | None = None,
    ) -> None:
        """``on_stats(stats, now)`` runs on the event loop with each of the monitor's fresh
        stats (about once a second; never on a request's path). ``on_rank_failure``,
        ``max_recoveries_per_hour``, ``poison_failure_threshold``: the `parallel` settings of
        that name; ``job_seed``: `EngineConfig.seed`, which seeds requests that give none."""
        self.client = client
        self.on_stats = on_stats
        self.num_ranks: int = client.num_ranks
        self.router = Router(self.num_ranks, routing)
        self.router.set_live(client.live_ranks)
        self.max_pending_requests = max_pending_requests
        self.failure: str | None = None
        self.healing: str | None = None  # why, while a failed group is being replaced
        self.draining = False
        self._heals = on_rank_failure != "fail" and client.can_reform
        self._budget = RecoveryBudget(max_recoveries_per_hour)
        self._ledger = ResumeLedger(poison_failure_threshold)
        self._seeds = DriverSeeds(job_seed)
        self._heal_metrics = heal_metrics
        if heal_metrics is not None:
            heal_metrics.resized(len(client.live_ranks))
        # Requests opened while the group re-forms: submitted once it has (`_release`), to a
        # rank of the new group, so that a heal's resubmissions never meet them twice.
        self._deferred: dict[str, tuple[list[int], SamplingParams, int | None, str | None]] = {}
        # The group requests go to: the client's, or while healing the one being started.
        self._generation = client.generation
        self._ready = threading.Event()  # clear while healing: the threads hold their calls
        self._ready.set()
        self._heal_started = 0.0
        self._heal_fault: GroupFault | None = None  # the failure being healed
        # Outputs of the failed group that came in while it was healed: a kept rank's are
        # still its requests' (`_healed`).
        self._held: list[RequestOutput] = []
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
        claim_outputs(self.client, "a LockstepServer")  # released by close()
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
        release_outputs(self.client, "a LockstepServer")
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
        sample_group: str | None = None,
    ) -> RequestStream:
        """Open an admitted request (see `admission`) on a rank. ``sample_group``: the key the
        samples of one prompt share (they must be opened on one rank, pinned by ``dp_rank``),
        so the rank computes the prompt once (scheduler/samples.py)."""
        self._check_available()  # the group may have failed while the request was prepared
        rank = self.router.assign(request_id, len(prompt_token_ids) + params.max_tokens, dp_rank)
        entry = _Open(rank, prompt_token_ids, asyncio.Queue())
        self._open[request_id] = entry
        self._idle.clear()
        # Streaming on, whatever the HTTP client asked: the server sees every token as it comes.
        seed = self._seeds.seed_for(params)
        if self.healing is not None:
            self._deferred[request_id] = (prompt_token_ids, params, seed, sample_group)
        else:
            submission = self._ledger.add(
                request_id, prompt_token_ids, params, seed, True, rank, sample_group
            )
            self._commands[rank].put(_Submit(submission, self._generation))
        return RequestStream(self, request_id, entry)

    def _release(self) -> None:
        """Submit the requests opened while the group re-formed, each to a live rank (its
        own, unless the group shrank away from it); one aborted meanwhile ends here."""
        deferred, self._deferred = self._deferred, {}
        for request_id, (prompt_token_ids, params, seed, sample_group) in deferred.items():
            entry = self._open.get(request_id)
            if entry is None:
                continue
            if entry.aborted:
                self._end_here(request_id)
                continue
            entry.rank = self.router.reassign(request_id)
            submission = self._ledger.add(
                request_id, prompt_token_ids, params, seed, True, entry.rank, sample_group
            )
            self._commands[entry.rank].put(_Submit(submission, self._generation))

    def abort(self, request_id: str, reason: str | None = None) -> None:
        entry = self._open.get(request_id)
        if entry is None:
            return
        if reason is not None:
            entry.abort_reason = reason
        entry.aborted = True
        if request_id in self._deferred:
            return  # not submitted yet: `_release` ends it
        # While the group is healed, the courier holds it: `_healed` ends it here if its
        # rank was replaced (no rank holds it then), else it goes to the kept rank.
        self._commands[entry.rank].put(_Abort(request_id, self._generation))

    @property
    def num_open(self) -> int:
        return len(self._open)

    def health(self) -> tuple[str, str]:
        """(status, reason), never waiting on a rank: "unhealthy" once the group failed or
        while draining, "degraded" while a failed group is being replaced, else "ok" (with
        the ranks that have not answered lately, until the client declares them failed)."""
        if self.failure is not None:
            return "unhealthy", f"the DP group failed: {self.failure}"
        if self.draining:
            return "unhealthy", "draining: the server is shutting down"
        if self.healing is not None:
            return "degraded", f"re-forming the DP group: {self.healing}"
        notes = []
        live = self.client.live_ranks
        if len(live) < self.num_ranks:
            notes.append(f"serving on DP ranks {live} of {self.num_ranks} (shrunk after a failure)")
        silent = self.client.silent_ranks()
        if silent:
            named = ", ".join(f"DP rank {r} for {s:.0f} s" for r, s in sorted(silent.items()))
            notes.append(f"not answering: {named}")
        return "ok", "; ".join(["ok", *notes])

    async def stats(self, timeout_s: float = _FRESH_STATS_TIMEOUT_S) -> list[RankStats]:
        """Every rank's stats: asked afresh, waiting at most ``timeout_s`` (the client's own
        timeout bounds the thread that asks); else the monitor's latest, at most about a
        second old (a silent rank's are its last, with `silent_s` set)."""
        if self.failure is None and self.healing is None and not self._stopping.is_set():
            generation = self._generation
            try:
                stats = await asyncio.wait_for(
                    _in_thread(lambda: self.client.stats(timeout_s)), timeout_s + 0.2
                )
            except RankFailure as failure:
                self._fault(GroupFault(str(failure), failure.rank), failure.generation)
            except (asyncio.TimeoutError, Exception) as error:
                log.debug("fresh stats unavailable: %r", error)
            else:
                self._check_stats(stats, generation)
        return self.latest_stats

    # -- outputs and failures (event loop thread) -------------------------------------------
    def _deliver(self, outputs: list[RequestOutput], generation: int) -> None:
        """Outputs polled from group ``generation``. Once that group has failed, they are
        held while it is healed (a rank it keeps goes on with its requests: `_healed`
        delivers its outputs) and dropped after."""
        if generation != self._generation:
            if self.healing is not None and generation == self._generation - 1:
                self._held.extend(outputs)
            return
        self._take(outputs, generation)

    def _take(self, outputs: list[RequestOutput], generation: int) -> None:
        fault: GroupFault | None = None
        for output in outputs:
            entry = self._open.get(output.request_id)
            if entry is None:
                continue
            if is_group_failure(output) and self._may_heal():
                # Its rank gave it up with its group: it is resubmitted, not ended.
                fault = fault or GroupFault(f"DP rank {output.dp_rank}: {output.finish_reason}")
                continue
            shown = self._ledger.take(output)
            if output.finished:
                self._close(output.request_id)
            if shown is None:
                continue
            if output.finished and shown.finish_reason == "abort":
                shown = _as_server_abort(entry, shown)
            entry.queue.put_nowait(shown)
        if fault is not None:  # after the batch: its other outputs came before the failure
            self._fault(fault, generation)

    def _close(self, request_id: str) -> None:
        del self._open[request_id]
        self._ledger.forget(request_id)
        self.router.finished(request_id)
        if not self._open:
            self._idle.set()

    def _end_here(self, request_id: str, output: RequestOutput | None = None) -> None:
        """End an open request that no rank holds (it waits for a new group): with
        ``output``, or else as aborted."""
        entry = self._open[request_id]
        self._close(request_id)
        if output is None:
            failed = RequestOutput.failed(
                request_id, entry.prompt_token_ids, "", entry.rank, time.monotonic(),
                ErrorKind.ENGINE_STOPPED,
            )  # fmt: skip
            output = _as_server_abort(
                entry, dataclasses.replace(failed, finish_reason="abort", error_kind=None)
            )
        entry.queue.put_nowait(output)

    def _check_stats(self, stats: list[RankStats], generation: int) -> None:
        if generation != self._generation:
            return  # a replaced group's
        self.latest_stats = stats
        for rank_stats in stats:
            if rank_stats.error is not None:
                reason = f"DP rank {rank_stats.dp_rank} stopped: {rank_stats.error}"
                self._fault(GroupFault(reason, rank_stats.dp_rank), generation)
                return

    def _monitor_report(self, stats: list[RankStats], generation: int) -> None:
        self._check_stats(stats, generation)
        if self.on_stats is not None and self.failure is None and self.healing is None:
            self.on_stats(stats, time.monotonic())

    # -- healing (event loop thread) --------------------------------------------------------
    def _may_heal(self) -> bool:
        return self._heals and self.failure is None and self._budget.available(time.monotonic())

    def _fault(self, fault: GroupFault, generation: int) -> None:
        """Group ``generation`` failed: heal it (while the budget lasts), or fail for good.
        A failure of a group already being replaced is the same failure, and one seen while
        the server stops is the group going away."""
        if self.failure is not None or self.healing is not None or generation != self._generation:
            return
        if self._stopping.is_set():
            return
        if self._heal_metrics is not None:
            self._heal_metrics.rank_failed()
        if not self._may_heal():
            if self._heals:
                log.error("not healing the DP group: %s", self._budget.describe())
            self._fail_group(fault.reason)
            return
        now = time.monotonic()
        self._budget.spend(now)
        self.healing = f"after a failure: {fault.reason}"
        self._heal_started = now
        self._ready.clear()
        self._generation += 1
        log.error(
            "DP group failure seen: %s; re-forming the group (%d open request(s))",
            fault.reason, len(self._open),
        )  # fmt: skip
        self._heal_fault = fault
        self._held = []
        threading.Thread(target=self._reform, name="lockstep-heal", daemon=True).start()

    def _reform(self) -> None:
        """On a thread of its own: replace the group (the client's start-up time)."""
        try:
            replaced = self.client.reform()
        except Exception as error:
            reason = f"re-forming the DP group failed: {type(error).__name__}: {error}"
            self._from_thread(self._heal_failed, reason)
        else:
            self._from_thread(self._healed, replaced)

    def _healed(self, replaced: set[int]) -> None:
        """The new group is up: the kept ranks' outputs held meanwhile are delivered, the
        replaced ranks' requests resubmitted (a poison request of any rank ended alone, and
        aborted on its rank if that was kept), then the threads go on."""
        assert self.client.generation == self._generation, (
            self.client.generation,
            self._generation,
        )
        fault, self._heal_fault = self._heal_fault, None
        assert fault is not None
        seconds = time.monotonic() - self._heal_started
        held, self._held = self._held, []
        self._take([o for o in held if o.dp_rank not in replaced], self._generation)
        resumption = self._ledger.resume(fault, replaced)
        self.router.set_live(self.client.live_ranks)
        for output in resumption.ended:
            log.error("%s", output.finish_reason)
            if output.request_id not in self._open:
                continue
            if output.dp_rank not in replaced:  # its rank still holds it
                self._commands[output.dp_rank].put(_Abort(output.request_id, self._generation))
            self._end_here(output.request_id, output)
        for request_id, entry in self._open.items():
            if entry.aborted and entry.rank not in replaced and request_id not in self._deferred:
                # Asked while the group was healed: again, in case it went to the failed one.
                self._commands[entry.rank].put(_Abort(request_id, self._generation))
        awaiting = {s.request_id: s for s in resumption.submissions}
        num_resumed = num_from_tokens = 0
        for request_id, submission in awaiting.items():
            entry = self._open.get(request_id)
            if entry is None:
                continue
            if entry.aborted:  # its abort went to the failed group
                self._end_here(request_id)
                continue
            num_resumed += 1
            num_from_tokens += bool(submission.resumed_token_ids)
            entry.rank = self.router.reassign(request_id)  # moved if the group shrank
            self._ledger.move(request_id, entry.rank)
            self._commands[entry.rank].put(_Submit(submission, self._generation))
        self._release()
        self.healing = None
        self._ready.set()
        if self._heal_metrics is not None:
            self._heal_metrics.recovered(seconds, num_resumed)
            self._heal_metrics.resized(len(self.client.live_ranks))
        log.warning(
            "DP group re-formed in %.1f s (%s); "
            "%d request(s) resumed: %d from their streamed tokens, %d from their prompts",
            seconds, describe_reform(replaced, self.client.live_ranks), num_resumed,
            num_from_tokens, num_resumed - num_from_tokens,
        )  # fmt: skip

    def _start_grow(self) -> None:
        """A group that shrank can grow back (its replacements have loaded): re-form it at
        full size on a thread of its own, the threads holding their calls meanwhile as for a
        heal; every request stays where it is."""
        if self.failure is not None or self.healing is not None or self._stopping.is_set():
            return
        self.healing = f"growing back to {self.num_ranks} ranks"
        self._heal_started = time.monotonic()
        self._ready.clear()
        self._generation += 1
        self._held = []
        threading.Thread(target=self._grow, name="lockstep-grow", daemon=True).start()

    def _grow(self) -> None:
        try:
            joined = self.client.grow()
        except Exception as error:
            reason = f"growing the DP group back failed: {type(error).__name__}: {error}"
            self._from_thread(self._grow_failed, reason)
        else:
            self._from_thread(self._grown, joined)

    def _grown(self, joined: set[int]) -> None:
        """The group is back at full size (or unchanged, if nothing was ready): the outputs
        held meanwhile are delivered (every rank was kept), then the threads go on."""
        if self.client.generation != self._generation:  # nothing re-formed
            self._generation = self.client.generation
        held, self._held = self._held, []
        self._take(held, self._generation)
        self.router.set_live(self.client.live_ranks)
        self._release()
        self.healing = None
        self._ready.set()
        if self._heal_metrics is not None:
            self._heal_metrics.resized(len(self.client.live_ranks))
        if joined:
            log.warning(
                "DP group grew back to %d ranks in %.1f s (rank(s) %s joined)",
                len(self.client.live_ranks), time.monotonic() - self._heal_started,
                sorted(joined),
            )  # fmt: skip

    def _grow_failed(self, reason: str) -> None:
        """The planned re-form failed: the group is healed as after any failure."""
        self._generation = self.client.generation
        self.healing = None
        self._ready.set()
        self._fault(GroupFault(reason), self._generation)

    def _heal_failed(self, reason: str) -> None:
        """The new group did not start: try again while the budget lasts, else fail."""
        if self._may_heal() and not self._stopping.is_set():
            self._budget.spend(time.monotonic())
            log.error("%s; trying again", reason)
            threading.Thread(target=self._reform, name="lockstep-heal", daemon=True).start()
            return
        log.error("%s; not trying again: %s", reason, self._budget.describe())
        self.healing = None
        self._heal_fault = None
        self._held = []
        self._deferred = {}  # open: `_fail_group` ends them with the others
        self._fail_group(reason)
        self._ready.set()  # the threads find the failure and stop

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
    def _wait_ready(self) -> bool:
        """Wait while a heal replaces the group; False once the front end stops or fails."""
        while not self._ready.wait(_READY_WAIT_S):
            if self._stopping.is_set():
                return False
        return not self._stopping.is_set() and self.failure is None

    def _reported(self, generation: int) -> None:
        """After reporting a failure of ``generation``: wait until the loop has taken it up
        (a heal began, or the group failed), rather than asking the failed group again."""
        deadline = time.monotonic() + 5.0
        while self._generation == generation and self.failure is None:
            if self._stopping.is_set() or time.monotonic() > deadline:
                return
            time.sleep(0.01)

    def _poll_loop(self) -> None:
        while self._wait_ready():
            generation = self._generation
            try:
                outputs = self.client.poll(_POLL_S, generation=generation)
                if outputs:
                    self._from_thread(self._deliver, outputs, generation)
            except RankFailure as failure:
                fault = GroupFault(str(failure), failure.rank)
                self._from_thread(self._fault, fault, failure.generation)
                self._reported(failure.generation)
            except Exception as error:
                if self._stopping.is_set():
                    return
                fault = GroupFault(f"polling the ranks failed: {error!r}")
                self._from_thread(self._fault, fault, generation)
                self._reported(generation)

    def _monitor_loop(self) -> None:
        while self._wait_ready():
            generation = self._generation
            try:
                stats = self.client.stats(_STATS_TIMEOUT_S)
                self._from_thread(self._monitor_report, stats, generation)
                if self.client.grow_ready():
                    self._from_thread(self._start_grow)
            except RankFailure as failure:
                fault = GroupFault(str(failure), failure.rank)
                self._from_thread(self._fault, fault, failure.generation)
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
            if not self._wait_ready():
                continue  # failed or stopping: the requests were ended here
            for generation in sorted({c.generation for c in batch}):
                self._carry(rank, [c for c in batch if c.generation == generation], generation)

    def _carry(self, rank: int, batch: list[_Command], generation: int) -> None:
        """Carry commands for group ``generation``: nothing, if it has been replaced (the
        heal resubmitted what is still open), or if the group shrank away from ``rank`` (the
        heal moved its open requests to live ranks, or ended them)."""
        if rank not in self.client.live_ranks:
            return
        # Submissions first, then aborts: an abort in this batch may be for a request
        # submitted in it, never the other way round.
        submissions = [c.submission for c in batch if isinstance(c, _Submit)]
        aborts = [c for c in batch if isinstance(c, _Abort)]
        try:
            if submissions:
                self.client.submit(rank, submissions, generation=generation)
                submissions = []
            while aborts:
                self.client.abort(rank, aborts[0].request_id, generation=generation)
                aborts.pop(0)
        except StaleGroup:
            # Replaced meanwhile. A rank the heal kept is the same process in the new group,
            # so what was not carried is still for its requests: carry it there. A replaced
            # rank's open requests are resubmitted by the heal.
            if self.client.kept_since(rank, generation) and generation < self.client.generation:
                rest = [_Submit(s, self.client.generation) for s in submissions]
                rest += [_Abort(c.request_id, self.client.generation) for c in aborts]
                self._carry(rank, rest, self.client.generation)
            return
        except RankFailure as failure:
            fault = GroupFault(str(failure), failure.rank)
            self._from_thread(self._fault, fault, failure.generation)
        except Exception as error:
            if not self._stopping.is_set():
                fault = GroupFault(f"reaching the ranks failed: {error!r}")
                self._from_thread(self._fault, fault, generation)


def _as_server_abort(entry: _Open, output: RequestOutput) -> RequestOutput:
    """An aborted request's terminal output; an error saying why if the server aborted it."""
    if entry.abort_reason is None:
        return output
    return dataclasses.replace(
        output, finish_reason=f"error: {entry.abort_reason}", error_kind=ErrorKind.ENGINE_STOPPED
    )


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
