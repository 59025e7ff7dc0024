import pytest

from scheduler import SamplingParams, Sequence, SequenceStatus


def test_statuses_map_to_finish_reasons():
    seq = Sequence("r", [1, 2, 3])
    assert seq.finish_reason is None and not seq.is_finished
    expected = {
        SequenceStatus.STOPPED: "stop",
        SequenceStatus.LENGTH_CAPPED: "length",
        SequenceStatus.ABORTED: "abort",
        SequenceStatus.IGNORED: "prompt_length_exceeded",
        SequenceStatus.PREEMPTED: "insufficient_system_resource",
    }
    for status, reason in expected.items():
        seq.status = status
        assert seq.is_finished and seq.finish_reason == reason
    seq.status = SequenceStatus.FAILED
    seq.error_message = "rank 1 died"
    assert seq.finish_reason == "error: rank 1 died"
    assert not SequenceStatus.RUNNING.is_finished and SequenceStatus.FAILED.is_finished


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
