"""Prefill assembly: which waiting sequences enter this prefill step, and how many tokens each.

The head of ``waiting`` is served first and nobody overtakes it: an unschedulable head, or one
whose blocks are not free yet, ends the assembly for this step. Checks run in a fixed order and
nothing is allocated until every check for a sequence has passed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.block_pool import AllocStatus
from scheduler.config import SchedulerConfig
from scheduler.kv_manager import KvManager
from scheduler.sequence import Sequence, SequenceStatus


@dataclass
class PrefillBatch:
    seqs: list[Sequence]
    seqlens_q: list[int]
    num_batched_tokens: int


def larger_than_pool(seq: Sequence, kv: KvManager) -> str:
    """Why a prompt the whole pool cannot hold is ignored (its `detail`)."""
    length = len(seq.token_ids)
    return (
        f"prompt of {length} tokens needs {kv.num_blocks_for(length)} KV blocks of "
        f"{kv.block_size} tokens; the pool has {kv.blocks.num_usable}"
    )


def chunk_length(seq: Sequence, start: int, budget_left: int, config: SchedulerConfig) -> int:
    """Tokens of ``seq``'s prompt to compute this step from position ``start``; 0 means none.

    Order: the token budget (aligned down to the context-parallel unit), the next chunk
    checkpoint, unsplittable spans (shrink to the span's start, or extend past its end when the
    shrunken chunk is under the minimum and the budget allows), then the minimum chunk.
    """
    align = config.cp_align
    num_left = len(seq.token_ids) - start
    length = num_left
    aligned_budget = budget_left // align * align
    if length > aligned_budget:
        if not config.chunked_prefill:
            return 0  # the whole prompt must fit one step; it will in a later one
        length = aligned_budget
    for checkpoint in seq.chunk_checkpoints:
        if checkpoint > start:
            length = min(length, checkpoint - start)
            break
    end = start + length
    for span_start, span_end in seq.unsplittable_spans:
        if span_start < end < span_end:
            length = span_start - start
            if length < config.min_chunk_tokens:
                extended = span_end - start
                if -(-extended // align) * align <= budget_left:
                    length = extended
            break
    # The minimum applies to partial chunks only: a prompt's last piece may be shorter, or a
    # short remainder could never be scheduled at all.
    if length < num_left and length < config.min_chunk_tokens:
        return 0
    return max(length, 0)


def assemble_prefill(
    waiting: deque[Sequence],
    num_running: int,
    kv: KvManager,
    config: SchedulerConfig,
    terminate: Callable[[Sequence, SequenceStatus], None],
    token_budget: int | None = None,
    *,
    dry_run: bool = False,
    max_kv_usage: float | None = None,
    reserve_blocks: Callable[[Sequence], int] | None = None,
) -> PrefillBatch:
    """Take sequences from the head of ``waiting`` while every check passes.

    ``token_budget`` (default ``max_num_batched_tokens``) caps the prompt tokens of the batch;
    the head's chunk alone may use the full ``max_num_batched_tokens`` when the cap would
    leave it none, so a ready head is always taken whatever the cap.

    ``dry_run``: stop at the first sequence that every check lets in and return it alone,
    with nothing allocated or advanced (heads the checks end, too long or larger than the
    pool, are ended all the same). This is how the deadline policy finds a *ready* head
    (``Scheduler._ready_head``): the same code as the assembly, so a ready head always
    assembles. It adds two conditions of its own, which can only make readiness stricter:
    ``max_kv_usage`` (a head without blocks waits while the pool is fuller than this) and
    ``reserve_blocks(seq)`` (blocks that a mixed step's decode tokens take first).
    """
    budget = config.max_num_batched_tokens if token_budget is None else token_budget
    seqs: list[Sequence] = []
    seqlens_q: list[int] = []
    num_batched = 0
    num_seqs = num_running
    sum_k_left = config.prefill_max_sum_seqlen_k or float("inf")
    prompt_limit = config.max_model_len if config.chunked_prefill else config.max_num_batched_tokens
    align = config.cp_align
    while waiting:
        seq = waiting[0]
        if seq.is_finished:  # aborted or failed while queued; already reported
            waiting.popleft()
            continue
        if not seq.schedulable:
            break
        length = len(seq.token_ids)
        if length > prompt_limit:
            waiting.popleft()
            terminate(seq, SequenceStatus.IGNORED)
            continue
        if num_seqs + 1 > config.max_num_seqs or sum_k_left < length:
            break
        plan = None
        start = seq.num_tokens
        if not seq.block_table:
            if max_kv_usage is not None and kv.usage() > max_kv_usage:
                break
            plan = kv.plan_admission(seq, reserve_blocks(seq) if reserve_blocks else 0, seqs)
            if plan.status is AllocStatus.NEVER:
                waiting.popleft()
                seq.error_message = larger_than_pool(seq, kv)
                terminate(seq, SequenceStatus.IGNORED)
                continue
            if plan.status is AllocStatus.LATER:
                break
            start = len(plan.cached_blocks) * kv.block_size
        seqlen_q = chunk_length(seq, start, budget - num_batched, config)
        if seqlen_q == 0 and not seqs:
            seqlen_q = chunk_length(seq, start, config.max_num_batched_tokens, config)
        if seqlen_q == 0:
            break
        if dry_run:
            return PrefillBatch([seq], [seqlen_q], seqlen_q)
        # Every check passed: from here on, side effects.
        waiting.popleft()
        if plan is not None:
            kv.admit(seq, plan)
        seq.advance_optimistically(seqlen_q)
        seq.in_flight = True
        while seq.chunk_checkpoints and seq.chunk_checkpoints[0] <= seq.num_tokens:
            seq.chunk_checkpoints.popleft()
        num_batched += -(-seqlen_q // align) * align
        sum_k_left -= length
        seqs.append(seq)
        seqlens_q.append(seqlen_q)
        seq.chunked_rest_len = length - seq.num_tokens
        if seq.chunked_rest_len:
            break  # one chunk of one chunked prompt per step; others get the next step
        seq.status = SequenceStatus.RUNNING
        num_seqs += 1
    return PrefillBatch(seqs, seqlens_q, num_batched)
