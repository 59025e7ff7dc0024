"""The per-rank scheduler: queues, the step policy, and output accounting.

One step is ``schedule()`` then, once the model has run, ``process_outputs()``. The policy:

    at an attempt point, vote; if the group prefills, assemble a prompt batch and vote again
    on whether any rank got one; otherwise (and between attempt points) decode.

Which steps are attempt points and what the group decides there depends on ``sync_policy``
(``vote``, ``every_step``, ``deadline``; see ``scheduler/vote.py``). With mixed steps (the
default outside ``vote``) a prefill step also carries a decode token for every running sequence,
so the step kind still decides the MoE dispatch mode but prompts no longer pause decoding.
``decode_step``, ``next_vote`` and the previous vote are identical on every rank, so every rank
reaches the same attempt points and takes the same collectives. Not thread-safe: one engine
thread owns it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass

from scheduler.config import SchedulerConfig
from scheduler.decode import assemble_decode, order_key
from scheduler.kv_manager import KvManager
from scheduler.outputs import SchedulerOutputs
from scheduler.prefill import PrefillBatch, assemble_prefill
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.vote import (
    SYNC_POLICIES,
    AttemptPoint,
    GroupView,
    LocalState,
    LocalVote,
    PolicyState,
    Vote,
)


@dataclass(frozen=True)
class PoolUsage:
    num_free_blocks: int  # free plus evictable (cached, unheld) blocks
    num_usable_blocks: int  # the pool less the reserved block 0
    usage: float  # fraction of usable blocks held by sequences
    num_prefix_hit_tokens: int  # prompt tokens found in the prefix cache so far
    # Without prefix caching: prompt tokens a sample found computed by a sibling (samples.py);
    # with it, those count as prefix-cache hits.
    num_shared_prompt_tokens: int


# A step's schedule: yields vote vectors, receives the group's MIN of each, returns outputs.
StepPlan = Generator[list[int], list[int], SchedulerOutputs]

_RUNNING = SequenceStatus.RUNNING
_STOPPED = SequenceStatus.STOPPED
_LENGTH_CAPPED = SequenceStatus.LENGTH_CAPPED


class Scheduler:
    def __init__(self, config: SchedulerConfig, vote: Vote | None = None) -> None:
        if config.max_model_len is None:
            raise ValueError(
                "SchedulerConfig.max_model_len is None: set it, or let the engine resolve it "
                "from the model"
            )
        self.config = config
        self.vote: Vote = vote if vote is not None else LocalVote()
        self.kv = KvManager(config)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # True while `running` is known to be in preemption order (victims first).
        self._running_sorted = False
        self._order_key = order_key(config.preemption_order)
        self._live: dict[str, Sequence] = {}
        self._terminated: list[Sequence] = []  # ended by the scheduler, reported next schedule()
        self._needs_sweep = False  # some queued sequence ended and still sits in a queue
        self._num_arrivals = 0
        self.num_preemptions = 0
        # Step-policy state; identical on every rank of a group.
        self.decode_step = 0
        self.step_index = 0
        self.group_idle = False
        self.drain_step: int | None = None
        self.next_vote = 0  # deadline policy: the decode step of the next scheduled vote
        self.prefill_run = 0  # consecutive prefill steps up to the last one
        # Deadline policy, this rank only: the head that is ready to start a prefill, and for
        # how many decode steps it has been (checked every step, reported at votes).
        self._ready_seq: Sequence | None = None
        self._ready_wait = 0
        self._policy = SYNC_POLICIES.get(config.sync_policy)
        self._deadline = self._policy.tracks_readiness
        self._mixed = config.mixed

    # -- requests ---------------------------------------------------------------------------
    def add_sequence(self, seq: Sequence) -> None:
        """Queue a request. A bad one is ended at once and reported by the next schedule()."""
        if seq.request_id in self._live:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if seq.status is not SequenceStatus.WAITING or seq.num_tokens or seq.block_table:
            raise ValueError(f"sequence {seq.request_id!r} is not new: {seq!r}")
        seq.arrival_index = self._num_arrivals
        seq.queued_step = self.step_index
        self._num_arrivals += 1
        problem = self._check_prompt(seq)
        if problem is not None:
            status, message = problem
            seq.error_message = message
            self._finish(seq, status)
            self._terminated.append(seq)
            return
        self._live[seq.request_id] = seq
        self.waiting.append(seq)

    def _check_prompt(self, seq: Sequence) -> tuple[SequenceStatus, str] | None:
        tokens = seq.token_ids
        if not tokens:
            return SequenceStatus.FAILED, "empty prompt"
        if not all(type(t) is int for t in tokens):
            bad = next(t for t in tokens if type(t) is not int)
            return SequenceStatus.FAILED, f"prompt token {bad!r} is not an int"
        vocab = self.config.vocab_size
        low, high = min(tokens), max(tokens)
        if low < 0 or (vocab is not None and high >= vocab):
            bad = low if low < 0 else high
            return (
                SequenceStatus.FAILED,
                f"prompt token id {bad} at position {tokens.index(bad)} is outside the "
                f"vocabulary [0, {vocab if vocab is not None else 'inf'})",
            )
        limit = (
            self.config.max_model_len
            if self.config.chunked_prefill
            else self.config.max_num_batched_tokens
        )
        if len(tokens) > limit:
            name = "max_model_len" if self.config.chunked_prefill else "max_num_batched_tokens"
            return SequenceStatus.IGNORED, f"prompt of {len(tokens)} tokens exceeds {name} {limit}"
        return None

    def abort(self, request_id: str, reason: str | None = None) -> Sequence | None:
        """End a request in any state: ABORTED, or FAILED with ``reason``.

        Returns the sequence (the caller reports it), or None if unknown or already finished.
        Resources of a sequence in flight are released when its step's outputs come back.
        """
        seq = self._live.get(request_id)
        if seq is None:
            return None
        seq.error_message = reason or ""
        self._finish(seq, SequenceStatus.FAILED if reason else SequenceStatus.ABORTED)
        if not seq.in_flight:
            self.kv.release(seq)
        self._needs_sweep = True
        return seq

    def set_schedulable(self, request_id: str, schedulable: bool = True) -> None:
        seq = self._live.get(request_id)
        if seq is None:
            raise KeyError(f"no live request {request_id!r}")
        seq.schedulable = schedulable

    def get_sequence(self, request_id: str) -> Sequence | None:
        return self._live.get(request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._live)

    def pool_usage(self) -> PoolUsage:
        """The KV pool as a monitor sees it; safe to read from another thread (each number is
        one the pool really had, though they may straddle a step)."""
        blocks = self.kv.blocks
        cache = self.kv.prefix_cache
        return PoolUsage(
            num_free_blocks=blocks.num_free,
            num_usable_blocks=blocks.num_usable,
            usage=blocks.usage(),
            num_prefix_hit_tokens=cache.num_hit_tokens if cache is not None else 0,
            num_shared_prompt_tokens=self.kv.num_shared_tokens,
        )

    # -- the step ---------------------------------------------------------------------------
    def schedule(
        self, *, wake_epoch: int = 0, shutdown: bool = False, regroup: bool = False
    ) -> SchedulerOutputs:
        """One step's batch, taking the votes through this scheduler's own ``vote``."""
        return run_plan(
            self.plan(wake_epoch=wake_epoch, shutdown=shutdown, regroup=regroup), self.vote
        )

    def plan(
        self, *, wake_epoch: int = 0, shutdown: bool = False, regroup: bool = False
    ) -> StepPlan:
        """One step's schedule as an exchange with the group: yields each vote vector this
        rank sends (at most two), takes back the group's element-wise MIN, and returns the
        step's outputs. Whoever runs it (`schedule`, or the engine with its collectives in
        view) performs exactly the collectives it yields, in order.

        ``wake_epoch``: the highest wake epoch this rank has seen (distributed/wake.py);
        ``shutdown``: this rank asks the group to stop; ``regroup``: to leave its process
        groups and re-form (the engine abandons the step the group agreed on it, as after a
        failed collective). They travel in vote 1, so every rank sees them at the same step.
        """
        if self._needs_sweep:
            self._sweep()
        if self._deadline:
            self._track_ready()
        decided_on = self.decode_step
        point = self.next_point()
        outputs = None
        view = None
        any_scheduled = None
        if point is not AttemptPoint.NONE:
            state = self._local_state(wake_epoch, shutdown, regroup)
            view = GroupView.from_vector((yield state.encode()))
            if self._group_prefills(point, view):
                decode, batch = self._assemble_prefill(view)
                # Vote 2: if no rank assembled anything, a prefill step would be empty
                # everywhere and the next step would vote again: the empty-prefill livelock.
                # Decode instead.
                try:
                    any_scheduled = (yield [0 if batch.seqs else 1])[0] == 0
                except BaseException:  # the vote failed: put back what was assembled
                    decode_seqs = decode.scheduled_seqs if decode is not None else []
                    self._undo_assembly(decode_seqs, batch.seqs)
                    raise
                if any_scheduled:
                    outputs = self._prefill_outputs(batch, decode)
                else:
                    assert not batch.seqs
                    outputs = decode
        if outputs is None:
            outputs = self._decode(known_empty=view is not None and view.none_running)
        self._end_step(outputs, decided_on, point, view, any_scheduled)
        return outputs

    def _end_step(
        self,
        outputs: SchedulerOutputs,
        decided_on: int,
        point: AttemptPoint,
        view: GroupView | None,
        any_scheduled: bool | None,
    ) -> None:
        """Stamp the outputs and advance the step-policy state every rank shares."""
        outputs.any_scheduled = any_scheduled
        outputs.step_index = self.step_index
        outputs.decode_step = decided_on
        outputs.point = point
        outputs.group = view
        if self._terminated:
            outputs.ignored_seqs.extend(self._terminated)
            self._terminated = []
        prefill = outputs.is_prefill
        self.step_index += 1
        self.decode_step = 0 if prefill else decided_on + 1
        self.prefill_run = self.prefill_run + 1 if prefill else 0
        if self._ready_seq is not None and not prefill:
            self._ready_wait += 1  # a decode step it sat out while ready
        self.group_idle = outputs.known_empty
        if view is not None:
            remaining = view.max_remaining_tokens
            decoding = not prefill and remaining > 0
            self.drain_step = decided_on + remaining if decoding else None
            if not prefill:
                self.next_vote = self._policy.next_vote(decided_on, view, self._shared_state())

    def abandon(self, outputs: SchedulerOutputs) -> None:
        """Undo a step whose forward did not complete (a collective of it failed): every
        sequence it scheduled is back where it was before the step, keeping its KV blocks
        (what the step wrote into them past the committed tokens is written again by the
        next step that computes those positions). Decode sequences stay running with their
        committed tokens; prompts go back to the head of `waiting`, in their order, a prompt
        the step had just admitted keeping its blocks as one whose prefill is under way.
        Sequences the step's assembly preempted stay preempted (a valid state). The
        step-policy state is not undone: a group that goes on after a failure starts it
        afresh on every rank (`restart_policy`)."""
        seqs = outputs.scheduled_seqs
        num_prompt = len(seqs) - outputs.num_decode_seqs if outputs.is_prefill else 0
        self._undo_assembly(seqs[num_prompt:], seqs[:num_prompt])

    def _undo_assembly(self, decode_seqs: list[Sequence], prompt_seqs: list[Sequence]) -> None:
        for seq in decode_seqs:
            seq.in_flight = False
            if seq.status is _RUNNING:
                seq.num_tokens = seq.previous_num_tokens
        for seq in reversed(prompt_seqs):
            seq.in_flight = False
            if seq.is_finished:  # ended while in flight: its release was deferred to now
                self.kv.release(seq)
                continue
            seq.num_tokens = seq.previous_num_tokens
            seq.chunked_rest_len = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def restart_policy(self, step_index: int) -> None:
        """Start the step-policy state that every rank of a group shares afresh, as a new
        group's ranks have it, at ``step_index`` (the group agrees on it: the highest of its
        ranks', so that every queued sequence's `queued_step` stays in the past). The ranks
        of a group re-formed after a failure (survivors and replacements alike) call this
        before their first step together."""
        if step_index < self.step_index:
            raise ValueError(f"step index {step_index} is before this rank's {self.step_index}")
        self.decode_step = 0
        self.step_index = step_index
        self.group_idle = False
        self.drain_step = None
        self.next_vote = 0
        self.prefill_run = 0
        self._ready_seq = None
        self._ready_wait = 0

    def next_point(self) -> AttemptPoint:
        """The attempt point of the next ``schedule()``, from the state every rank shares."""
        return self._policy.point(self._shared_state())

    def _shared_state(self) -> PolicyState:
        config = self.config
        return PolicyState(
            decode_step=self.decode_step,
            group_idle=self.group_idle,
            drain_step=self.drain_step,
            next_vote=self.next_vote,
            all_interval=config.prefill_attempt_interval,
            any_interval=config.prefill_any_attempt_interval,
            deadline=config.deadline_steps,
        )

    def policy_state(self) -> tuple[int, int, bool, int | None, int, int]:
        """The step-policy state, which must be identical on every rank of a group:
        (step_index, decode_step, group_idle, drain_step, next_vote, prefill_run)."""
        return (
            self.step_index,
            self.decode_step,
            self.group_idle,
            self.drain_step,
            self.next_vote,
            self.prefill_run,
        )

    def _group_prefills(self, point: AttemptPoint, view: GroupView) -> bool:
        return self._policy.prefills(point, view, self._shared_state())

    def _local_state(self, wake_epoch: int, shutdown: bool, regroup: bool) -> LocalState:
        """What this rank says in vote 1."""
        ready = self._ready_seq
        has_running = bool(self.running)
        head_ready = self._head_schedulable()
        # A prompt whose chunked prefill is under way already holds its blocks: the watermark
        # must not stop it, or its own blocks could keep it from ever finishing.
        want = head_ready and (
            bool(self.waiting[0].block_table) or self.kv.usage() <= self.config.prefill_watermark
        )
        return LocalState(
            want=want,
            has_running=has_running,
            has_work=has_running or head_ready,
            wake_epoch=wake_epoch,
            shutdown=shutdown,
            regroup=regroup,
            max_remaining_tokens=self._max_remaining_tokens(),
            ready=ready is not None,
            ready_wait=self._ready_wait if ready is not None else -1,
            # Queued no later than the first of the current run of prefill steps.
            backlog=ready is not None
            and self.prefill_run > 0
            and ready.queued_step <= self.step_index - self.prefill_run,
        )

    def _track_ready(self) -> None:
        """Deadline policy: note which head is ready now; its wait goes on only while the same
        sequence stays ready at the head (a chunked prompt between its chunks included)."""
        head = self._ready_head()
        if head is not self._ready_seq:
            self._ready_seq = head
            self._ready_wait = 0

    def _ready_head(self) -> Sequence | None:
        """The head of waiting if a prefill assembled now would start with it, else None: a
        dry run of the assembly itself (`assemble_prefill`), under the watermark and with the
        blocks a mixed step's decode tokens take first set aside. A head that assembly would
        end (longer than the prompt limit, more blocks than the whole pool) is ended here, or
        it could sit unreported at the head of an idle rank.
        """
        batch = assemble_prefill(
            self.waiting,
            len(self.running),
            self.kv,
            self.config,
            self._terminate,
            dry_run=True,
            max_kv_usage=self.config.prefill_watermark,
            reserve_blocks=self._mixed_reserve,
        )
        return batch.seqs[0] if batch.seqs else None

    def _mixed_reserve(self, seq: Sequence) -> int:
        """Blocks that a mixed step's decode tokens take before ``seq`` could be admitted. The
        count walks every running sequence, so it is taken only where it could matter: while
        the free blocks are fewer than the prompt's blocks plus one per running sequence."""
        if not self._mixed or not self.running:
            return 0
        kv = self.kv
        if kv.blocks.num_free >= kv.num_blocks_for(len(seq.token_ids)) + len(self.running):
            return 0
        return self.decode_block_demand()

    def decode_block_demand(self) -> int:
        """Blocks the next decode of the running sequences takes: one for each whose next
        token starts a new block."""
        block_size = self.config.block_size
        return sum(
            1
            for seq in self.running
            if not seq.is_finished and seq.num_tokens >= len(seq.block_table) * block_size
        )

    def _max_remaining_tokens(self) -> int:
        """Most tokens any running sequence may still produce before a stop rule ends it."""
        max_model_len = self.config.max_model_len
        return max(
            (
                min(
                    seq.max_tokens - seq.num_output_tokens,
                    max_model_len - len(seq.token_ids),
                )
                for seq in self.running
            ),
            default=0,
        )

    def _assemble_prefill(self, view: GroupView) -> tuple[SchedulerOutputs | None, PrefillBatch]:
        """The group prefills: this rank's prompt batch, and (mixed steps) its decode part.

        Mixed steps, while some rank of the group decodes: the running sequences are scheduled
        first (they keep their claim on free blocks, and a preemption frees blocks before any
        new prompt is admitted), then prompt chunks of at most ``mixed_prompt_cap``.
        """
        config = self.config
        decode = None
        budget = config.max_num_batched_tokens
        if self._mixed and not view.none_running:
            decode = self._decode(known_empty=False)
            if config.chunked_prefill:
                budget = min(budget, config.mixed_prompt_cap)
        batch = assemble_prefill(
            self.waiting, len(self.running), self.kv, config, self._terminate, budget
        )
        return decode, batch

    @staticmethod
    def _prefill_outputs(batch: PrefillBatch, decode: SchedulerOutputs | None) -> SchedulerOutputs:
        seqs, seqlens_q, num_tokens = batch.seqs, batch.seqlens_q, batch.num_batched_tokens
        num_decode = decode.num_seqs if decode is not None else 0
        if num_decode:
            seqs = seqs + decode.scheduled_seqs
            seqlens_q = seqlens_q + decode.seqlens_q
            num_tokens += decode.num_batched_tokens
        return SchedulerOutputs(
            is_prefill=True,
            scheduled_seqs=seqs,
            seqlens_q=seqlens_q,
            num_batched_tokens=num_tokens,
            num_decode_seqs=num_decode,
        )

    def _decode(self, *, known_empty: bool) -> SchedulerOutputs:
        if known_empty:
            assert not self.running
            return SchedulerOutputs(False, [], [], 0, known_empty=True)
        scheduled, left = assemble_decode(
            self.running, self.kv, self.config, self._preempt, presorted=self._running_sorted
        )
        # Keep running in preemption order (victims first) so that ties stay in the same
        # order from step to step: the oldest of equals is always the first victim. Sequences
        # the batch cap left out did not advance, so then the order may no longer hold.
        self.running = left + scheduled[::-1]
        self._running_sorted = not left
        return SchedulerOutputs(False, scheduled, [1] * len(scheduled), len(scheduled))

    # -- accounting -------------------------------------------------------------------------
    def process_outputs(
        self, outputs: SchedulerOutputs, sampled_token_ids: list[int]
    ) -> list[Sequence]:
        """Commit one step's results; returns the sequences that finished with it.

        ``sampled_token_ids`` has one id per scheduled sequence, in order; the ids of prompt
        chunks that do not end their prompt are ignored.
        """
        seqs = outputs.scheduled_seqs
        if len(sampled_token_ids) != len(seqs):
            raise ValueError(
                f"step {outputs.step_index} scheduled {len(seqs)} sequences but got "
                f"{len(sampled_token_ids)} sampled tokens"
            )
        if not outputs.is_prefill:
            return self._account_decode(seqs, sampled_token_ids)
        num_prompt = len(seqs) - outputs.num_decode_seqs
        finished = []
        if outputs.num_decode_seqs:  # a mixed step: its decode tokens first, as assembled
            finished = self._account_decode(seqs[num_prompt:], sampled_token_ids[num_prompt:])
        return finished + self._account_prefill(
            seqs[:num_prompt], outputs.seqlens_q[:num_prompt], sampled_token_ids[:num_prompt]
        )

    def _account_prefill(
        self, seqs: list[Sequence], seqlens_q: list[int], sampled_token_ids: list[int]
    ) -> list[Sequence]:
        finished: list[Sequence] = []
        now = time.monotonic()
        for seq, seqlen_q, token in zip(seqs, seqlens_q, sampled_token_ids, strict=True):
            seq.in_flight = False
            if seq.is_finished:  # ended while in flight; its release was deferred to now
                self.kv.release(seq)
                continue
            seq.commit_processed_tokens(seqlen_q)
            self.kv.register_full_blocks(seq)
            if seq.num_tokens < len(seq.token_ids):
                assert seq.status is SequenceStatus.WAITING, seq
                self.waiting.appendleft(seq)  # the next chunk goes first
                continue
            assert seq.status is _RUNNING, seq
            if seq.first_token_time is None:
                seq.first_token_time = now
            if self._append_token(seq, token, now):
                finished.append(seq)
            # Compare with the key as it now stands: the token just appended counts (lcfs).
            running = self.running
            if running and self._order_key(seq) > self._order_key(running[-1]):
                self._running_sorted = False
            running.append(seq)
        return finished

    def _account_decode(self, seqs: list[Sequence], sampled_token_ids: list[int]) -> list[Sequence]:
        finished: list[Sequence] = []
        now = time.monotonic()
        prefix_caching = self.kv.prefix_cache is not None
        block_size = self.config.block_size
        max_model_len = self.config.max_model_len
        for seq, token in zip(seqs, sampled_token_ids, strict=True):
            seq.in_flight = False
            if seq.status is not _RUNNING:
                # Ended while in flight (release deferred to now), or preempted for recompute
                # after this step was issued: its output belongs to a discarded history.
                if seq.is_finished:
                    self.kv.release(seq)
                continue
            seq.num_tokens = seq.previous_num_tokens + 1  # commit: decode accepts its one token
            if prefix_caching and seq.num_tokens % block_size == 0:
                self.kv.register_full_blocks(seq)
            # _append_token, inlined: a call per sequence is a fifth of this loop's cost.
            tokens = seq.token_ids
            tokens.append(token)
            seq.num_output_tokens = num_output = seq.num_output_tokens + 1
            seq.token_times.append(now)
            if token in seq.stop_token_ids:
                self._end_by_token(seq, _STOPPED)
            elif num_output >= seq.max_tokens or len(tokens) >= max_model_len:
                self._end_by_token(seq, _LENGTH_CAPPED)
            else:
                continue
            finished.append(seq)
        return finished

    def _append_token(self, seq: Sequence, token: int, now: float) -> bool:
        """Append one committed token and apply the stop rules in order; True if finished."""
        tokens = seq.token_ids
        tokens.append(token)
        seq.num_output_tokens = num_output = seq.num_output_tokens + 1
        seq.token_times.append(now)
        if token in seq.stop_token_ids:
            self._end_by_token(seq, _STOPPED)
        elif num_output >= seq.max_tokens or len(tokens) >= self.config.max_model_len:
            self._end_by_token(seq, _LENGTH_CAPPED)
        else:
            return False
        return True

    def _end_by_token(self, seq: Sequence, status: SequenceStatus) -> None:
        self._finish(seq, status)
        self.kv.release(seq)
        self._needs_sweep = True

    # -- endings ----------------------------------------------------------------------------
    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        assert not seq.is_finished, f"{seq!r} finished twice"
        seq.status = status
        seq.finish_time = time.monotonic()
        self._live.pop(seq.request_id, None)

    def _terminate(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence for a scheduler reason; it is reported by this step's outputs."""
        self._finish(seq, status)
        self.kv.release(seq)
        self._terminated.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.kv.release(seq)
        # Recompute cannot help a sequence whose next token needs more blocks than the whole
        # pool: it would be re-admitted and preempted again forever.
        hopeless = self.kv.num_blocks_for(len(seq.token_ids) + 1) > self.kv.blocks.num_usable
        if self.config.stop_preempted_request or hopeless:
            self._terminate(seq, SequenceStatus.PREEMPTED)
            return
        seq.reset_for_recompute()
        seq.queued_step = self.step_index
        # The victim goes to the head of waiting, but behind a prompt whose prefill is under
        # way: that prompt holds blocks, and a victim in front of it that cannot fit beside
        # them would block it forever.
        waiting = self.waiting
        index = 0
        while index < len(waiting) and waiting[index].block_table:
            index += 1
        waiting.insert(index, seq)

    def _sweep(self) -> None:
        """Drop ended sequences from the queues. Dead heads of ``waiting`` must go even on the
        decode path: a rank whose head stays dead never wants to prefill, and an ALL vote could
        then never pass."""
        self.running = [seq for seq in self.running if not seq.is_finished]
        if any(seq.is_finished for seq in self.waiting):
            self.waiting = deque(seq for seq in self.waiting if not seq.is_finished)
        self._needs_sweep = False

    def _head_schedulable(self) -> bool:
        waiting = self.waiting
        while waiting and waiting[0].is_finished:
            waiting.popleft()
        return bool(waiting) and waiting[0].schedulable

    # -- checks -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Between steps: every live sequence sits in exactly one queue, and the pools' counts
        equal the references the live sequences hold."""
        self.kv.check_integrity()
        queued = [seq for seq in self.waiting if not seq.is_finished]
        queued += [seq for seq in self.running if not seq.is_finished]
        ids = [seq.request_id for seq in queued]
        assert len(ids) == len(set(ids)), "a sequence is queued twice"
        assert set(ids) == set(self._live), "live sequences and queues disagree"
        expected = [0] * self.kv.blocks.num_blocks
        for seq in queued:
            for block in seq.block_table:
                expected[block] += 1
        assert expected == self.kv.blocks.ref_counts, "block reference counts are off"
        if self._running_sorted:
            keys = [self._order_key(seq) for seq in self.running if not seq.is_finished]
            assert keys == sorted(keys, reverse=True), "running lost its preemption order"


def run_plan(plan: StepPlan, vote: Vote) -> SchedulerOutputs:
    """Run a step's plan, answering each vote vector it yields with ``vote``."""
    try:
        vector = next(plan)
        while True:
            vector = plan.send(vote.allreduce_min(vector))
    except StopIteration as done:
        return done.value
