from collections import deque

import pytest
from sched_helpers import make_scheduler, make_seq, prompt_part, run_step

from scheduler import SchedulerConfig, SequenceStatus
from scheduler.prefill import chunk_length


def _config(**overrides):
    settings = dict(max_num_batched_tokens=64, max_model_len=512, block_size=4, num_blocks=257)
    settings.update(overrides)
    return SchedulerConfig(**settings)


def test_unschedulable_head_blocks_the_queue():
    sched = make_scheduler()
    sched.add_sequence(make_seq("a", 5, schedulable=False))
    sched.add_sequence(make_seq("b", 5))
    outputs, _ = run_step(sched)
    assert not outputs.is_prefill and outputs.known_empty  # nobody overtakes the head
    sched.set_schedulable("a")
    outputs, _ = run_step(sched)
    assert [s.request_id for s in outputs.scheduled_seqs] == ["a", "b"]


def test_sequence_count_limit_includes_running():
    sched = make_scheduler(max_num_seqs=3)
    for rid in "ab":
        sched.add_sequence(make_seq(rid, 3, max_tokens=50))
    run_step(sched)
    for rid in "cd":
        sched.add_sequence(make_seq(rid, 3))
    outputs, _ = run_step(sched)  # decode_step 0: an ALL point
    assert outputs.is_prefill and [s.request_id for s in prompt_part(outputs)] == ["c"]
    assert [s.request_id for s in outputs.scheduled_seqs[1:]] == ["b", "a"]  # mixed: decoded


def test_sum_k_limit_stops_the_batch():
    sched = make_scheduler(prefill_max_sum_seqlen_k=512, max_num_batched_tokens=1024)
    for rid, length in (("a", 300), ("b", 200), ("c", 100)):
        sched.add_sequence(make_seq(rid, length))
    outputs, _ = run_step(sched)
    assert outputs.seqlens_q == [300, 200]


def test_budget_chunks_one_prompt_and_continues_it_first():
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add_sequence(make_seq("long", 150))
    sched.add_sequence(make_seq("short", 10))
    lengths = []
    for _ in range(3):
        outputs, _ = run_step(sched)
        lengths.append(
            (
                outputs.is_prefill,
                [
                    (s.request_id, q)
                    for s, q in zip(outputs.scheduled_seqs, outputs.seqlens_q, strict=True)
                ],
            )
        )
    assert lengths == [
        (True, [("long", 64)]),  # one chunked sequence per step, then stop
        (True, [("long", 64)]),
        (True, [("long", 22), ("short", 10)]),
    ]
    long_seq = sched.get_sequence("long")
    assert long_seq.status is SequenceStatus.RUNNING and long_seq.num_tokens == 150


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    sched = make_scheduler(chunked_prefill=False, max_num_batched_tokens=512)
    sched.add_sequence(make_seq("a", 300))
    sched.add_sequence(make_seq("b", 300))
    outputs, _ = run_step(sched)
    assert outputs.seqlens_q == [300]  # b does not fit the rest of the budget
    outputs, _ = run_step(sched)
    assert outputs.is_prefill and outputs.seqlens_q == [300, 1]  # b, and a's decode token


def test_prompt_limits_ignore_with_reason():
    sched = make_scheduler(max_model_len=100)
    sched.add_sequence(make_seq("long", 101))
    sched.add_sequence(make_seq("ok", 100, max_tokens=3))
    outputs, _ = run_step(sched)
    assert [(s.request_id, s.finish_reason) for s in outputs.ignored_seqs] == [
        ("long", "prompt_length_exceeded")
    ]
    assert outputs.seqlens_q == [100]


def test_never_fitting_prompt_is_ignored_and_later_waits():
    sched = make_scheduler(num_blocks=11, block_size=4, max_model_len=256)  # 10 usable blocks
    sched.add_sequence(make_seq("huge", 41))  # 11 blocks: NEVER
    sched.add_sequence(make_seq("a", 24, max_tokens=30))  # 6 blocks
    sched.add_sequence(make_seq("b", 24))  # LATER until a finishes
    outputs, _ = run_step(sched)
    assert [s.request_id for s in outputs.ignored_seqs] == ["huge"]
    assert [s.request_id for s in outputs.scheduled_seqs] == ["a"]
    assert sched.waiting[0].request_id == "b"


def test_state_slots_are_admitted_jointly_later_not_never():
    sched = make_scheduler(num_state_slots=3)  # 2 usable slots
    for rid in "abc":
        sched.add_sequence(make_seq(rid, 4, max_tokens=5))
    outputs, _ = run_step(sched)
    assert [s.request_id for s in outputs.scheduled_seqs] == ["a", "b"]
    assert {s.state_slot for s in outputs.scheduled_seqs} == {1, 2}
    c = sched.get_sequence("c")
    assert c.status is SequenceStatus.WAITING and not c.block_table  # nothing allocated
    results = {}
    for _ in range(20):
        outputs, finished = run_step(sched)
        results.update({s.request_id: s for s in finished})
    assert results["c"].finish_reason == "length"


@pytest.mark.parametrize(
    ("budget_left", "cp_size", "expected"),
    [(64, 1, 64), (63, 1, 63), (63, 2, 60), (63, 4, 56), (7, 4, 0)],
)
def test_chunks_align_to_context_parallel_unit(budget_left, cp_size, expected):
    config = _config(cp_size=cp_size)
    seq = make_seq("a", 100)
    assert chunk_length(seq, 0, budget_left, config) == expected


def test_last_piece_of_a_prompt_need_not_be_aligned():
    config = _config(cp_size=2)
    seq = make_seq("a", 10)
    assert chunk_length(seq, 0, 64, config) == 10


