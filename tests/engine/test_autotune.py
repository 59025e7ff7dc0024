"""`auto` backends: timed on the rank's shapes, the fastest per regime, cached per host."""

from __future__ import annotations

import json
import time

import pytest
import torch

from dist_engine import autotune
from dist_engine.autotune import TuneShapes, tune
from dist_engine.backends import candidates, resolve_backends
from dist_engine.kernels import build
from dist_engine.layers.linear import onednn_serves

TINY = TuneShapes(
    dtype="float32",
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_local_experts=4,
    moe_intermediate_size=32,
    top_k=2,
    ep_size=2,
    decode_tokens=8,
    prefill_tokens=64,
    block_size=4,
    attention_kind="gqa",
    vocab_size=96,
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(autotune, "cache_root", lambda: tmp_path)
    monkeypatch.setenv("LOCKSTEP_AUTOTUNE", "1")
    return tmp_path


def test_the_fastest_wins_per_regime_and_the_decision_is_cached(cache, monkeypatch):
    delays = {
        ("experts", "decode"): {"native": 0.004, "torch": 0.001, "grouped_mm": 0.003},
        ("experts", "prefill"): {"native": 0.001, "torch": 0.004, "grouped_mm": 0.002},
    }
    built: list[tuple[str, str, str]] = []

    def fake_workload(op, regime, name, shapes):
        built.append((op, regime, name))
        return lambda: time.sleep(delays[(op, regime)][name])

    monkeypatch.setattr(autotune, "_workload", fake_workload)
    every = ["native", "torch", "grouped_mm"]
    candidates = {"experts": {"decode": every, "prefill": every}}
    lines: list[str] = []
    choices = tune(TINY, candidates, lines.append)
    assert choices == {"experts": {"decode": "torch", "prefill": "native"}}
    assert len(built) == 6 and any("timed experts decode: torch" in line for line in lines)
    record = json.loads(next(cache.glob("autotune/*.json")).read_text())
    assert record["choices"] == choices and len(record["timings_ms"]) == 2
    # A second start on this host reads the decision instead of timing.
    built.clear()
    assert tune(TINY, candidates, lines.append) == choices and not built
    assert "timed on this host earlier" in lines[-1]
    # Another thread count (or shape) is another decision.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    tune(TINY, candidates, lines.append)
    assert len(built) == 6


def test_a_required_gain_keeps_pytorch_unless_the_other_is_clearly_faster():
    """The linears' oneDNN replaces F.linear only when it times REQUIRED_GAIN faster; the
    other kinds of op take the fastest."""
    gain = autotune.REQUIRED_GAIN["linear"]
    assert gain > 1.0
    assert autotune.choose("linear", {"torch": 1.0, "onednn": 1.0 / gain * 1.01}) == "torch"
    assert autotune.choose("linear", {"torch": 1.0, "onednn": 1.0 / gain * 0.99}) == "onednn"
    assert autotune.choose("linear", {"torch": 0.9, "onednn": 1.0}) == "torch"
    assert autotune.choose("experts", {"torch": 1.0, "native": 0.99}) == "native"
    assert autotune.choose("experts", {"native": 1.0, "grouped_mm": 0.5}) == "grouped_mm"


def test_auto_times_the_real_candidates_and_leaves_fixed_keys_alone(cache):
    backends = resolve_backends(
        {"attention_backend": "torch", "expert_backend": "auto", "norm_backend": "auto"},
        torch.float32,
        "cpu",
        shapes=TINY,
    )
    assert str(backends.attention) == "torch"
    for regime in ("decode", "prefill"):
        assert getattr(backends.experts, regime) in ("native", "torch", "grouped_mm")
        assert getattr(backends.norm, regime) in ("native", "torch")
        assert getattr(backends.linear, regime) in ("torch", "onednn", "onednn_t")
        assert getattr(backends.sampler, regime) in ("native", "torch")
    [record] = [json.loads(p.read_text()) for p in cache.glob("autotune/*.json")]
    timed = {(d["op"], d["regime"]): d["timings_ms"] for d in record["timings_ms"]}
    ops = ("experts", "norm", "linear")
    regimes = ("decode", "prefill")
    assert set(timed) == {(op, r) for op in ops for r in regimes} | {("sampler", "decode")}
    assert backends.sampler.prefill == backends.sampler.decode  # one choice for both
    assert set(timed[("experts", "prefill")]) == {"native", "torch", "grouped_mm"}
    assert set(timed[("sampler", "decode")]) == {"native", "torch"}
    assert set(timed[("linear", "decode")]) == {"torch", "onednn", "onednn_t"}
    assert all(ms > 0 for times in timed.values() for ms in times.values())


def test_without_timing_auto_is_the_rule_and_bad_choices_name_the_key(monkeypatch):
    monkeypatch.setenv("LOCKSTEP_AUTOTUNE", "0")
    rule = resolve_backends({}, torch.float32, "cpu", shapes=TINY)
    assert str(rule.experts) == "native" and str(rule.attention) == "native"
    assert str(rule.sampler) == "native"
    assert str(resolve_backends({}, torch.float32, "cuda").sampler) == "torch"
    with pytest.raises(ValueError, match=r"sampler_backend is 'native', which cannot run"):
        resolve_backends({"sampler_backend": "native"}, torch.float32, "cuda")
    with pytest.raises(ValueError, match=r"expert_backend is 'grouped_mm', which cannot run"):
        resolve_backends({"expert_backend": "grouped_mm"}, torch.float64, "cpu")
    half = resolve_backends({"expert_backend": "grouped_mm"}, torch.bfloat16, "cpu")
    assert str(half.experts) == "grouped_mm"
    # The linears: PyTorch's unless measured (oneDNN wins on some processors only); oneDNN
    # asked for where it cannot run names the key.
    assert str(rule.linear) == "torch"
    assert str(resolve_backends({"linear_backend": "onednn"}, torch.float32, "cpu").linear) == (
        "onednn"
    )
    cannot = [(torch.float64, "cpu"), (torch.float32, "cuda")]
    if onednn_serves(torch.bfloat16):  # AVX-512 hosts; AVX2-only ones have no bf16 GEMM in it
        chosen = resolve_backends({"linear_backend": "onednn"}, torch.bfloat16, "cpu").linear
        assert str(chosen) == "onednn"
    else:
        cannot.append((torch.bfloat16, "cpu"))
        names = candidates("linear_backend", "decode", torch.bfloat16, "cpu")
        assert "onednn" not in names and "onednn_t" not in names
    for dtype, device in cannot:
        with pytest.raises(ValueError, match=r"linear_backend is 'onednn', which cannot run"):
            resolve_backends({"linear_backend": "onednn"}, dtype, device)
