"""One request as the scheduler sees it: four ledgers on one object.

- token ledger: ``token_ids`` (prompt + committed outputs) and ``num_prompt_tokens``;
- KV ledger: ``num_tokens`` (tokens whose KV exists or is being written by the step in flight),
  ``previous_num_tokens``, ``block_table``, ``state_slot``, ``block_hashes``;
- schedule ledger: ``status``, ``schedulable``, ``chunked_rest_len``, ``chunk_checkpoints``,
  ``unsplittable_spans``, ``sample_group`` (the samples of one ``n`` request share it, and
  with it their prompt's KV blocks: scheduler/samples.py);
- timing: ``arrival_time``, ``first_token_time``, ``token_times``, ``finish_time``.

The KV ledger advances optimistically by ``seqlen_q`` when a step is scheduled and is committed to
the accepted count when the step's outputs come back, so block arithmetic is right even while a
step is in flight (an overlapped or speculative engine can accept fewer tokens than it scheduled).
The flat ``__slots__`` layout is deliberate: the decode hot path touches these fields once per
sequence per step, and every extra attribute hop costs there.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterable

from scheduler.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    """Live states first, finished ones after: ``status >= STOPPED`` means finished."""

    WAITING = 0
    RUNNING = 1
    STOPPED = 2
    LENGTH_CAPPED = 3
    ABORTED = 4
    IGNORED = 5
    PREEMPTED = 6
    FAILED = 7

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.STOPPED


_FINISH_REASONS = {
    SequenceStatus.STOPPED: "stop",
    SequenceStatus.LENGTH_CAPPED: "length",
    SequenceStatus.ABORTED: "abort",
    SequenceStatus.IGNORED: "prompt_length_exceeded",
    SequenceStatus.PREEMPTED: "insufficient_system_resource",
}

_FIRST_FINISHED = SequenceStatus.STOPPED


class Sequence:
    __slots__ = (
        "_prompt",
        "arrival_index",
        "arrival_time",
        "block_hashes",
        "block_table",
        "chunk_checkpoints",
        "chunked_rest_len",
        "error_message",
        "finish_time",
        "first_token_time",
        "in_flight",
        "max_tokens",
        "num_cached_prefix_tokens",
        "num_output_tokens",
        "num_prompt_tokens",
        "num_tokens",
        "previous_num_tokens",
        "queued_step",
        "request_id",
        "sample_group",
        "sampling_params",
        "schedulable",
        "state_slot",
        "status",
        "stop_token_ids",
        "token_ids",
        "token_times",
        "unsplittable_spans",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling_params: SamplingParams | None = None,
        *,
        eos_token_id: int | Iterable[int] | None = None,
        schedulable: bool = True,
        chunk_checkpoints: Iterable[int] = (),
        unsplittable_spans: Iterable[tuple[int, int]] = (),
        arrival_time: float | None = None,
        sample_group: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params or SamplingParams()
        # Token ledger.
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self._prompt: list[int] | None = None  # `prompt_token_ids`, made at the first ask
        self.num_output_tokens = 0
        self.max_tokens = self.sampling_params.max_tokens
        # EOS ids and stop ids end a sequence the same way ("stop"), so the hot path tests one
        # set; ignore_eos leaves the EOS ids out of it.
        eos: frozenset[int] = frozenset()
        if eos_token_id is not None and not self.sampling_params.ignore_eos:
            eos = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        self.stop_token_ids = self.sampling_params.stop_token_ids | eos
        # KV ledger.
        self.num_tokens = 0
        self.previous_num_tokens = 0
        self.num_cached_prefix_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.state_slot: int | None = None
        # Schedule ledger.
        self.status = SequenceStatus.WAITING
        self.schedulable = schedulable
        self.chunked_rest_len = 0
        self.chunk_checkpoints: deque[int] = deque(sorted(set(chunk_checkpoints)))
        self.unsplittable_spans = _check_spans(unsplittable_spans, self.num_prompt_tokens)
        self.in_flight = False
        self.sample_group = sample_group
        self.arrival_index = -1  # set by the scheduler; orders FCFS preemption
        self.queued_step = -1  # step index at which it (re)joined waiting; set by the scheduler
        self.error_message = ""
        # Timing (time.monotonic seconds).
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.finish_time: float | None = None

    # -- token ledger -----------------------------------------------------------------------
    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's ids: one list, made at the first ask and the same list after (the
        prompt's part of ``token_ids`` never changes). A streamed request's output carries it
        every step, as do the sampler's rows under a repetition penalty: a copy each time
        would cost O(prompt) per sequence per step. Not to be modified."""
        prompt = self._prompt
        if prompt is None:
            prompt = self._prompt = self.token_ids[: self.num_prompt_tokens]
        return prompt

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def __len__(self) -> int:
        return len(self.token_ids)

    # -- KV ledger --------------------------------------------------------------------------
    def advance_optimistically(self, num_new_tokens: int) -> None:
        """Count the KV of a just-scheduled step as written, before its outputs come back."""
        self.previous_num_tokens = self.num_tokens
        self.num_tokens += num_new_tokens

    def commit_processed_tokens(self, num_accepted: int) -> None:
        """Settle the optimistic advance to what the step actually accepted."""
        self.num_tokens = self.previous_num_tokens + num_accepted

    def reset_for_recompute(self) -> None:
        """Forget all KV state so the whole token ledger is prefilled again.

        The caller releases the blocks and slot first; committed outputs stay in the token ledger.
        """
        assert not self.block_table and self.state_slot is None, "release resources first"
        self.num_tokens = 0
        self.previous_num_tokens = 0
        self.num_cached_prefix_tokens = 0
        self.block_hashes = []
        self.chunked_rest_len = 0
        self.status = SequenceStatus.WAITING

    # -- schedule ledger --------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status >= _FIRST_FINISHED

    @property
    def finish_reason(self) -> str | None:
        if self.status == SequenceStatus.FAILED:
            return f"error: {self.error_message}"
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.name}, len={len(self.token_ids)}, "
            f"prompt={self.num_prompt_tokens}, num_tokens={self.num_tokens}, "
            f"blocks={len(self.block_table)})"
        )


def _check_spans(
    spans: Iterable[tuple[int, int]], num_prompt_tokens: int
) -> tuple[tuple[int, int], ...]:
    """Unsplittable spans are sorted, disjoint, half-open ``[start, end)`` ranges of the prompt."""
    result = tuple(sorted((int(start), int(end)) for start, end in spans))
    previous_end = 0
    for start, end in result:
        if not 0 <= start < end <= num_prompt_tokens or start < previous_end:
            raise ValueError(
                f"unsplittable spans must be disjoint [start, end) ranges inside the prompt of "
                f"{num_prompt_tokens} tokens, got {list(result)}"
            )
        previous_end = end
    return result
