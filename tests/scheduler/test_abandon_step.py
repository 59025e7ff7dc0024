"""A step abandoned because a collective of it failed (`Scheduler.abandon`, and the plan's own
undo when vote 2 fails) leaves the scheduler as if the step had never been scheduled: the
pools' counts still match, nothing is lost or queued twice, and every request ends with the
tokens a run without the failure gives."""

from __future__ import annotations

import random

import pytest
from sched_helpers import fake_token, make_scheduler, make_seq, run_to_completion

from scheduler import LocalVote, SequenceStatus


class FailingVote:
    """A vote that fails (raises) at the calls whose numbers are in ``fail_at``."""

    def __init__(self, fail_at: set[int]) -> None:
        self.fail_at = fail_at
        self.num_calls = 0
        self.local = LocalVote()

    def allreduce_min(self, values: list[int]) -> list[int]:
        self.num_calls += 1
        if self.num_calls in self.fail_at:
            raise RuntimeError("peer gone")
        return self.local.allreduce_min(values)


def _workload(sched, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(12):
        sched.add_sequence(make_seq(f"r{i}", rng.randint(1, 40), max_tokens=rng.randint(1, 24)))


def _tokens(reported) -> dict[str, list[int]]:
    return {rid: seq.output_token_ids for rid, seq in reported.items()}


@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_abandoned_forwards_change_no_token(mixed: bool, seed: int) -> None:
    """Every fifth step's forward fails after it was scheduled; the step is abandoned and the
    run goes on. Small pools make the run preempt, so victims and chunked prompts are in it."""
    settings = dict(num_blocks=24, max_num_batched_tokens=32, mixed_steps=mixed)
    reference = make_scheduler(**settings)
    _workload(reference, seed)
    expected = _tokens(run_to_completion(reference))

    sched = make_scheduler(**settings)
    _workload(sched, seed)
    reported = {}
    num_abandoned = 0
    for step in range(10_000):
        outputs = sched.schedule()
        for seq in outputs.ignored_seqs:
            reported[seq.request_id] = seq
        if step % 5 == 4 and outputs.scheduled_seqs:
            sched.abandon(outputs)
            num_abandoned += 1
            sched.check_integrity()
            continue
        sampled = [fake_token(seq) for seq in outputs.scheduled_seqs]
        for seq in sched.process_outputs(outputs, sampled):
            assert seq.request_id not in reported
            reported[seq.request_id] = seq
        sched.check_integrity()
        if sched.num_unfinished == 0:
            break
    assert num_abandoned > 5
    assert sched.num_preemptions > 0 or reference.num_preemptions == 0
    assert _tokens(reported) == expected
    assert all(seq.status is not SequenceStatus.FAILED for seq in reported.values())


def test_a_failed_second_vote_puts_the_assembled_prompts_back() -> None:
    """Vote 2 (after this rank assembled a prompt batch) fails: the plan undoes the assembly
    before the error leaves it, so the prompts wait at the head again, in their order."""
    vote = FailingVote(fail_at=set())
    sched = make_scheduler(vote=vote)
    for i in range(3):
        sched.add_sequence(make_seq(f"p{i}", 10 + i))
    waiting_before = [seq.request_id for seq in sched.waiting]
    free_before = sched.kv.blocks.num_free
    vote.fail_at = {2}  # vote 1 passes, vote 2 fails
    with pytest.raises(RuntimeError, match="peer gone"):
        sched.schedule()
    assert [seq.request_id for seq in sched.waiting] == waiting_before
    assert all(seq.status is SequenceStatus.WAITING and seq.num_tokens == 0
               for seq in sched.waiting)  # fmt: skip
    # The admitted prompts keep their blocks (a prefill under way); nothing else moved.
    assert sched.kv.blocks.num_free <= free_before
    sched.check_integrity()
    reported = run_to_completion(sched)
    reference = make_scheduler()
    for i in range(3):
        reference.add_sequence(make_seq(f"p{i}", 10 + i))
    assert _tokens(reported) == _tokens(run_to_completion(reference))


def test_restart_policy_takes_the_agreed_step_and_refuses_going_back() -> None:
    sched = make_scheduler()
    sched.add_sequence(make_seq("a", 5, max_tokens=3))
    for _ in range(3):
        outputs = sched.schedule()
        sched.process_outputs(outputs, [fake_token(s) for s in outputs.scheduled_seqs])
    assert sched.step_index == 3
    sched.restart_policy(7)
    assert (sched.step_index, sched.decode_step, sched.prefill_run) == (7, 0, 0)
    assert sched.next_point() is not None
    with pytest.raises(ValueError, match="before this rank's"):
        sched.restart_policy(6)
