"""Decode assembly: one token for each running sequence, growing block tables a block at a time.

Running sequences are ordered so that the end of the list is served first and the front is
preempted first. ``lcfs`` (the default) serves the sequences with the shortest output first and
preempts the longest, which frees the most blocks per victim; ``fcfs`` serves by arrival and
preempts the latest arrival. A victim is either ended (``stop_preempted_request``) or reset
for recompute and put back at the head of ``waiting``.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

from scheduler.config import SchedulerConfig
from scheduler.kv_manager import KvManager
from scheduler.sequence import Sequence

_BY_OUTPUT_LEN = attrgetter("num_output_tokens")
_BY_ARRIVAL = attrgetter("arrival_index")


def order_key(policy: str) -> Callable[[Sequence], int]:
    return _BY_OUTPUT_LEN if policy == "lcfs" else _BY_ARRIVAL


def preemption_order(running: list[Sequence], policy: str) -> list[Sequence]:
    """Serve-last-first order: ``order[-1]`` is served first, ``order[0]`` preempted first."""
    return sorted(running, key=order_key(policy), reverse=True)  # stable: ties keep their order


def assemble_decode(
    running: list[Sequence],
    kv: KvManager,
    config: SchedulerConfig,
    preempt: Callable[[Sequence], None],
    presorted: bool = False,
) -> tuple[list[Sequence], list[Sequence]]:
    """Returns ``(scheduled, left_running)``: the step's batch in serving order, and the
    running sequences the ``max_num_seqs`` cap left out (they stay running), victims first.

    ``presorted``: the caller knows ``running`` is already in preemption order, which a decode
    step preserves (every sequence advances by one), so the sort can be skipped.
    """
    order = running if presorted else preemption_order(running, config.preemption_order)
    blocks = kv.blocks
    block_size = kv.block_size
    max_seqs = config.max_num_seqs
    scheduled: list[Sequence] = []
    first, end = 0, len(order)
    while first < end and len(scheduled) < max_seqs:
        seq = order[end - 1]
        end -= 1
        table = seq.block_table
        if seq.num_tokens >= len(table) * block_size:  # the next token starts a new block
            while blocks.num_free == 0 and first < end:
                preempt(order[first])
                first += 1
            if blocks.num_free == 0:
                preempt(seq)
                continue
            table.append(blocks.allocate())
        # Optimistic advance, inlined: this loop is the scheduler's hottest path.
        seq.previous_num_tokens = tokens = seq.num_tokens
        seq.num_tokens = tokens + 1
        seq.in_flight = True
        scheduled.append(seq)
    return scheduled, order[first:end]
