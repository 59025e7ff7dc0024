import pytest
from sched_helpers import make_scheduler, make_seq, run_step, run_to_completion

from scheduler import SequenceStatus
from scheduler.decode import preemption_order


def _ids(seqs):
    return [seq.request_id for seq in seqs]


def test_lcfs_order_serves_shortest_output_first():
    seqs = [make_seq(rid, 4) for rid in "abc"]
    for seq, num_output in zip(seqs, (5, 1, 3), strict=True):
        seq.num_output_tokens = num_output
    assert _ids(preemption_order(seqs, "lcfs")) == ["a", "c", "b"]  # a is the first victim


def test_fcfs_order_preempts_the_latest_arrival():
    seqs = [make_seq(rid, 4) for rid in "abc"]
    for index, seq in enumerate(seqs):
        seq.arrival_index = index
        seq.num_output_tokens = 10 - index
    assert _ids(preemption_order(seqs, "fcfs")) == ["c", "b", "a"]


def test_block_tables_grow_one_block_at_a_time():
    sched = make_scheduler(block_size=4)
    sched.add_sequence(make_seq("a", 4, max_tokens=10))
    run_step(sched)  # prefill: 1 block, 4 tokens of KV
    seq = sched.get_sequence("a")
    assert len(seq.block_table) == 1
    run_step(sched)  # writes KV of token 5: a second block
    assert len(seq.block_table) == 2 and seq.num_tokens == 5
    for _ in range(3):
        run_step(sched)
    assert len(seq.block_table) == 2 and seq.num_tokens == 8
    run_step(sched)
    assert len(seq.block_table) == 3


@pytest.mark.parametrize("order", ["lcfs", "fcfs"])
def test_stop_mode_ends_the_victim_with_a_reason(order):
    # 6 usable blocks of 4 tokens; three sequences of 8 tokens take 2 blocks each.
    sched = make_scheduler(
        block_size=4, num_blocks=7, stop_preempted_request=True, preemption_order=order
    )
    for rid in "abc":
        sched.add_sequence(make_seq(rid, 8, max_tokens=6))
    results = run_to_completion(sched)
    reasons = {rid: seq.finish_reason for rid, seq in results.items()}
    assert sorted(reasons.values()).count("insufficient_system_resource") >= 1
    victims = [rid for rid, reason in reasons.items() if reason != "length"]
    # All three grew together; lcfs preempts the oldest of equals, fcfs the latest arrival.
    assert victims[0] == ("a" if order == "lcfs" else "c")


def test_recompute_mode_requeues_at_the_head_and_keeps_results():
    def run(num_blocks):
        sched = make_scheduler(block_size=4, num_blocks=num_blocks)
        for rid in "abcd":
            sched.add_sequence(make_seq(rid, 6, max_tokens=12))
        results = run_to_completion(sched)
        return {rid: seq.output_token_ids for rid, seq in results.items()}, sched

    reference, _ = run(257)
    constrained, _ = run(9)  # 8 usable blocks for 4 x 5 blocks of demand
    assert constrained == reference
    assert all(len(tokens) == 12 for tokens in constrained.values())


def test_preempted_victim_goes_to_the_head_of_waiting():
    # Separate prefill steps: c's prefill does not decode a and b, so it can take a block.
    sched = make_scheduler(block_size=4, num_blocks=5, mixed_steps=False)  # 4 usable blocks
    sched.add_sequence(make_seq("a", 4, max_tokens=20))
    sched.add_sequence(make_seq("b", 4, max_tokens=20))
    run_step(sched)  # both prefilled: 2 blocks
    sched.add_sequence(make_seq("c", 4, max_tokens=20))
    run_step(sched)  # decode_step 0 is an ALL point: c is admitted (3 blocks)
    run_step(sched)  # decode: each needs a second block, only one is free
    assert sched.waiting and sched.waiting[0].status is SequenceStatus.WAITING
    victim = sched.waiting[0]
    assert victim.num_tokens == 0 and not victim.block_table and victim.output_token_ids
    sched.check_integrity()


def test_mixed_step_serves_running_sequences_before_admitting_a_prompt():
    sched = make_scheduler(block_size=4, num_blocks=5)  # 4 usable blocks; mixed steps
    sched.add_sequence(make_seq("a", 4, max_tokens=20))
    sched.add_sequence(make_seq("b", 4, max_tokens=20))
    run_step(sched)  # both prefilled: 2 blocks
    sched.add_sequence(make_seq("c", 4, max_tokens=20))
    outputs, _ = run_step(sched)  # the prefill step decodes a and b first: their second blocks
    # leave none for c, so nobody is preempted and c waits for a block.
    assert not outputs.is_prefill and outputs.num_seqs == 2
    assert [seq.request_id for seq in sched.waiting] == ["c"] and sched.num_preemptions == 0
    assert all(len(seq.block_table) == 2 for seq in sched.running)
    sched.check_integrity()


def test_batch_capped_at_max_num_seqs_without_losing_anyone():
    sched = make_scheduler(max_num_seqs=4)
    for index in range(4):
        sched.add_sequence(make_seq(f"r{index}", 3, max_tokens=30))
    run_step(sched)
    outputs, _ = run_step(sched)
    assert outputs.num_seqs == 4 and len(sched.running) == 4
