"""The bookkeeping of a heal (launcher/healing.py) as pure logic: what is resubmitted after a
failure, what a caller sees of a resubmitted request, the poison rule, the recovery budget
and the driver's seeds. The real-process tests (test_heal.py) show the same end to end."""

from __future__ import annotations

import pytest

from dist_engine.engine.config import EngineConfig
from dist_engine.engine.outputs import ErrorKind, RequestOutput, TokenLogprob
from launcher.healing import (
    DriverSeeds,
    GroupFault,
    RecoveryBudget,
    ResumeLedger,
    describe_reform,
    is_group_failure,
)
from scheduler import SamplingParams

PROMPT = [5, 6, 7]
PARAMS = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0)
FAULT = GroupFault("DP rank 1 died: its Ray actor is gone", 1)


def output(tokens: list[int], num_new: int, finished: bool = False, **changes) -> RequestOutput:
    """What a rank reports: ``tokens`` so far, the last ``num_new`` of them new."""
    new = tokens[len(tokens) - num_new :]
    values = dict(
        request_id="r",
        prompt_token_ids=PROMPT,
        output_token_ids=tokens,
        new_token_ids=new,
        finished=finished,
        finish_reason="length" if finished else None,
        dp_rank=1,
        arrival_time=10.0,
        first_token_time=11.0,
        new_logprobs=[TokenLogprob(t, -float(t), 1) for t in new],
    )
    return RequestOutput(**{**values, **changes})


def test_a_streamed_request_resumes_from_what_its_caller_saw_and_ends_once():
    ledger = ResumeLedger(poison_failure_threshold=2)
    first = ledger.add("r", PROMPT, PARAMS, seed=99, stream=True, rank=1)
    assert first.seed == 99 and first.resumed_token_ids == () and first.stream
    assert ledger.take(output([1, 2], 2)) is not None
    assert ledger.take(output([1, 2, 3], 1)).new_token_ids == [3]
    resumption = ledger.resume(FAULT)
    (again,) = resumption.submissions
    assert again.resumed_token_ids == (1, 2, 3) and again.seed == 99 and again.stream
    assert again.params is PARAMS and again.prompt_token_ids == PROMPT
    assert resumption.ended == [] and resumption.num_from_tokens == 1
    # The new group reports the resumed tokens as outputs, only the later ones as new, with
    # its own clock: the caller keeps the first incarnation's times.
    delta = ledger.take(output([1, 2, 3, 4], 1, arrival_time=500.0, first_token_time=501.0))
    assert delta.new_token_ids == [4] and (delta.arrival_time, delta.first_token_time) == (10, 11)
    final = ledger.take(output([1, 2, 3, 4, 5], 1, finished=True, arrival_time=500.0))
    assert final.output_token_ids == [1, 2, 3, 4, 5] and final.new_token_ids == [5]
    assert final.finish_reason == "length" and final.arrival_time == 10.0
    assert len(ledger) == 0 and ledger.resume(FAULT).submissions == []


def test_a_request_not_streamed_starts_again_and_its_caller_sees_one_whole_result():
    ledger = ResumeLedger(poison_failure_threshold=3)
    ledger.add("r", PROMPT, PARAMS, seed=None, stream=False, rank=0)
    (again,) = ledger.resume(FAULT).submissions
    # Nothing reached the front end: it starts again from its prompt, streamed this time so
    # that a second failure resumes it from its tokens.
    assert again.resumed_token_ids == () and again.stream
    scored = [None, TokenLogprob(6, -1.0, 1), TokenLogprob(7, -2.0, 3)]
    assert ledger.take(output([1, 2], 2, prompt_logprobs=scored)) is None
    (twice,) = ledger.resume(FAULT).submissions
    assert twice.resumed_token_ids == (1, 2)
    final = ledger.take(output([1, 2, 3], 1, finished=True))
    assert final.output_token_ids == [1, 2, 3] and final.new_token_ids == [1, 2, 3]
    assert [entry.token_id for entry in final.new_logprobs] == [1, 2, 3]
    assert final.prompt_logprobs == scored


def test_a_resubmitted_request_the_new_group_refuses_keeps_its_tokens():
    ledger = ResumeLedger(poison_failure_threshold=2)
    ledger.add("r", PROMPT, PARAMS, seed=1, stream=True, rank=0)
    ledger.take(output([1, 2], 2))
    ledger.resume(FAULT)
    refused = RequestOutput.failed("r", PROMPT, "engine stopped", 0, 0.0, ErrorKind.ENGINE_STOPPED)
    final = ledger.take(refused)
    assert final.output_token_ids == [1, 2] and final.new_token_ids == []
    assert final.finish_reason == "error: engine stopped"


def test_a_request_in_failures_in_a_row_without_progress_is_ended_alone():
    ledger = ResumeLedger(poison_failure_threshold=2)
    ledger.add("r", PROMPT, PARAMS, seed=1, stream=True, rank=1)
    ledger.add("busy", PROMPT, PARAMS, seed=2, stream=True, rank=0)
    assert len(ledger.resume(FAULT).submissions) == 2  # both outstanding in failure 1
    ledger.take(output([4], 1, request_id="busy"))  # "busy" commits a token, "r" none
    resumption = ledger.resume(FAULT)
    assert [s.request_id for s in resumption.submissions] == ["busy"]
    (ended,) = resumption.ended
    assert ended.request_id == "r" and ended.finished and ended.dp_rank == 1
    assert ended.error_kind is ErrorKind.REQUEST_FAILED
    assert "request r was outstanding in 2 failures" in ended.finish_reason
    assert (
        "poison_failure_threshold 2" in ended.finish_reason and FAULT.reason in ended.finish_reason
    )
    assert "r" not in ledger and "busy" in ledger