def test_chunk_checkpoints_cut_chunks():
    config = _config()
    seq = make_seq("a", 100, chunk_checkpoints=[10, 30])
    assert chunk_length(seq, 0, 64, config) == 10
    assert chunk_length(seq, 10, 64, config) == 20
    assert chunk_length(seq, 30, 64, config) == 64


def test_checkpoints_are_consumed_through_the_scheduler():
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add_sequence(make_seq("a", 50, chunk_checkpoints=[10, 30]))
    seen = [run_step(sched)[0].seqlens_q for _ in range(3)]
    assert seen == [[10], [20], [20]]
    assert not sched.get_sequence("a").chunk_checkpoints


def test_unsplittable_span_shrinks_the_chunk_to_its_start():
    config = _config()
    seq = make_seq("a", 200, unsplittable_spans=[(50, 80)])
    assert chunk_length(seq, 0, 64, config) == 50


def test_unsplittable_span_extends_when_shrunk_chunk_is_too_small():
    config = _config(lookahead_tokens=4)
    # The checkpoint at 20 cuts inside the span; shrinking to 2 would be under the minimum of 4.
    seq = make_seq("a", 200, unsplittable_spans=[(2, 40)], chunk_checkpoints=[20])
    assert chunk_length(seq, 0, 64, config) == 40  # the budget allows going past the span
    assert chunk_length(seq, 0, 30, config) == 0  # it does not: wait for a bigger budget
    plain = make_seq("b", 200, unsplittable_spans=[(2, 40)])
    assert chunk_length(plain, 0, 30, config) == 0


def test_minimum_chunk_applies_to_partial_chunks_only():
    config = _config(lookahead_tokens=8)
    seq = make_seq("a", 100)
    assert chunk_length(seq, 0, 7, config) == 0
    assert chunk_length(seq, 95, 7, config) == 5  # the prompt's last piece


def test_dead_heads_are_swept():
    sched = make_scheduler()
    sched.add_sequence(make_seq("dead", 5))
    sched.add_sequence(make_seq("live", 5))
    assert sched.abort("dead").finish_reason == "abort"
    outputs, _ = run_step(sched)
    assert [s.request_id for s in outputs.scheduled_seqs] == ["live"]
    assert isinstance(sched.waiting, deque) and not sched.waiting


def test_watermark_does_not_stall_a_chunked_prompt_holding_its_blocks():
    # The first chunk reserves every block of the pool (usage 1.0 > 0.9); the rest of the
    # prompt must still be prefilled.
    sched = make_scheduler(block_size=8, num_blocks=6, max_num_batched_tokens=16)
    sched.add_sequence(make_seq("a", 33, max_tokens=1))
    lengths = [run_step(sched)[0].seqlens_q for _ in range(3)]
    assert lengths == [[16], [16], [1]]
    assert sched.num_unfinished == 0


def test_mixed_step_caps_prompt_tokens_only_while_someone_decodes():
    sched = make_scheduler(max_num_batched_tokens=256, mixed_prompt_tokens=32)
    sched.add_sequence(make_seq("long", 100, max_tokens=50))
    outputs, _ = run_step(sched)  # nobody decodes: the full budget
    assert outputs.seqlens_q == [100] and outputs.num_decode_seqs == 0
    sched.add_sequence(make_seq("next", 100))
    lengths = []
    for _ in range(4):
        outputs, _ = run_step(sched)
        assert outputs.is_prefill and outputs.num_decode_seqs == 1  # "long" decodes every step
        lengths.append([seq.request_id for seq in prompt_part(outputs)] + outputs.seqlens_q)
    assert lengths == [["next", 32, 1]] * 3 + [["next", 4, 1]]
    assert sched.get_sequence("long").num_output_tokens == 5  # no step left it out


def test_mixed_cap_never_leaves_a_ready_head_without_a_chunk():
    # The cap is under the minimum chunk: the head still gets the chunk the full budget allows.
    sched = make_scheduler(mixed_prompt_tokens=4, lookahead_tokens=8)
    sched.add_sequence(make_seq("a", 10, max_tokens=20))
    run_step(sched)
    sched.add_sequence(make_seq("b", 40))
    sched.add_sequence(make_seq("c", 10))
    outputs, _ = run_step(sched)
    assert [seq.request_id for seq in prompt_part(outputs)] == ["b"]
    assert outputs.seqlens_q == [40, 1]


def test_mixed_steps_resolve_against_the_policy():
    assert SchedulerConfig().mixed and SchedulerConfig(sync_policy="every_step").mixed
    assert not SchedulerConfig(sync_policy="vote").mixed
    assert not SchedulerConfig(mixed_steps=False).mixed
    with pytest.raises(ValueError, match="mixed_steps needs sync_policy"):
        SchedulerConfig(sync_policy="vote", mixed_steps=True)
    with pytest.raises(ValueError, match="mixed_prompt_tokens"):
        SchedulerConfig(mixed_prompt_tokens=0)


def test_mixed_prompt_cap_by_group_size():
    unset = SchedulerConfig()
    assert unset.mixed_prompt_tokens is None and unset.mixed_prompt_cap == 256
    assert unset.for_group(2).mixed_prompt_cap == 256
    assert unset.for_group(1).mixed_prompt_cap == 1024
    assert SchedulerConfig(mixed_prompt_tokens=48).for_group(1).mixed_prompt_cap == 48
    # Context parallelism charges chunks in whole units: the one-rank cap stays aligned.
    assert (
        SchedulerConfig(cp_size=2, mixed_prompt_tokens=None).for_group(1).mixed_prompt_cap % 4 == 0
    )
