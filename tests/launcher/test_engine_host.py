"""EngineHost: a rank's engine is built and run on one thread of its own."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import launcher.clients as clients
from dist_engine.engine.engine import DPEngine
from dist_engine.engine.stats import ExpertStats
from launcher import LLM, SamplingParams

SETTINGS = dict(dtype="float64", max_num_seqs=4, max_model_len=64, num_blocks=64, block_size=4)


def test_the_engine_is_built_and_stepped_on_the_host_thread(model_dir, monkeypatch):
    # One thread does all the rank's torch work: see EngineHost's docstring for why.
    seen: dict[str, set[threading.Thread]] = {"init": set(), "step": set()}

    class Recording(DPEngine):
        def __init__(self, *args, **kwargs):
            seen["init"].add(threading.current_thread())
            super().__init__(*args, **kwargs)

        def step(self):
            seen["step"].add(threading.current_thread())
            return super().step()

    monkeypatch.setattr(clients, "DPEngine", Recording)
    with LLM(model=model_dir, launcher="local", dp_size=1, **SETTINGS) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
        host_thread = llm.client.host.thread
        assert llm.expert_stats() == ExpertStats(enabled=False)  # no EPLB, nothing measured
    assert len(out[0].output_token_ids) == 3
    assert seen["init"] == seen["step"] == {host_thread}
    assert host_thread is not threading.main_thread()


def test_a_build_error_is_raised_on_the_callers_thread(model_dir):
    before = {t for t in threading.enumerate() if t.name == "lockstep-engine"}
    with pytest.raises(ValueError, match=r"max_model_len \(100000\) exceeds"):
        LLM(model=model_dir, launcher="local", dp_size=1, **{**SETTINGS, "max_model_len": 100000})
    after = {t for t in threading.enumerate() if t.name == "lockstep-engine"}
    assert after == before  # the host's thread has ended


def test_threads_per_rank_sets_the_engine_threads(model_dir):
    before = torch.get_num_threads()
    try:
        with LLM(model=model_dir, launcher="local", threads_per_rank=1, **SETTINGS) as llm:
            assert llm.client.host.num_threads == 1
            out = llm.generate([[4, 5]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].output_token_ids) == 2
    finally:
        torch.set_num_threads(before)  # the setting is process-wide


def test_a_submitted_batch_wakes_the_group_once(model_dir):
    """Every request of a batch is posted first, then one wake: in a group each wake is a
    store round trip or two, and a batch of 128 prompts made 128 of them."""
    with LLM(model=model_dir, launcher="local", **SETTINGS) as llm:
        engine = llm.client.host.engine
        bumps = []
        bump = engine.wake.bump

        def counted() -> int:
            with engine._inbox_lock:
                bumps.append(len(engine._inbox))  # what the wake finds waiting
            return bump()

        engine.wake.bump = counted
        prompts = [[4 + i, 5, 6] for i in range(6)]
        out = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
        woken = list(bumps)
    assert [len(o.output_token_ids) for o in out] == [3] * 6
    assert woken == [6], woken


def test_expert_stats_come_from_the_ranks_eplb(model_dir):
    """LLM.expert_stats() through the client's stats: one rank holds every slot, so its
    balance is perfect and every decision is skipped, with nothing moved."""
    eplb = dict(enable_eplb=True, eplb_num_redundant_experts=2, eplb_interval_steps=2)
    with LLM(model=model_dir, launcher="local", dp_size=1, **SETTINGS, **eplb) as llm:
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8, ignore_eos=True))
        stats = llm.expert_stats()
    assert stats.enabled and stats.balancedness == [1.0, 1.0]  # two MoE layers
    assert stats.num_skipped >= 3 and (stats.num_rebalances, stats.num_failed) == (0, 0)
    assert stats.last_rebalance_step is None and stats.last_rebalance_bytes == 0
    assert len(stats.ranks) == 1 and stats.ranks[0].window_steps >= 2


def test_slots_that_do_not_split_over_the_ranks_are_refused_before_any_rank_starts(model_dir):
    with pytest.raises(ValueError, match=r"experts do not split evenly over parallel.dp_size=3"):
        LLM(model=model_dir, launcher="ray", dp_size=3, **SETTINGS)
    with pytest.raises(
        ValueError, match=r"moe.eplb_num_redundant_experts is 2: .*parallel.dp_size=3"
    ):
        LLM(model=model_dir, dp_size=3, enable_eplb=True, eplb_num_redundant_experts=2, **SETTINGS)


def test_a_take_inside_a_burst_takes_the_whole_burst():
    """A take that wakes at a step's first output waits for the burst's end and takes every
    output of it; outside a burst it returns at once; a burst that does not end holds a take
    only its bound (`burst_wait_s`, 5 ms by default; long here, so the order is certain)."""
    from launcher.clients import OutputBuffer

    buffer = OutputBuffer(burst_wait_s=30.0)
    taken: list[list[str]] = []
    taker = threading.Thread(target=lambda: taken.append(buffer.take(30.0)))
    taker.start()
    buffer.begin_burst()
    buffer.put("a")  # wakes the taker, which waits for the burst's end
    time.sleep(0.05)
    assert taken == []
    buffer.put("b")
    buffer.put("c")
    buffer.end_burst()
    taker.join(30)
    assert taken == [["a", "b", "c"]]
    buffer.put("d")  # outside a burst: at once
    start = time.perf_counter()
    assert buffer.take(30.0) == ["d"]
    assert time.perf_counter() - start < 5.0
    bounded = OutputBuffer(burst_wait_s=0.05)
    bounded.begin_burst()  # never ended: the take waits its bound, then takes what is there
    bounded.put("e")
    start = time.perf_counter()
    assert bounded.take(30.0) == ["e"]
    assert 0.04 <= time.perf_counter() - start < 5.0


def test_a_holding_take_gathers_until_told_and_within_its_bound():
    """`hold` keeps a take gathering: it is asked again whenever more outputs came (at the end
    of a burst that had some, or at a lone output), and the take returns once it says no, or
    `hold_s` after the first output whatever it says."""
    from launcher.clients import OutputBuffer

    buffer = OutputBuffer(burst_wait_s=30.0)
    asked: list[list[str]] = []

    def hold(items: list[str]) -> bool:
        asked.append(list(items))
        return "last" not in items

    taken: list[list[str]] = []
    taker = threading.Thread(target=lambda: taken.append(buffer.take(30.0, hold, hold_s=30.0)))
    taker.start()
    buffer.begin_burst()
    buffer.put("a")
    buffer.end_burst()
    time.sleep(0.05)
    buffer.begin_burst()  # a burst with no outputs wakes nobody
    buffer.end_burst()
    buffer.begin_burst()
    buffer.put("b")
    buffer.end_burst()
    time.sleep(0.05)
    assert taken == []  # still held
    buffer.put("last")  # a lone output: asked at once, and the hold ends
    taker.join(30)
    assert taken == [["a", "b", "last"]]
    assert asked == [["a"], ["a", "b"], ["a", "b", "last"]]

    bounded = OutputBuffer()
    bounded.put("x")
    start = time.perf_counter()
    assert bounded.take(30.0, lambda items: True, hold_s=0.05) == ["x"]
    assert 0.04 <= time.perf_counter() - start < 5.0


def _takes(llm) -> list[int]:
    """Record how many outputs each non-empty take of the local rank returns."""
    host = llm.client.host
    sizes: list[int] = []
    take = host.take

    def counted(timeout_s: float):
        outputs = take(timeout_s)
        if outputs:
            sizes.append(len(outputs))
        return outputs

    host.take = counted
    return sizes


def test_generate_gets_its_results_in_one_take_and_as_completed_as_they_end(model_dir):
    """`generate` reads nothing before the whole batch ended, so its requests are deferred
    and the rank hands their ends over together (for a Ray rank, one round trip instead of
    one per finishing step); `generate_as_completed` gets each end as it comes."""
    prompts = [[4 + i, 5, 6] for i in range(6)]
    params = [SamplingParams(max_tokens=2 + 3 * i, ignore_eos=True) for i in range(6)]
    with LLM(model=model_dir, launcher="local", **{**SETTINGS, "max_num_seqs": 8}) as llm:
        sizes = _takes(llm)
        out = llm.generate(prompts, params, use_tqdm=False)
        assert [len(o.output_token_ids) for o in out] == [2 + 3 * i for i in range(6)]
        # One take (two if a slow host ran the batch past the hold's 0.25 s bound).
        assert sum(sizes) == 6 and len(sizes) <= 2, sizes
        sizes.clear()
        ended = [index for index, _ in llm.generate_as_completed(prompts, params)]
        assert sorted(ended) == list(range(6))
        # Every request ends at a step of its own; a reader that lags may take two at once.
        assert sum(sizes) == 6 and len(sizes) >= 3, sizes


def test_a_stream_is_not_held_behind_deferred_requests(model_dir):
    """Outputs of any request that is not deferred end a hold at once: a stream running
    beside deferred requests gets every token as it comes."""
    from launcher.clients import Submission

    with LLM(model=model_dir, launcher="local", **{**SETTINGS, "max_num_seqs": 8}) as llm:
        host = llm.client.host
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        long = SamplingParams(max_tokens=40, ignore_eos=True)
        host.submit(
            [Submission(f"d{i}", [4 + i, 5], params, False, deferred=True) for i in range(2)]
            + [Submission(f"late{i}", [9 + i, 5], long, False, deferred=True) for i in range(2)]
            + [Submission("s", [7, 8], long, True)]
        )
        takes: list[list[tuple[str, int, bool]]] = []
        while not any(o[0] == "s" and o[2] for take in takes for o in take):
            got = host.take(5.0)
            takes.append([(o.request_id, len(o.new_token_ids), o.finished) for o in got])
        streamed = [o for take in takes for o in take if o[0] == "s"]
        assert sum(n for _, n, _ in streamed) == 40
        assert len(takes) >= 20, takes  # the stream's steps were not gathered
        ends = [o[0] for take in takes for o in take if o[2]]
        assert sorted(ends) == ["d0", "d1", "late0", "late1", "s"]
