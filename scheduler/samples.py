"""The samples of one request (vLLM's `n`) compute their prompt once and share its KV blocks.

A front end sends a request with n samples to one rank as n sequences carrying one
``Sequence.sample_group`` key. Their prompt's full blocks are found as prefix-cache hits:

    sample 0 admitted -> its prompt computed -> its full blocks registered (as a prefix cache
    registers them) -> samples 1..n-1 admitted: the full blocks before their last token taken
    by reference, the rest (the last partial or full block, so at least the last prompt
    token) computed in blocks of their own

With ``enable_prefix_caching`` the prefix cache itself serves them. Without it, the KV
manager keeps a cache for samples alone, whose chains start at a root drawn from the group's
key (`group_root`), so only a sibling ever finds a block there: a request without a group,
or of another group, shares nothing, as with prefix caching off. Either way the blocks are
reference counted: a sample that is preempted or aborted drops its references and the others
keep theirs; once no sample holds a block it waits in the pool's evictable LRU, counted as
free (so it never keeps a prompt from being admitted), until a sibling that comes later or is
recomputed takes it again or an allocation reuses it.

Siblings admitted in one step would each compute the whole prompt (blocks are registered
when their step's outputs come back), so a sample whose sibling in the batch being assembled
will compute blocks it could share waits one step for them (`blocks_after_step`: admission
says LATER). It waits only for a sequence of that very batch, which ends with the step, and
never in the dry run that finds the deadline policy's ready head (its batch is empty), so
readiness and assembly still agree.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.sequence import Sequence


def group_root(group: str) -> int:
    """The parent hash a sample group's chains start from in the samples' own cache."""
    return hash(("sample_group", group))


def blocks_after_step(seq: Sequence, batch: Iterable[Sequence], block_size: int) -> int:
    """How many leading full blocks of ``seq`` (before its last token) a sibling in ``batch``
    will have computed once the step is done."""
    limit = (len(seq.token_ids) - 1) // block_size
    best = 0
    for other in batch:
        if other.sample_group == seq.sample_group and other is not seq:
            num = min(limit, other.num_tokens // block_size)
            best = max(best, common_blocks(seq.token_ids, other.token_ids, num, block_size))
    return best


def common_blocks(tokens: list[int], other: list[int], max_blocks: int, size: int) -> int:
    """How many leading blocks of ``size`` tokens (at most ``max_blocks``) two token lists
    share: a key shared by different prompts shares only what they have in common."""
    end = max_blocks * size
    if tokens[:end] == other[:end]:  # siblings: the whole span at C speed
        return max_blocks
    count = 0
    while count < max_blocks:
        start = count * size
        if tokens[start : start + size] != other[start : start + size]:
            break
        count += 1
    return count