def test_only_the_replaced_ranks_requests_are_resubmitted():
    """A heal that keeps rank 0 (its process, requests and KV): only rank 1's request is
    resubmitted; rank 0's is left to its rank, still tracked, and ends there as usual."""
    ledger = ResumeLedger(poison_failure_threshold=3)
    ledger.add("r", PROMPT, PARAMS, seed=1, stream=True, rank=1)
    ledger.add("kept", PROMPT, PARAMS, seed=2, stream=True, rank=0)
    ledger.take(output([4], 1, request_id="kept", dp_rank=0))
    resumption = ledger.resume(FAULT, {1})
    assert [s.request_id for s in resumption.submissions] == ["r"] and resumption.ended == []
    assert "kept" in ledger
    # The kept rank goes on with its request: its outputs pass through untouched.
    final = ledger.take(output([4, 5], 1, finished=True, request_id="kept", dp_rank=0))
    assert final.output_token_ids == [4, 5] and final.new_token_ids == [5]


def test_a_kept_ranks_request_in_failures_in_a_row_is_ended_alone_too():
    """A poison request need not sit on the rank that died: one on a kept rank, outstanding
    in K failures in a row with no token, is ended (its caller aborts it on its rank)."""
    ledger = ResumeLedger(poison_failure_threshold=2)
    ledger.add("stuck", PROMPT, PARAMS, seed=1, stream=True, rank=0)
    first = ledger.resume(FAULT, {1})
    assert first.ended == [] and first.submissions == []
    second = ledger.resume(FAULT, {1})
    (ended,) = second.ended
    assert ended.request_id == "stuck" and ended.dp_rank == 0 and second.submissions == []
    assert ended.error_kind is ErrorKind.REQUEST_FAILED and "stuck" not in ledger


def test_group_failure_outputs_are_recognised_by_their_kind():
    failed = RequestOutput.failed("r", PROMPT, "DP group failed", 0, 0.0, ErrorKind.GROUP_FAILED)
    assert is_group_failure(failed)
    other = RequestOutput.failed("r", PROMPT, "DP group failed", 0, 0.0, ErrorKind.REQUEST_FAILED)
    assert not is_group_failure(other) and not is_group_failure(output([1], 1))


def test_the_recovery_budget_is_a_sliding_hour():
    budget = RecoveryBudget(max_per_hour=2)
    for now in (0.0, 100.0):
        assert budget.available(now)
        budget.spend(now)
    assert not budget.available(3599.0) and "2 recoveries in the last hour" in budget.describe()
    assert budget.available(3600.0)  # the first one is an hour old
    budget.spend(3600.0)
    assert not budget.available(3650.0)
    assert budget.available(3700.0)


def test_driver_seeds_follow_the_job_seed_and_leave_seeded_requests_alone():
    unseeded = SamplingParams(temperature=1.0)
    first, again = DriverSeeds(7), DriverSeeds(7)
    drawn = [first.seed_for(unseeded) for _ in range(5)]
    assert drawn == [again.seed_for(unseeded) for _ in range(5)]  # a rerun samples alike
    assert len(set(drawn)) == 5 and all(0 <= seed < 2**63 for seed in drawn)
    assert DriverSeeds(8).seed_for(unseeded) != DriverSeeds(7).seed_for(unseeded)
    assert first.seed_for(SamplingParams(seed=3)) is None  # its own seed wins
    random_seeds = DriverSeeds(None)
    assert random_seeds.seed_for(unseeded) != random_seeds.seed_for(unseeded)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "on_rank_failure",
            "retry",
            r"parallel.on_rank_failure must be one of \['heal', 'shrink', 'fail'\]",
        ),
        ("max_recoveries_per_hour", 0, "parallel.max_recoveries_per_hour must be an int >= 1"),
        ("replacement_wait_s", 0, "parallel.replacement_wait_s must be > 0 seconds, got 0"),
        ("replacement_wait_s", True, "parallel.replacement_wait_s must be > 0 seconds, got True"),
        ("poison_failure_threshold", 1.5, "parallel.poison_failure_threshold must be an int"),
    ],
)
def test_heal_settings_are_checked_naming_the_key(key, value, message):
    assert EngineConfig(model="m").parallel.on_rank_failure == "heal"
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m").with_overrides(**{key: value})


def test_a_reform_is_described_by_what_became_of_each_rank():
    assert describe_reform({1}, [0, 1]) == "rank(s) [1] replaced, [0] kept with their requests"
    assert describe_reform({2}, [0, 1, 3]) == (
        "rank(s) [2] gone, the group shrank onto the rest, [0, 1, 3] kept with their requests"
    )


def test_a_moved_request_is_resubmitted_and_resumed_as_of_its_new_rank():
    ledger = ResumeLedger(poison_failure_threshold=3)
    ledger.add("a", [1, 2], SamplingParams(max_tokens=4), seed=7, stream=True, rank=2)
    ledger.move("a", 0)
    # Rank 2 is gone again in a later failure: "a" lives on rank 0 now, so it is kept there.
    assert ledger.resume(GroupFault("rank 2 died", 2), {2}).submissions == []
    assert [s.request_id for s in ledger.resume(GroupFault("rank 0 died", 0), {0}).submissions] == [
        "a"
    ]
