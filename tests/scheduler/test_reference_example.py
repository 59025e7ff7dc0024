"""The reference article's walk-through, step by step: max_num_seqs 4, budget 2048, block 16,
256 blocks, chunked prefill, stop_preempted_request on."""

from scheduler import AttemptPoint, SamplingParams, Scheduler, SchedulerConfig, Sequence

CONFIG = SchedulerConfig(
    max_num_seqs=4,
    max_num_batched_tokens=2048,
    block_size=16,
    num_blocks=256,
    max_model_len=4096,
    chunked_prefill=True,
    stop_preempted_request=True,
    sync_policy="vote",  # the article's ALL/ANY points
)


def _seq(request_id, length):
    return Sequence(request_id, [7] * length, SamplingParams(max_tokens=1000, ignore_eos=True))


def _ids(outputs):
    return [seq.request_id for seq in outputs.scheduled_seqs]


def test_article_walkthrough():
    sched = Scheduler(CONFIG)
    # Step 1: A (3000 tokens) arrives; ALL point, chunk of 2048; blocks for the whole prompt.
    sched.add_sequence(_seq("A", 3000))
    out = sched.schedule()
    a = out.scheduled_seqs[0]
    assert out.is_prefill and out.point is AttemptPoint.ALL and out.seqlens_q == [2048]
    assert len(a.block_table) == 188 and a.chunked_rest_len == 952 and a.status.name == "WAITING"
    sched.process_outputs(out, [1])
    assert sched.waiting[0] is a
    # Step 2: B and C (500 each) arrive; A's last 952 tokens and both fit one step.
    sched.add_sequence(_seq("B", 500))
    sched.add_sequence(_seq("C", 500))
    out = sched.schedule()
    assert out.is_prefill and _ids(out) == ["A", "B", "C"] and out.seqlens_q == [952, 500, 500]
    assert all(seq.status.name == "RUNNING" for seq in out.scheduled_seqs)
    sched.process_outputs(out, [1, 1, 1])
    # Step 3: all three decode; no new blocks are needed yet.
    out = sched.schedule()
    assert not out.is_prefill and out.seqlens_q == [1, 1, 1] and _ids(out) == ["C", "B", "A"]
    sched.process_outputs(out, [1, 1, 1])
    # Step 4: the pool is over the watermark (252 of 255 usable blocks), so at the next ALL
    # point a newly arrived D is not prefilled.
    assert sched.kv.usage() > 0.9
    sched.add_sequence(_seq("D", 16))
    preempted = None
    for _ in range(CONFIG.prefill_attempt_interval + 5):
        out = sched.schedule()
        assert not out.is_prefill, "D was admitted above the watermark"
        if out.ignored_seqs:
            preempted = out
            break
        sched.process_outputs(out, [1] * out.num_seqs)
    # Step 5: the pool runs dry while B and C grow; A, with the longest output (the oldest of
    # equals), is the victim and ends with insufficient_system_resource.
    assert preempted is not None
    assert [s.request_id for s in preempted.ignored_seqs] == ["A"]
    assert preempted.ignored_seqs[0].finish_reason == "insufficient_system_resource"
    assert _ids(preempted) == ["C", "B"]
    sched.process_outputs(preempted, [1, 1])
    sched.check_integrity()
    # Step 6: with A's 189 blocks back, D is prefilled at the next attempt point.
    for _ in range(CONFIG.prefill_attempt_interval + 1):
        out = sched.schedule()
        sched.process_outputs(out, [1] * out.num_seqs)
        if out.is_prefill:
            assert _ids(out) == ["D"]
            break
    else:
        raise AssertionError("D never started")
