"""Sampler: greedy and its degenerate cases, seeded reproducibility, distribution sanity."""

from __future__ import annotations

import pytest
import torch

from dist_engine.engine.sampler import Sampler, SamplingState

VOCAB = 50


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits(6)
    states = [SamplingState(temperature=0.0) for _ in range(6)]
    assert torch.equal(Sampler()(logits, states), logits.argmax(-1))


@pytest.mark.parametrize(
    "state_kwargs",
    [{"top_k": 1}, {"top_p": 1e-6}, {"temperature": 1e-4}],
    ids=["top_k=1", "tiny top_p", "tiny temperature"],
)
def test_degenerate_random_settings_are_greedy(state_kwargs: dict) -> None:
    logits = _logits(8, seed=1)
    sampler = Sampler()
    for step in range(5):
        states = [SamplingState(seed=step * 8 + row, **state_kwargs) for row in range(8)]
        assert torch.equal(sampler(logits, states), logits.argmax(-1))


def _sample_sequence(seed: int, other_rows: int, num_steps: int, batch_seed: int) -> list[int]:
    """Sample `num_steps` tokens for one seeded request placed among `other_rows` others."""
    sampler = Sampler()
    target = SamplingState(temperature=0.9, top_k=20, top_p=0.95, seed=seed)
    others = [SamplingState(temperature=1.3, seed=100 + i) for i in range(other_rows)]
    tokens = []
    for step in range(num_steps):
        logits = _logits(other_rows + 1, seed=batch_seed + step)
        # The target's own logits are the same in both runs; its row position differs.
        logits[other_rows // 2] = _logits(1, seed=1000 + step)[0]
        states = [*others[: other_rows // 2], target, *others[other_rows // 2 :]]
        tokens.append(int(sampler(logits, states)[other_rows // 2]))
    return tokens


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    alone = _sample_sequence(seed=42, other_rows=0, num_steps=30, batch_seed=0)
    crowded = _sample_sequence(seed=42, other_rows=7, num_steps=30, batch_seed=555)
    assert alone == crowded
    other_seed = _sample_sequence(seed=43, other_rows=0, num_steps=30, batch_seed=0)
    assert other_seed != alone  # the seed matters (30 draws from a spread distribution)


def test_sampled_frequencies_follow_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -9.0]])
    num_draws = 4000
    state = SamplingState(temperature=1.0, seed=7)
    sampler = Sampler()
    rows = logits.expand(num_draws, -1)
    # Many rows sharing one state draw from its generator in turn, like consecutive steps.
    counts = torch.bincount(sampler(rows, [state] * num_draws), minlength=6).float()
    expected = logits[0].softmax(-1)
    # Binomial std of a frequency is <= 0.5 / sqrt(4000) ~ 0.008; allow ~4 sigma.
    torch.testing.assert_close(counts / num_draws, expected, atol=0.03, rtol=0)


def test_top_k_and_top_p_restrict_support() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0]]).expand(500, -1)
    sampler = Sampler()
    top_k = sampler(logits, [SamplingState(top_k=2, seed=1)] * 500)
    assert set(top_k.tolist()) == {0, 1}
    # Probabilities ~[0.33, 0.30, 0.27, 0.02, 0.006]: top_p 0.5 keeps the first two only.
    top_p = sampler(logits, [SamplingState(top_p=0.5, seed=2)] * 500)
    assert set(top_p.tolist()) == {0, 1}


def test_greedy_and_random_rows_mix() -> None:
    logits = _logits(4, seed=3)
    states = [SamplingState(temperature=0.0), SamplingState(seed=1)] * 2
    tokens = Sampler()(logits, states)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -2}, "top_k must be -1, 0 .* got -2"),
    ],
)
def test_bad_sampling_values_raise(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingState(**kwargs)


def test_logits_rows_must_match_states() -> None:
    with pytest.raises(ValueError, match=r"B = 2 states, got \(3, 50\)"):
        Sampler()(_logits(3), [SamplingState(), SamplingState()])
