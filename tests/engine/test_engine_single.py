"""A DP engine of one rank in this process: the loop, sleeping, streaming, bad input, endings."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from engine_harness import MODEL_SIZES

from dist_engine.engine.config import EngineConfig
from dist_engine.engine.engine import DPEngine
from scheduler import SamplingParams

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


class Running:
    """An engine looping on a thread, collecting every output."""

    def __init__(self, model_dir: str, model=None, **overrides) -> None:
        settings = dict(max_num_seqs=8, max_model_len=64, block_size=4, num_blocks=128)
        settings.update(overrides)
        config = EngineConfig.from_dict({"model": model_dir, "scheduler": settings})
        self.outputs: dict[str, list] = {}
        self.lock = threading.Lock()
        self.engine = DPEngine(config, model=model, on_output=self._collect)
        self.thread = threading.Thread(target=self.engine.run, daemon=True)
        self.thread.start()

    def _collect(self, output) -> None:
        with self.lock:
            self.outputs.setdefault(output.request_id, []).append(output)

    def final(self, request_id: str, timeout_s: float = 20.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                done = [o for o in self.outputs.get(request_id, []) if o.finished]
            if done:
                assert len(done) == 1, f"{request_id} ended {len(done)} times"
                return done[0]
            time.sleep(0.001)
        raise AssertionError(f"{request_id} never ended")

    def close(self) -> None:
        self.engine.shutdown()
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def running(model_dir):
    engine = Running(model_dir)
    yield engine
    engine.close()


@pytest.mark.timing
def test_an_idle_engine_sleeps_and_wakes_promptly(running):
    running.engine.submit("warm", [1, 2, 3], PARAMS)
    running.final("warm")
    time.sleep(0.05)
    steps_before = len(running.engine.trace)
    time.sleep(0.3)
    assert len(running.engine.trace) == steps_before, "the idle engine kept stepping"
    assert running.engine.sleeping
    latencies = []
    for index in range(20):
        start = time.monotonic()
        running.engine.submit(f"r{index}", [5, 6, 7], SamplingParams(max_tokens=1))
        out = running.final(f"r{index}")
        latencies.append(out.first_token_time - start)
        time.sleep(0.002 * (index % 3))
    assert sorted(latencies)[10] < 0.05, latencies


def test_streaming_yields_the_final_tokens_in_order(running):
    running.engine.submit("s", [9, 8, 7, 6], PARAMS, stream=True)
    final = running.final("s")
    with running.lock:
        outs = running.outputs["s"]
    streamed = [t for o in outs for t in o.new_token_ids]
    assert streamed == final.output_token_ids and len(final.output_token_ids) == 6
    assert len(outs) > 1 and final.finish_reason == "length"
    # Every output carries the one prompt list the sequence made once, not a copy per step.
    assert all(o.prompt_token_ids is outs[0].prompt_token_ids for o in outs)
    assert outs[0].prompt_token_ids == [9, 8, 7, 6]


def test_a_duplicate_id_does_not_disturb_the_live_request(running):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    running.engine.submit("dup", [1, 2, 3], params, stream=True)
    deadline = time.monotonic() + 20
    while not running.outputs.get("dup") and time.monotonic() < deadline:
        time.sleep(0.0005)  # the live request has streamed at least one token
    running.engine.submit("dup", [4, 5], PARAMS, stream=True)
    while time.monotonic() < deadline:
        with running.lock:
            outs = list(running.outputs.get("dup", []))
        if sum(o.finished for o in outs) == 2:
            break
        time.sleep(0.005)
    finals = [o for o in outs if o.finished]
    assert sorted(o.finish_reason for o in finals) == [
        "error: request id 'dup' is already in use",
        "length",
    ]
    live = next(o for o in finals if o.finish_reason == "length")
    streamed = [t for o in outs if not o.finished for t in o.new_token_ids] + live.new_token_ids
    assert streamed == live.output_token_ids and len(live.output_token_ids) == 30


def test_bad_requests_get_a_terminal_reason(running):
    running.engine.submit("empty", [], PARAMS)
    running.engine.submit("vocab", [1, MODEL_SIZES["vocab_size"]], PARAMS)
    running.engine.submit("ok", [1, 2], PARAMS)
    running.engine.submit("ok", [3, 4], PARAMS)  # the id is taken
    assert running.final("empty").finish_reason == "error: empty prompt"
    assert "outside the vocabulary [0, 384)" in running.final("vocab").finish_reason
    with running.lock:
        reasons = sorted(o.finish_reason for o in running.outputs["ok"] if o.finished)
    deadline = time.monotonic() + 10
    while len(reasons) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
        with running.lock:
            reasons = sorted(o.finish_reason for o in running.outputs["ok"] if o.finished)
    assert reasons == ["error: request id 'ok' is already in use", "length"]


def test_abort_ends_a_running_request(model_dir):
    engine = Running(model_dir)
    try:
        engine.engine.submit("long", [1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True))
        while not engine.outputs.get("long") and not engine.engine.scheduler.running:
            time.sleep(0.001)
        engine.engine.abort("long")
        out = engine.final("long")
        assert out.finish_reason == "abort" and len(out.output_token_ids) < 60
    finally:
        engine.close()


def test_shutdown_ends_outstanding_requests_and_later_ones(model_dir):
    engine = Running(model_dir)
    engine.engine.submit("held", [1, 2], PARAMS, schedulable=False)
    time.sleep(0.05)
    engine.close()
    assert engine.final("held").finish_reason == "error: engine shut down"
    engine.engine.submit("late", [1, 2], PARAMS)
    assert engine.final("late").finish_reason == "error: engine stopped: engine shut down"


def test_engine_refuses_a_model_len_beyond_the_model(model_dir):
    config = EngineConfig.from_dict(
        {"model": model_dir, "scheduler": {"max_model_len": 100_000, "num_blocks": 16}}
    )
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        DPEngine(config)


def test_kv_pool_sized_from_a_memory_budget(model_dir):
    # The shared tiny model, float32, block 16: (K + V) x 2 kv heads x 16 dims x 2 layers x
    # 4 bytes = 512 bytes per token, 8,192 per block; 1,000,000 bytes hold 122 blocks.
    assert (MODEL_SIZES["num_kv_heads"], MODEL_SIZES["head_dim"]) == (2, 16)
    assert MODEL_SIZES["num_layers"] == 2
    config = EngineConfig.from_dict(
        {"model": model_dir, "kv_cache_bytes": 1_000_000, "scheduler": {"max_model_len": 64}}
    )
    engine = DPEngine(config)
    assert engine.scheduler.config.block_size == 16 and engine.config.dtype == "float32"
    assert engine.scheduler.kv.blocks.num_blocks == 122
    assert engine.model.kv_cache.num_blocks == 122
    # What was allocated is those blocks: it fits the budget, and one block more would not.
    assert engine.model.kv_cache.storage.nbytes == 122 * 8192 <= 1_000_000 < 123 * 8192


def test_a_resumed_request_draws_on_as_the_uninterrupted_one(running):
    """The hook healing uses (DPEngine.submit's seed and resumed_token_ids): a request given
    its first k committed tokens continues with exactly the tokens, logprobs and ending of the
    run that was not interrupted, with penalties and min_tokens counting the resumed tokens,
    and reports only the tokens after them; a seed passed beside params without one draws as
    that seed in the params does."""
    sampled = SamplingParams(
        max_tokens=10, temperature=1.0, seed=11, presence_penalty=1.5, min_tokens=6,
        stop_token_ids=frozenset({3, 5, 9}), logprobs=1, ignore_eos=True,
    )  # fmt: skip
    running.engine.submit("whole", [4, 8, 15, 16], sampled)
    whole = running.final("whole")
    tokens = whole.output_token_ids
    assert len(tokens) >= 6
    unseeded = dataclasses.replace(sampled, seed=None)
    for k in (1, 5):
        running.engine.submit(
            f"resumed{k}", [4, 8, 15, 16], unseeded, stream=True, seed=11,
            resumed_token_ids=tokens[:k],
        )  # fmt: skip
        final = running.final(f"resumed{k}")
        with running.lock:
            outs = list(running.outputs[f"resumed{k}"])
        assert final.output_token_ids == tokens and final.finish_reason == whole.finish_reason
        assert final.prompt_token_ids == [4, 8, 15, 16]
        assert [t for o in outs for t in o.new_token_ids] == tokens[k:]
        logprobs = [entry for o in outs for entry in o.new_logprobs]
        assert [e.token_id for e in logprobs] == tokens[k:]
        pairs = zip(logprobs, whole.new_logprobs[k:], strict=True)
        assert all(abs(got.logprob - want.logprob) < 1e-4 for got, want in pairs)
    with pytest.raises(ValueError, match="leave nothing to generate"):
        running.engine.submit("done", [4, 8], PARAMS, resumed_token_ids=[1] * 6)


def test_a_resumed_grammar_bound_request_draws_on_as_the_uninterrupted_one(running):
    """Structured output across a heal: the resumed request's grammar has taken its committed
    tokens before its first new one is drawn (it once restarted from the grammar's start)."""
    from dist_engine.engine import structured

    params = SamplingParams(
        max_tokens=24, temperature=1.0, seed=7, grammar=structured.regex("[a-z]{6}-[0-9]{6}")
    )
    running.engine.submit("whole", [4, 8, 15, 16], params)
    tokens = running.final("whole").output_token_ids
    assert len(tokens) >= 4
    for k in (1, 3):
        running.engine.submit(f"resumed{k}", [4, 8, 15, 16], params, resumed_token_ids=tokens[:k])
        assert running.final(f"resumed{k}").output_token_ids == tokens


def test_a_grammar_after_a_marker_leaves_the_tokens_before_it_free(running, model_dir):
    """`grammar_after` (a reasoning model's `</think>`): the output is unconstrained until the
    marker, then follows the grammar; resumed before or after the marker, the same tokens."""
    from dist_engine.engine import structured
    from launcher.server.tokenization import ModelTokenizer

    running.engine.submit("free", [4, 8, 15, 16], SamplingParams(max_tokens=8, ignore_eos=True))
    free = running.final("free").output_token_ids
    marker = (free[2],)
    start = free.index(free[2]) + 1  # just after the marker's first occurrence
    params = SamplingParams(
        max_tokens=start + 6, ignore_eos=True, grammar=structured.regex("[0-9]{4}"),
        grammar_after=marker,
    )  # fmt: skip
    running.engine.submit("after", [4, 8, 15, 16], params)
    tokens = running.final("after").output_token_ids
    assert tokens[:start] == free[:start]  # before the marker: what the model says freely
    answer = ModelTokenizer(model_dir).decode(tokens[start:])
    assert answer.isdigit() and len(answer) == 4, answer  # after it: the grammar's
    for k in (1, start + 1):
        running.engine.submit(f"resumed{k}", [4, 8, 15, 16], params, resumed_token_ids=tokens[:k])
        assert running.final(f"resumed{k}").output_token_ids == tokens
    with pytest.raises(ValueError, match="grammar_after needs a grammar"):
        SamplingParams(grammar_after=(1,))


def test_a_reused_model_takes_the_new_engines_decode_capacity(model_dir):
    """An engine handed a model loaded for fewer sequences (tests and benchmarks reuse one)
    sizes its low-latency capacity to its own max_num_seqs: a decode step of all of them runs."""
    first = Running(model_dir, max_num_seqs=2)
    first.engine.submit("warm", [1, 2, 3], PARAMS)
    first.final("warm")
    first.close()
    second = Running(model_dir, model=first.engine.model)
    for index in range(8):
        second.engine.submit(f"r{index}", [3 + index, 4, 5], PARAMS)
    try:
        ends = [second.final(f"r{index}") for index in range(8)]
        assert all(o.finish_reason == "length" for o in ends), ends
        assert max(t.num_seqs for t in second.engine.trace) == 8
    finally:
        second.close()
