import pytest
from sched_helpers import make_scheduler, make_seq, run_step

from scheduler import SamplingParams, Sequence, SequenceStatus


def _one(settings, seq, tokens):
    """Run one request alone on a fresh scheduler, feeding it ``tokens``."""
    sched = make_scheduler(**settings)
    sched.add_sequence(seq)
    finished = []
    for token in tokens:
        outputs = sched.schedule()
        finished += sched.process_outputs(outputs, [token] * outputs.num_seqs)
    return finished


def test_eos_stops_unless_ignored():
    sched = {}
    seq = Sequence("a", [1, 2], SamplingParams(max_tokens=10), eos_token_id=9)
    assert _one(sched, seq, [5, 9]) == [seq]
    assert seq.finish_reason == "stop" and seq.output_token_ids == [5, 9]
    seq = Sequence("b", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True), eos_token_id=9)
    _one(sched, seq, [9, 9, 9])
    assert seq.finish_reason == "length" and seq.output_token_ids == [9, 9, 9]


def test_stop_ids_then_max_tokens_then_max_model_len():
    sched = {"max_model_len": 6}
    seq = Sequence("a", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[4]))
    _one(sched, seq, [3, 4])
    assert seq.status is SequenceStatus.STOPPED
    seq = Sequence("b", [1, 2], SamplingParams(max_tokens=2, stop_token_ids=[4]))
    _one(sched, seq, [3, 4])  # both rules hold on the last token: the stop id wins
    assert seq.finish_reason == "stop"
    seq = Sequence("c", [1, 2, 3], SamplingParams(max_tokens=10))
    _one(sched, seq, [5, 5, 5])
    assert seq.finish_reason == "length" and len(seq.token_ids) == 6


def test_timing_is_recorded():
    sched = {}
    seq = Sequence("a", [1, 2], SamplingParams(max_tokens=3))
    _one(sched, seq, [5, 6, 7])
    assert seq.first_token_time is not None and seq.first_token_time >= seq.arrival_time
    assert len(seq.token_times) == 3 and seq.token_times == sorted(seq.token_times)
    assert seq.finish_time >= seq.token_times[-1]


def test_wrong_number_of_tokens_is_an_error():
    sched = make_scheduler()
    sched.add_sequence(make_seq("a", 3))
    outputs = sched.schedule()
    with pytest.raises(ValueError, match="scheduled 1 sequences but got 2"):
        sched.process_outputs(outputs, [1, 2])


def test_abort_in_flight_skips_the_output_and_releases_later():
    sched = make_scheduler()
    sched.add_sequence(make_seq("a", 3, max_tokens=5))
    sched.add_sequence(make_seq("b", 3, max_tokens=5))
    run_step(sched)
    outputs = sched.schedule()  # decode step in flight
    a = sched.abort("a")
    assert a.finish_reason == "abort" and a.block_table  # still held: the step may write it
    finished = sched.process_outputs(outputs, [7, 7])
    assert finished == [] and a.output_token_ids == [a.output_token_ids[0]]
    assert not a.block_table and sched.abort("a") is None
    run_step(sched)
    assert [s.request_id for s in sched.running] == ["b"]
    sched.check_integrity()


def test_abort_during_a_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_sequence(make_seq("a", 40))
    outputs = sched.schedule()
    assert outputs.seqlens_q == [16]
    assert sched.abort("a", reason="client went away").finish_reason == ("error: client went away")
    sched.process_outputs(outputs, [0])
    assert not sched.waiting and not sched.running and sched.kv.blocks.num_used == 0
    sched.check_integrity()


def test_bad_requests_end_with_a_reason_at_the_next_step():
    sched = make_scheduler(vocab_size=100, max_model_len=64)
    sched.add_sequence(Sequence("empty", []))
    sched.add_sequence(Sequence("vocab", [1, 100, 2]))
    sched.add_sequence(Sequence("negative", [1, -1]))
    sched.add_sequence(Sequence("long", [1] * 65))
    sched.add_sequence(Sequence("ok", [1, 2]))
    outputs = sched.schedule()
    reasons = {s.request_id: s.finish_reason for s in outputs.ignored_seqs}
    assert reasons == {
        "empty": "error: empty prompt",
        "vocab": "error: prompt token id 100 at position 1 is outside the vocabulary [0, 100)",
        "negative": "error: prompt token id -1 at position 1 is outside the vocabulary [0, 100)",
        "long": "prompt_length_exceeded",
    }
    assert [s.request_id for s in outputs.scheduled_seqs] == ["ok"]
    with pytest.raises(ValueError, match="already in use"):
        sched.add_sequence(Sequence("ok", [1]))
