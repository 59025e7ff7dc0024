from sched_helpers import make_scheduler, run_step, run_to_completion

from scheduler import SamplingParams, Sequence


def _seq(request_id, tokens, max_tokens=2):
    return Sequence(request_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_shared_prefix_is_reused_by_reference():
    sched = make_scheduler(enable_prefix_caching=True, block_size=4)
    shared = list(range(1, 13))  # three full blocks
    sched.add_sequence(_seq("a", [*shared, 50, 51], max_tokens=4))
    outputs, _ = run_step(sched)
    a = outputs.scheduled_seqs[0]
    sched.add_sequence(_seq("b", [*shared, 60]))
    outputs, _ = run_step(sched)
    # b reuses a's three full blocks and computes only its last token.
    b = outputs.scheduled_seqs[0]
    assert b.request_id == "b" and outputs.seqlens_q == [1, 1]  # b's last token, a's decode
    assert b.num_cached_prefix_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    assert all(sched.kv.blocks.ref_counts[blk] == 2 for blk in a.block_table[:3])
    sched.check_integrity()


def test_a_lookup_always_leaves_one_token_to_compute():
    sched = make_scheduler(enable_prefix_caching=True, block_size=4)
    prompt = list(range(1, 9))  # exactly two blocks
    sched.add_sequence(_seq("a", prompt, max_tokens=1))
    run_step(sched)
    sched.add_sequence(_seq("b", prompt, max_tokens=1))
    outputs, _ = run_step(sched)
    assert outputs.seqlens_q == [4]  # first block reused, the last block recomputed
    assert outputs.scheduled_seqs[0].num_cached_prefix_tokens == 4


def test_released_blocks_stay_cached_until_evicted():
    sched = make_scheduler(enable_prefix_caching=True, block_size=4, num_blocks=9)  # 8 usable
    prompt = list(range(1, 14))  # 13 tokens: 4 blocks, 3 full
    sched.add_sequence(_seq("a", prompt, max_tokens=1))
    run_step(sched)  # a finishes at once (max_tokens=1) and releases its blocks
    cache = sched.kv.prefix_cache
    assert len(cache) == 3 and sched.kv.blocks.num_free == 8
    sched.add_sequence(_seq("b", prompt, max_tokens=1))
    outputs, _ = run_step(sched)
    assert outputs.seqlens_q == [1]  # revived from the evictable LRU
    # A new unrelated prompt needing all 8 blocks evicts every cached block.
    sched.add_sequence(_seq("c", list(range(100, 132)), max_tokens=1))
    run_step(sched)
    assert len(cache) == 0 or all(
        sched.kv.blocks.ref_counts[block] == 0 for block in cache._key_by_block
    )
    sched.check_integrity()


def test_prefix_caching_never_changes_tokens():
    def run(enabled):
        sched = make_scheduler(enable_prefix_caching=enabled, block_size=4, num_blocks=40)
        system = list(range(1, 30))
        for index in range(12):
            prompt = [*system, *range(200 + index, 200 + index + index % 5 + 1)]
            sched.add_sequence(_seq(f"r{index}", prompt, max_tokens=10))
        return {rid: s.output_token_ids for rid, s in run_to_completion(sched).items()}

    assert run(True) == run(False)


def test_preempted_sequence_releases_its_references():
    sched = make_scheduler(
        enable_prefix_caching=True, block_size=4, num_blocks=12, max_num_batched_tokens=64
    )
    for index in range(3):
        sched.add_sequence(_seq(f"r{index}", list(range(1, 10)), max_tokens=20))
    results = run_to_completion(sched)
    assert sched.num_preemptions > 0, "the pool was not small enough to preempt"
    assert all(len(seq.output_token_ids) == 20 for seq in results.values())
    assert sched.kv.blocks.num_used == 0
    sched.check_integrity()


def test_a_cache_salt_shares_blocks_only_with_the_same_salt():
    """vLLM's cache_salt: a request reuses the cached prefix of earlier requests with its
    own salt only, so hits cannot tell one tenant which prompts another sent."""
    shared = list(range(1, 13))  # three full blocks

    def cached_tokens(salt_a, salt_b):
        sched = make_scheduler(enable_prefix_caching=True, block_size=4)
        params = SamplingParams(max_tokens=4, ignore_eos=True, cache_salt=salt_a)
        sched.add_sequence(Sequence("a", [*shared, 50, 51], params))
        run_step(sched)
        params = SamplingParams(max_tokens=2, ignore_eos=True, cache_salt=salt_b)
        sched.add_sequence(Sequence("b", [*shared, 60], params))
        outputs, _ = run_step(sched)
        (b,) = [s for s in outputs.scheduled_seqs if s.request_id == "b"]
        run_to_completion(sched)
        sched.check_integrity()
        return b.num_cached_prefix_tokens

    assert cached_tokens(None, None) == 12
    assert cached_tokens("tenant-1", "tenant-1") == 12
    assert cached_tokens("tenant-1", "tenant-2") == 0
    assert cached_tokens(None, "tenant-2") == 0
    assert cached_tokens("tenant-1", None) == 0
