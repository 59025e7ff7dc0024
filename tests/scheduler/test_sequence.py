import pytest
from sched_helpers import make_scheduler, make_seq, run_to_completion

from scheduler import SamplingParams, Sequence, SequenceStatus


def test_each_way_a_request_ends_gives_its_finish_reason():
    """Every ending reached through the scheduler, not read off the status table: the status
    each path sets and the reason a user sees for it (the names vLLM's and OpenAI's APIs use;
    the reference article's for a preempted request)."""
    sched = make_scheduler(max_model_len=16)
    stop = Sequence("stop", [1, 2], SamplingParams(max_tokens=10), eos_token_id=9)
    capped = make_seq("capped", 2, max_tokens=1)
    aborted, failed = make_seq("aborted", 2), make_seq("failed", 2)
    too_long = make_seq("too_long", 17)
    seqs = (stop, capped, aborted, failed, too_long)
    for seq in seqs:
        sched.add_sequence(seq)
    waiting = (stop, capped, aborted, failed)  # too_long is ended at the door
    assert all(seq.finish_reason is None and not seq.is_finished for seq in waiting)
    outputs = sched.schedule()
    assert [s.request_id for s in outputs.ignored_seqs] == ["too_long"]
    assert stop.status is SequenceStatus.RUNNING and stop.finish_reason is None
    assert not stop.is_finished
    sampled = {"stop": 9, "capped": 5, "aborted": 5, "failed": 5}
    sched.process_outputs(outputs, [sampled[s.request_id] for s in outputs.scheduled_seqs])
    sched.abort("aborted")
    sched.abort("failed", reason="rank 1 died")
    ended = {seq.request_id: (seq.status, seq.finish_reason) for seq in seqs}
    assert ended == {
        "stop": (SequenceStatus.STOPPED, "stop"),
        "capped": (SequenceStatus.LENGTH_CAPPED, "length"),
        "aborted": (SequenceStatus.ABORTED, "abort"),
        "failed": (SequenceStatus.FAILED, "error: rank 1 died"),
        "too_long": (SequenceStatus.IGNORED, "prompt_length_exceeded"),
    }
    assert all(status.is_finished for status, _ in ended.values())

    # A pool too small for three growing sequences, with stop_preempted_request: the victim
    # ends instead of being recomputed.
    sched = make_scheduler(block_size=4, num_blocks=7, stop_preempted_request=True)
    for rid in "abc":
        sched.add_sequence(make_seq(rid, 8, max_tokens=6))
    results = run_to_completion(sched)
    victims = [seq for seq in results.values() if seq.status is not SequenceStatus.LENGTH_CAPPED]
    assert victims and all(seq.status is SequenceStatus.PREEMPTED for seq in victims)
    assert {seq.finish_reason for seq in victims} == {"insufficient_system_resource"}


def test_kv_ledger_advances_optimistically_and_commits_accepted():
    seq = Sequence("r", list(range(10)))
    seq.advance_optimistically(10)
    assert seq.num_tokens == 10 and seq.previous_num_tokens == 0
    seq.advance_optimistically(3)  # e.g. one token plus two drafts
    assert seq.num_tokens == 13
    seq.commit_processed_tokens(1)  # only one accepted
    assert seq.num_tokens == 11


def test_token_ledger_views():
    seq = Sequence("r", [5, 6], SamplingParams(max_tokens=3))
    seq.token_ids += [7, 8]
    assert seq.prompt_token_ids == [5, 6] and seq.output_token_ids == [7, 8] and len(seq) == 4


def test_the_prompt_view_is_made_once_and_stays_the_prompt():
    seq = Sequence("r", (5, 6), SamplingParams(max_tokens=8))
    seq.token_ids += [7]
    prompt = seq.prompt_token_ids
    seq.token_ids += [8, 9]  # outputs appended after the first ask
    assert seq.prompt_token_ids is prompt and prompt == [5, 6]
    assert seq.output_token_ids == [7, 8, 9]


def test_eos_ids_join_the_stop_ids_unless_ignored():
    params = SamplingParams(stop_token_ids=[7])
    assert Sequence("r", [1], params, eos_token_id=2).stop_token_ids == {2, 7}
    assert Sequence("r", [1], params, eos_token_id=(2, 3)).stop_token_ids == {2, 3, 7}
    ignored = SamplingParams(stop_token_ids=[7], ignore_eos=True)
    assert Sequence("r", [1], ignored, eos_token_id=2).stop_token_ids == {7}


@pytest.mark.parametrize("spans", [[(3, 2)], [(0, 4), (3, 5)], [(2, 11)], [(-1, 2)]])
def test_bad_unsplittable_spans_are_rejected(spans):
    with pytest.raises(ValueError, match="unsplittable spans"):
        Sequence("r", list(range(10)), unsplittable_spans=spans)


def test_reset_for_recompute_keeps_outputs():
    seq = Sequence("r", [1, 2, 3])
    seq.advance_optimistically(3)
    seq.token_ids.append(9)
    seq.num_output_tokens = 1
    seq.status = SequenceStatus.RUNNING
    seq.reset_for_recompute()
    assert seq.num_tokens == 0 and seq.status is SequenceStatus.WAITING
    assert seq.token_ids == [1, 2, 3, 9]
