"""The samples of one `n` request (one `sample_group`) compute their prompt once and share its
full KV blocks by reference, with or without prefix caching (scheduler/samples.py).

Checked against separate requests (no group): the prompt tokens computed, the blocks the pool
holds, and, after preemptions and aborts, the tokens every sample ends with; after every step,
that no scheduled token writes into a block more than one sequence holds.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_helpers import VOCAB, fake_token, make_scheduler, prompt_part
from test_scheduler_properties import configs

from scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence

PROMPT_64 = [(7 + 13 * i) % VOCAB for i in range(64)]


def sample_token(seq: Sequence) -> int:
    """A stand-in for a seeded draw: a function of the committed tokens and of the sample, so
    samples of one prompt differ and scheduling cannot change any of them."""
    return (fake_token(seq) + 97 * sum(map(ord, seq.request_id))) % VOCAB


def samples(parent: str, prompt: list[int], n: int, max_tokens: int = 4, group=True):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [
        Sequence(f"{parent}-{j}", prompt, params, sample_group=parent if group else None)
        for j in range(n)
    ]


def assert_no_shared_writes(sched: Scheduler, outputs) -> None:
    """No token of the step writes its KV into a block another sequence also holds."""
    size = sched.config.block_size
    counts = sched.kv.blocks.ref_counts
    for seq in outputs.scheduled_seqs:
        for position in range(seq.previous_num_tokens, seq.num_tokens):
            block = seq.block_table[position // size]
            assert counts[block] == 1, (seq, position, block, counts[block])


def step(sched: Scheduler):
    outputs = sched.schedule()
    assert_no_shared_writes(sched, outputs)
    outputs.num_used_blocks = sched.kv.blocks.num_used  # as the step's forward sees the pool
    finished = sched.process_outputs(outputs, [sample_token(s) for s in outputs.scheduled_seqs])
    sched.check_integrity()
    return outputs, finished


def run(sched: Scheduler, seqs: list[Sequence], *, until=None, max_steps=500):
    """Queue ``seqs`` and step until all ended (or ``until(sched)``); returns the prompt
    tokens computed and the most blocks the pool held during a step."""
    for seq in seqs:
        sched.add_sequence(seq)
    num_prompt_tokens = most_used = 0
    for _ in range(max_steps):
        if sched.num_unfinished == 0 or (until is not None and until(sched)):
            return num_prompt_tokens, most_used
        outputs, _ = step(sched)
        num_prompt = len(prompt_part(outputs)) if outputs.is_prefill else 0
        num_prompt_tokens += sum(outputs.seqlens_q[:num_prompt])
        most_used = max(most_used, outputs.num_used_blocks)
    raise AssertionError(f"not done after {max_steps} steps: {sched.waiting} {sched.running}")


def big_scheduler(**overrides) -> Scheduler:
    return make_scheduler(block_size=16, num_blocks=129, max_model_len=256, **overrides)


def test_four_samples_of_a_64_token_prompt_compute_it_once():
    grouped = big_scheduler()
    seqs = samples("p", PROMPT_64, 4, max_tokens=1)
    computed, most_used = run(grouped, seqs)
    # The prompt once, then each other sample's last block (16 tokens, its last token's):
    # the 3 blocks before the last token are computed once and held by all four. The pool's
    # most is in the second step: those 3 and the other samples' last blocks (the first
    # sample ended with its first token and gave its own last block back).
    assert computed == 64 + 3 * 16
    assert most_used == 3 + 3
    separate = big_scheduler()
    computed, most_used = run(separate, samples("p", PROMPT_64, 4, max_tokens=1, group=False))
    assert computed == 4 * 64 and most_used == 4 * 4
    assert grouped.pool_usage().num_shared_prompt_tokens == 3 * 48
    assert separate.pool_usage().num_shared_prompt_tokens == 0


def test_the_prompts_full_blocks_are_held_once_by_reference():
    sched = big_scheduler()
    prompt = [*PROMPT_64, 1, 2, 3, 4, 5, 6]  # 4 full blocks and 6 tokens
    seqs = samples("p", prompt, 4, max_tokens=8)
    computed, _ = run(sched, seqs, until=lambda s: len(s.running) == 4)
    assert computed == 70 + 3 * 6  # the partial block and the last token, per sample
    shared = seqs[0].block_table[:4]
    assert all(seq.block_table[:4] == shared for seq in seqs)
    assert all(sched.kv.blocks.ref_counts[block] == 4 for block in shared)
    assert len({seq.block_table[4] for seq in seqs}) == 4  # each sample's own partial block
    assert sched.kv.blocks.num_used == 4 + 4
    assert [seq.num_cached_prefix_tokens for seq in seqs] == [0, 64, 64, 64]


def test_siblings_wait_one_step_then_share_and_others_queue_behind():
    sched = big_scheduler()
    for seq in samples("p", PROMPT_64, 3):
        sched.add_sequence(seq)
    sched.add_sequence(Sequence("other", [1, 2, 3], SamplingParams(max_tokens=2)))
    first, _ = step(sched)
    assert [s.request_id for s in prompt_part(first)] == ["p-0"]  # no overtaking the siblings
    second, _ = step(sched)
    assert [s.request_id for s in prompt_part(second)] == ["p-1", "p-2", "other"]
    assert second.seqlens_q[:3] == [16, 16, 3]


def test_with_prefix_caching_the_siblings_hit_the_cache_instead():
    sched = big_scheduler(enable_prefix_caching=True)
    computed, _ = run(sched, samples("p", PROMPT_64, 4, max_tokens=1))
    assert computed == 64 + 3 * 16
    usage = sched.pool_usage()
    assert usage.num_prefix_hit_tokens == 3 * 48 and usage.num_shared_prompt_tokens == 0


def test_a_request_for_prompt_logprobs_computes_its_whole_prompt():
    sched = big_scheduler()
    seqs = samples("p", PROMPT_64, 2, max_tokens=1)
    seqs[1].sampling_params = SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    computed, _ = run(sched, seqs)
    assert computed == 2 * 64


def test_different_prompts_under_one_key_share_only_what_they_have_in_common():
    sched = big_scheduler()
    other = [*PROMPT_64[:32], *(t + 1 for t in PROMPT_64[32:])]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    seqs = [Sequence("a", PROMPT_64, params, sample_group="g")]
    seqs.append(Sequence("b", other, params, sample_group="g"))
    computed, _ = run(sched, seqs)
    assert computed == 64 + 32


def test_aborting_one_sample_leaves_the_others_blocks_and_tokens():
    reference = {s.request_id: s for s in samples("p", PROMPT_64, 4, max_tokens=6, group=False)}
    run(big_scheduler(), list(reference.values()))
    sched = big_scheduler()
    seqs = samples("p", PROMPT_64, 4, max_tokens=6)
    run(sched, seqs, until=lambda s: len(s.running) == 4)
    shared = seqs[0].block_table[:3]
    assert sched.abort("p-0") is seqs[0]  # the one that computed the prompt
    assert seqs[0].block_table == [] and all(
        sched.kv.blocks.ref_counts[block] == 3 for block in shared
    )
    run(sched, [])
    for seq in seqs[1:]:
        assert seq.output_token_ids == reference[seq.request_id].output_token_ids
    assert sched.kv.blocks.num_used == 0


def test_aborting_every_sample_frees_the_pool_even_in_flight():
    sched = big_scheduler()
    seqs = samples("p", PROMPT_64, 4, max_tokens=6)
    run(sched, seqs, until=lambda s: len(s.running) == 4)
    outputs = sched.schedule()  # a decode step in flight while every sample is aborted
    for seq in seqs:
        assert sched.abort(seq.request_id) is seq
    assert sched.process_outputs(outputs, [1] * outputs.num_seqs) == []
    sched.check_integrity()
    assert sched.kv.blocks.num_used == 0 and sched.num_unfinished == 0


def test_the_sample_computing_the_prompt_aborted_in_flight_hands_it_to_a_sibling():
    sched = big_scheduler()
    seqs = samples("p", PROMPT_64, 3, max_tokens=2)
    for seq in seqs:
        sched.add_sequence(seq)
    outputs = sched.schedule()
    assert prompt_part(outputs) == [seqs[0]]
    sched.abort("p-0")
    sched.process_outputs(outputs, [1])
    computed, _ = run(sched, [])
    assert computed == 64 + 16  # p-1 computed it again, p-2 shared p-1's
    assert all(seq.num_output_tokens == 2 for seq in seqs[1:])


def test_preempted_samples_recompute_without_touching_their_siblings_blocks():
    """A pool too small for every sample's outputs: samples are preempted and recomputed
    (sharing again from the ones still running) and still end with the separate requests'
    tokens."""
    prompt = PROMPT_64[:10]

    def finish(group: bool, num_blocks: int):
        sched = make_scheduler(block_size=4, num_blocks=num_blocks, max_model_len=64)
        seqs = samples("p", prompt, 4, max_tokens=20, group=group)
        run(sched, seqs)
        return sched, {seq.request_id: seq.output_token_ids for seq in seqs}

    _, reference = finish(False, 200)
    sched, tokens = finish(True, 18)
    assert sched.num_preemptions > 0
    assert tokens == reference
    assert sched.kv.blocks.num_used == 0


# -- random workloads ------------------------------------------------------------------------
workloads = st.lists(
    st.tuples(
        st.integers(1, 40),  # prompt length
        st.integers(1, 4),  # n
        st.integers(1, 12),  # max_tokens
        st.integers(0, 20),  # arrival step
        st.one_of(st.none(), st.tuples(st.integers(0, 3), st.integers(0, 40))),  # abort
    ),
    min_size=1,
    max_size=6,
)


def simulate(config: SchedulerConfig, workload, *, group=True, max_steps=1500):
    sched = Scheduler(config)
    reported: dict[str, list[Sequence]] = {}
    ids = set()
    last_arrival = max(arrival for _, _, _, arrival, _ in workload)
    for now in range(max_steps):
        for index, (length, n, max_tokens, arrival, abort) in enumerate(workload):
            if arrival == now:
                prompt = [(31 * index + 7 * i) % VOCAB for i in range(length)]
                for seq in samples(f"r{index}", prompt, n, max_tokens, group):
                    ids.add(seq.request_id)
                    sched.add_sequence(seq)
            if abort is not None and abort[1] == now:
                seq = sched.abort(f"r{index}-{abort[0]}")
                if seq is not None:
                    reported.setdefault(seq.request_id, []).append(seq)
        outputs, finished = step(sched)
        for seq in [*outputs.ignored_seqs, *finished]:
            reported.setdefault(seq.request_id, []).append(seq)
        if now > last_arrival and sched.num_unfinished == 0:
            break
    else:
        raise AssertionError(f"not finished after {max_steps} steps")
    for seq in sched.schedule().ignored_seqs:
        reported.setdefault(seq.request_id, []).append(seq)
    assert set(reported) == ids and all(len(seqs) == 1 for seqs in reported.values())
    assert sched.kv.blocks.num_used == 0
    return {rid: seqs[0] for rid, seqs in reported.items()}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads, overrides=configs)
def test_random_sample_groups_end_once_and_with_the_separate_requests_tokens(workload, overrides):
    max_model_len = 96 if overrides["chunked_prefill"] else overrides["max_num_batched_tokens"]
    reported = simulate(SchedulerConfig(max_model_len=max_model_len, **overrides), workload)
    reference = simulate(
        SchedulerConfig(max_model_len=96, num_blocks=2000, max_num_batched_tokens=4096),
        [(length, n, max_tokens, arrival, None) for length, n, max_tokens, arrival, _ in workload],
        group=False,
    )
    for rid, seq in reported.items():
        if seq.finish_reason == "length" and len(seq.token_ids) < max_model_len:
            assert seq.output_token_ids == reference[rid].output_token_ids, rid
