"""Sampler: each setting against an independent reference (plain loops, transformers' logits
processors), the drawn distribution against the filtered softmax, batch invariance, resumption,
logprobs, prompt logprobs and the errors a row can cause."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import dist_engine.engine.sampler as sampler_module
from dist_engine.engine.request import TokenHistory
from dist_engine.engine.sampler import (
    Sampler,
    SamplingRow,
    check_row,
    draw_uniform,
    prompt_logprobs,
)
from scheduler import SamplingParams

VOCAB = 50


def _logits(num_rows: int, seed: int = 0, vocab: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _row(seed: int = 0, index: int = 0, **settings) -> SamplingRow:
    history = {k: settings.pop(k) for k in ("prompt", "output", "stops") if k in settings}
    return SamplingRow(
        SamplingParams(**settings),
        seed,
        index,
        prompt_token_ids=history.get("prompt", ()),
        output_token_ids=history.get("output", ()),
        stop_token_ids=frozenset(history.get("stops", ())),
    )


def _hf_filtered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers in vLLM's order: temperature, min_p, top_k, top_p. [1, V] → [1, V]."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.min_p > 0:
        warpers.append(MinPLogitsWarper(params.min_p))
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    return warpers(torch.zeros(1, 1, dtype=torch.long), logits.clone())


# -- greedy ----------------------------------------------------------------------------------------
def test_greedy_is_argmax_and_ignores_the_seed() -> None:
    logits = _logits(6)
    rows = [_row(seed=s, index=s) for s in range(6)]
    assert torch.equal(Sampler()(logits, rows).token_ids, logits.argmax(-1))


def test_greedy_rows_among_random_ones_stay_argmax() -> None:
    logits = _logits(6, seed=17)
    rows = [_row(seed=1), _row(seed=2, temperature=1.5), _row(seed=3, temperature=1.0, top_p=0.3)]
    tokens = Sampler()(logits, rows * 2).token_ids
    assert tokens[0] == logits[0].argmax() and tokens[3] == logits[3].argmax()


@pytest.mark.parametrize(
    "settings",
    [{"top_k": 1}, {"top_p": 1e-6}, {"temperature": 1e-4}, {"min_p": 1.0}],
    ids=["top_k=1", "tiny top_p", "tiny temperature", "min_p=1"],
)
def test_degenerate_random_settings_are_greedy(settings: dict) -> None:
    logits = _logits(8, seed=1)
    settings = {"temperature": 1.0, **settings}
    for step in range(5):
        rows = [_row(seed=step * 8 + r, index=step, **settings) for r in range(8)]
        assert torch.equal(Sampler()(logits, rows).token_ids, logits.argmax(-1))


# -- adjustments against references (processed logprobs of greedy rows show the adjusted logits) ---
def _adjusted(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """A greedy row's logits after bias, min_tokens and penalties, read back as their log-softmax
    (its processed logprobs over the whole vocabulary). logits: [1, V] → [V]."""
    asked = replace(row, params=replace(row.params, logprobs=-1))
    out = Sampler("processed_logprobs")(logits, [asked]).logprobs
    assert out is not None
    dense = torch.empty(logits.shape[1])
    dense[out.top_token_ids[0]] = out.top_logprobs[0]
    return dense


def test_repetition_penalty_matches_transformers() -> None:
    logits = _logits(1, seed=2)
    prompt, output = [1, 4, 4, 9, 30], [9, 12, 12, 49]
    row = _row(prompt=prompt, output=output, repetition_penalty=1.7)
    history = torch.tensor([prompt + output])
    expected = RepetitionPenaltyLogitsProcessor(1.7)(history, logits.clone())
    torch.testing.assert_close(_adjusted(logits, row), expected[0].log_softmax(-1))


def test_frequency_and_presence_penalties_match_a_loop() -> None:
    logits = _logits(1, seed=3)
    output = [5, 5, 5, 8, 13, 13]
    row = _row(prompt=[8, 20], output=output, frequency_penalty=0.4, presence_penalty=-1.1)
    expected = logits[0].clone()
    for token in range(VOCAB):
        count = output.count(token)  # the prompt does not count for these two
        expected[token] -= 0.4 * count + (-1.1 if count else 0.0)
    torch.testing.assert_close(_adjusted(logits, row), expected.log_softmax(-1))


def test_penalties_read_tensor_histories_as_they_read_lists() -> None:
    """The runner hands the histories as int64 tensors (TokenHistory); another caller's rows
    may hand lists, beside them. Same logits either way, and an id outside the vocabulary is
    refused naming its row, as from a list."""
    logits = _logits(3, seed=5)
    settings = dict(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2)
    histories = [([1, 4, 4], [4, 9, 9, 9]), ([7], [2, 2, 30]), ([0, 49], [])]
    as_lists = [_row(prompt=p, output=o, **settings) for p, o in histories]
    as_tensors = [
        _row(prompt=torch.tensor(p, dtype=torch.int64), output=torch.tensor(o, dtype=torch.int64),
             **settings)
        for p, o in histories
    ]  # fmt: skip
    mixed = [as_tensors[0], as_lists[1], as_tensors[2]]
    expected = Sampler("processed_logprobs")(logits, [_logprobs_all(r) for r in as_lists])
    for rows in (as_tensors, mixed):
        got = Sampler("processed_logprobs")(logits, [_logprobs_all(r) for r in rows])
        assert torch.equal(got.token_ids, expected.token_ids)
        assert got.logprobs is not None and expected.logprobs is not None
        torch.testing.assert_close(got.logprobs.top_logprobs, expected.logprobs.top_logprobs)
    bad = [as_tensors[0], _row(output=torch.tensor([3, VOCAB + 2]), **settings)]
    with pytest.raises(ValueError, match=rf"row 1: token ids \[{VOCAB + 2}\] in its history"):
        Sampler()(_logits(2), bad)


def _logprobs_all(row: SamplingRow) -> SamplingRow:
    return replace(row, params=replace(row.params, logprobs=-1))


def test_a_token_history_grows_by_the_new_ids_and_keeps_what_it_handed_out() -> None:
    history, ledger = TokenHistory(), [5, 6, 7]
    first = history.view(ledger, 1, 3)
    assert first.tolist() == [6, 7]
    ledger += list(range(100, 200))  # past the first buffer: it grows
    second = history.view(ledger, 1, len(ledger))
    assert second.tolist() == ledger[1:] and first.tolist() == [6, 7]
    assert history.view([9, 8], 0, 2).tolist() == [9, 8]  # a shorter ledger starts again


def test_all_penalties_apply_in_vllms_order() -> None:
    """Repetition first (on the biased logits), then frequency, then presence."""
    logits = _logits(1, seed=4)
    prompt, output = [2, 3], [3, 3, 7]
    row = _row(
        prompt=prompt,
        output=output,
        repetition_penalty=0.6,
        frequency_penalty=0.3,
        presence_penalty=0.9,
        logit_bias={2: -4.0, 7: 2.5, 11: 1.0},
    )
    expected = logits[0].clone().tolist()
    for token, bias in {2: -4.0, 7: 2.5, 11: 1.0}.items():
        expected[token] += bias
    for token in range(VOCAB):
        if token in prompt or token in output:
            value = expected[token]
            expected[token] = value / 0.6 if value > 0 else value * 0.6
        count = output.count(token)
        expected[token] -= 0.3 * count + (0.9 if count else 0.0)
    torch.testing.assert_close(_adjusted(logits, row), torch.tensor(expected).log_softmax(-1))


def test_logit_bias_matches_transformers_sequence_bias() -> None:
    logits = _logits(1, seed=5)
    bias = {0: 7.5, 17: -100.0, 49: 0.25}
    expected = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(
        torch.tensor([[3]]), logits.clone()
    )
    torch.testing.assert_close(
        _adjusted(logits, _row(logit_bias=bias)), expected[0].log_softmax(-1)
    )
    # A bias is strong enough to decide a greedy row.
    assert Sampler()(logits, [_row(logit_bias={23: 100.0})]).token_ids.item() == 23


def test_min_tokens_masks_stop_ids_like_transformers() -> None:
    logits = _logits(1, seed=6)
    stops = [4, 31]
    for index in range(4):
        row = _row(index=index, stops=stops, min_tokens=3, max_tokens=8)
        # transformers counts new tokens from the input length: index tokens past the prompt.
        reference = MinNewTokensLengthLogitsProcessor(1, 3, stops)(
            torch.zeros(1, 1 + index, dtype=torch.long), logits.clone()
        )
        got = _adjusted(logits, row)
        assert torch.equal(torch.isinf(got), torch.isinf(reference[0]))
        assert torch.isinf(got[stops]).all() == (index < 3)


def test_min_tokens_keeps_a_greedy_row_off_eos_until_reached() -> None:
    logits = _logits(1, seed=7)
    logits[0, 9] = 50.0  # EOS is by far the most likely token
    tokens = [
        Sampler()(logits, [_row(index=i, stops=[9], min_tokens=3)]).token_ids.item()
        for i in range(5)
    ]
    best_other = int(logits[0].index_fill(0, torch.tensor([9]), float("-inf")).argmax())
    assert tokens == [best_other] * 3 + [9, 9]


# -- filters against transformers' warpers ---------------------------------------------------------
FILTERS = [
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 7},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 0.9, "min_p": 0.08},
    {"temperature": 0.8, "top_k": 12, "top_p": 0.7},
    {"temperature": 1.1, "min_p": 0.02, "top_k": 20, "top_p": 0.9},
    {"temperature": 1.0, "min_p": 0.05, "top_p": 0.6},
]


@pytest.mark.parametrize(
    "settings", FILTERS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items())
)
def test_processed_logprobs_match_transformers_warpers(settings: dict) -> None:
    logits = _logits(1, seed=8)
    row = _row(seed=1, logprobs=-1, **settings)
    out = Sampler("processed_logprobs")(logits, [row]).logprobs
    assert out is not None
    dense = torch.empty(VOCAB)
    dense[out.top_token_ids[0]] = out.top_logprobs[0]
    expected = _hf_filtered(logits, row.params)[0].log_softmax(-1)
    assert torch.equal(torch.isinf(dense), torch.isinf(expected))  # the same support
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(dense[finite], expected[finite])


def _chi_square_bound(degrees: int) -> float:
    """Wilson-Hilferty quantile of chi-square at 1 - 1e-5."""
    z = 4.265
    return degrees * (1 - 2 / (9 * degrees) + z * math.sqrt(2 / (9 * degrees))) ** 3


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    num_draws = float(counts.sum())
    support = probs > 0
    expected = probs[support].double() * num_draws
    statistic = float(((counts[support].double() - expected) ** 2 / expected).sum())
    return statistic, int(support.sum()) - 1


@pytest.mark.parametrize(
    "settings", FILTERS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items())
)
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_drawn_frequencies_follow_the_filtered_softmax(settings: dict, native: bool) -> None:
    """6000 draws of one row (consecutive indices, as in a generation) against the filtered
    softmax; the same statistic rejects the unfiltered softmax, so the bound has teeth. With
    the native draw (`sampler_backend: native`) the unfiltered rows take the compiled kernel,
    the filtered ones PyTorch's path."""
    logits = _logits(1, seed=9, scale=1.5)
    num_draws = 6000
    rows = [_row(seed=12345, index=i, **settings) for i in range(num_draws)]
    tokens = Sampler(native=native)(logits.expand(num_draws, -1), rows).token_ids
    probs = _hf_filtered(logits, rows[0].params)[0].softmax(-1)
    counts = torch.bincount(tokens, minlength=VOCAB)
    assert (counts[probs == 0] == 0).all(), "drew a token the filters remove"
    statistic, degrees = _chi_square(counts, probs)
    assert statistic < _chi_square_bound(degrees), (statistic, degrees)
    wrong = logits[0].softmax(-1)  # ignores temperature and every filter
    wrong_statistic, wrong_degrees = _chi_square(counts, wrong)
    assert wrong_statistic > _chi_square_bound(wrong_degrees)


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_large_vocabulary_draws_follow_the_softmax(native: bool) -> None:
    """A vocabulary of many blocks (and not a whole number of them): the two-level draw."""
    vocab = 3 * 256 + 17
    logits = torch.zeros(1, vocab)
    logits[0, ::97] = 3.0  # a few likely tokens spread over the blocks
    num_draws = 4000
    rows = [_row(seed=99, index=i, temperature=1.0) for i in range(num_draws)]
    tokens = Sampler(native=native)(logits.expand(num_draws, -1), rows).token_ids
    assert int(tokens.max()) < vocab
    probs = logits[0].softmax(-1)
    likely = logits[0] > 0
    frequency = float(likely[tokens].float().mean())
    # Binomial std of that frequency ~ sqrt(p(1-p)/4000) ~ 0.008: allow ~5 sigma.
    assert abs(frequency - float(probs[likely].sum())) < 0.04


# -- reproducibility -------------------------------------------------------------------------------
TARGETS = {
    "top_k+top_p+presence": {
        "temperature": 0.9,
        "top_k": 20,
        "top_p": 0.95,
        "presence_penalty": 0.5,
    },
    "wide top_p (sorts)": {"temperature": 1.5, "top_p": 0.97},
    "min_p+repetition": {"temperature": 1.0, "min_p": 0.01, "repetition_penalty": 1.3},
    "unfiltered+presence": {"temperature": 0.8, "presence_penalty": 0.4},
}
OTHERS = [
    {},
    {"temperature": 1.3, "logprobs": 1},
    {"temperature": 1.0, "top_p": 0.5},
    {"temperature": 0.6, "top_k": 40, "repetition_penalty": 1.2},
    {"temperature": 1.0, "min_p": 0.1, "logit_bias": {3: 2.0}},
    {"temperature": 1.0, "top_k": 3, "logprobs": 7},
    {"temperature": 2.0, "top_p": 0.99},
]


def _generate(
    seed: int, target: dict, num_steps: int, num_others: int, batch_seed: int, native: bool
) -> tuple[list[int], list[torch.Tensor]]:
    """Generate one seeded request placed among `num_others` rows of other settings. Its logits
    depend on its own history only (a toy model); the others' change with batch_seed."""
    vocab = 3000  # several blocks, not a whole number of them, and nuclei wider than the prefix
    table = _logits(64, seed=1000, vocab=vocab, scale=0.5)
    history: list[int] = []
    logprobs = []
    for step in range(num_steps):
        row = _row(seed=seed, index=step, output=history, prompt=[0, 1], logprobs=3, **target)
        others = [
            _row(seed=batch_seed + i, index=step, **OTHERS[(batch_seed + i) % len(OTHERS)])
            for i in range(num_others)
        ]
        position = (batch_seed + step) % (num_others + 1)
        rows = [*others[:position], row, *others[position:]]
        logits = _logits(num_others + 1, seed=batch_seed + step, vocab=vocab)
        logits[position] = table[history[-1] % 64 if history else 0]
        out = Sampler(native=native)(logits, rows)
        history = [*history, int(out.token_ids[position])]
        assert out.logprobs is not None
        logprobs.append(
            torch.cat(
                [
                    out.logprobs.token_logprobs[position : position + 1],
                    out.logprobs.top_logprobs[position, :3],
                    out.logprobs.top_token_ids[position, :3].float(),
                ]
            )
        )
    return history, logprobs


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("target", TARGETS.values(), ids=TARGETS.keys())
def test_a_seeded_row_draws_the_same_whatever_shares_its_batch(target: dict, native: bool) -> None:
    alone, alone_logprobs = _generate(42, target, 12, num_others=0, batch_seed=0, native=native)
    for num_others, batch_seed in ((3, 555), (10, 77)):
        crowded, crowded_logprobs = _generate(42, target, 12, num_others, batch_seed, native)
        assert crowded == alone
        for a, c in zip(alone_logprobs, crowded_logprobs, strict=True):
            assert torch.equal(a, c)
    other_seed, _ = _generate(43, target, 12, num_others=0, batch_seed=0, native=native)
    assert other_seed != alone  # the seed matters (12 draws from a spread distribution)


def test_top_p_prefix_and_full_sort_give_the_same_cutoff(monkeypatch) -> None:
    """A top_p row without top_k looks for its cut-off in a prefix and sorts only when the
    nucleus is wider; both ways must keep the same tokens."""
    vocab = 700
    logits = torch.cat([_logits(4, seed=16, vocab=vocab, scale=s) for s in (0.3, 1.0, 4.0)])
    rows = [
        _row(seed=r, index=r, temperature=1.0, top_p=p, min_p=m, logprobs=-1)
        for r, (p, m) in enumerate([(0.9, 0.0), (0.5, 0.0), (0.99, 0.02), (0.7, 0.1)] * 3)
    ]
    results = []
    for prefix in (4, 64, vocab + 1):  # mostly sorting, mixed, never sorting
        monkeypatch.setattr(sampler_module, "_TOP_P_PREFIX", prefix)
        out = Sampler("processed_logprobs")(logits, rows)
        assert out.logprobs is not None
        results.append((out.token_ids, out.logprobs.top_logprobs))
    for tokens, logprobs in results[1:]:
        assert torch.equal(tokens, results[0][0]) and torch.equal(logprobs, results[0][1])


@pytest.mark.parametrize(
    "params, native",
    [
        ({"temperature": 1.0, "top_p": 0.9, "frequency_penalty": 0.7}, False),
        ({"temperature": 1.0, "frequency_penalty": 0.7}, False),
        ({"temperature": 1.0, "frequency_penalty": 0.7}, True),
    ],
    ids=["top_p", "unfiltered", "unfiltered-native"],
)
def test_a_resumed_request_draws_the_same_tail(params: dict, native: bool) -> None:
    """Generate 20 tokens; then restart from the committed first k (as after a failure, on
    another rank with other batch-mates): the same seed and index give the same tail."""
    vocab = 300
    table = _logits(vocab, seed=11, vocab=vocab, scale=2.0)

    def continue_from(history: list[int], num_tokens: int, num_others: int) -> list[int]:
        history = list(history)
        while len(history) < num_tokens:
            row = _row(seed=7, index=len(history), output=history, **params)
            others = [_row(seed=i, index=i, temperature=1.0) for i in range(num_others)]
            logits = torch.cat(
                [
                    _logits(num_others, seed=len(history), vocab=vocab),
                    table[history[-1] if history else 0].unsqueeze(0),
                ]
            )
            history.append(int(Sampler(native=native)(logits, [*others, row]).token_ids[-1]))
        return history

    full = continue_from([], 20, num_others=0)
    for k in (1, 8, 19):
        assert continue_from(full[:k], 20, num_others=k % 5 + 1) == full


def test_uniforms_are_distinct_and_spread() -> None:
    draws = [draw_uniform(seed, index) for seed in (0, 1, 2**64 - 1) for index in range(4000)]
    assert len(set(draws)) == len(draws)
    assert all(0.0 < u < 1.0 for u in draws)
    # Kolmogorov-Smirnov against U(0, 1): critical value at 1e-4 for n = 12000 is ~0.018.
    ordered = sorted(draws)
    n = len(ordered)
    distance = max(max((i + 1) / n - u, u - i / n) for i, u in enumerate(ordered))
    assert distance < 0.018
    assert draw_uniform(5, 3) == draw_uniform(5, 3) != draw_uniform(6, 3)


# -- logprobs --------------------------------------------------------------------------------------
def test_raw_logprobs_are_the_models_before_penalties_and_filters() -> None:
    logits = _logits(4, seed=12)
    rows = [
        _row(seed=1, temperature=0.5, top_k=3, logprobs=4, logit_bias={0: 9.0}),
        _row(seed=2, temperature=1.0),  # asks for none
        _row(logprobs=0, repetition_penalty=2.0, prompt=[1, 2]),
        _row(seed=3, temperature=1.0, logprobs=-1),
    ]
    out = Sampler()(logits, rows)
    assert out.logprobs is not None
    reference = logits.double().log_softmax(-1)
    tokens = out.token_ids
    for b, count in ((0, 4), (2, 0), (3, VOCAB)):
        expected = reference[b]
        torch.testing.assert_close(out.logprobs.token_logprobs[b].double(), expected[tokens[b]])
        assert out.logprobs.token_ranks[b] == int((expected > expected[tokens[b]]).sum()) + 1
        ids = out.logprobs.top_token_ids[b, :count]
        assert ids.tolist() == expected.argsort(descending=True)[:count].tolist()
        torch.testing.assert_close(out.logprobs.top_logprobs[b, :count].double(), expected[ids])
        assert (out.logprobs.top_token_ids[b, count:] == -1).all()
    assert math.isnan(out.logprobs.token_logprobs[1]) and out.logprobs.token_ranks[1] == 0
    assert Sampler()(logits, [_row(temperature=1.0)] * 4).logprobs is None


def test_prompt_logprobs_match_a_reference_in_any_chunking(monkeypatch) -> None:
    logits = _logits(37, seed=13)
    token_ids = torch.randint(VOCAB, (37,), generator=torch.Generator().manual_seed(1))
    whole = prompt_logprobs(logits, token_ids, 5)
    reference = logits.double().log_softmax(-1)
    torch.testing.assert_close(
        whole.token_logprobs.double(), reference.gather(1, token_ids[:, None]).squeeze(1)
    )
    expected_ranks = (reference > reference.gather(1, token_ids[:, None])).sum(-1) + 1
    assert torch.equal(whole.token_ranks, expected_ranks)
    assert torch.equal(whole.top_token_ids, reference.topk(5).indices)
    monkeypatch.setattr(sampler_module, "_PROMPT_CHUNK_ELEMENTS", 4 * VOCAB)  # 4 rows a chunk
    chunked = prompt_logprobs(logits, token_ids, 5)
    for name in ("token_logprobs", "token_ranks", "top_token_ids", "top_logprobs"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name))
    assert prompt_logprobs(logits, token_ids, -1).top_token_ids.shape == (37, VOCAB)


# -- what a batch without filters costs ------------------------------------------------------------
def test_a_batch_without_filters_never_sorts(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("sorted a batch that has no filter")

    monkeypatch.setattr(torch.Tensor, "sort", refuse)
    monkeypatch.setattr(torch.Tensor, "topk", refuse)
    rows = [_row(seed=i, temperature=1.0, presence_penalty=0.3, output=[i]) for i in range(4)]
    Sampler()(_logits(5, seed=14), [*rows, _row()])


def test_top_k_rows_use_topk_and_never_sort(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("sorted for top_k")

    monkeypatch.setattr(torch.Tensor, "sort", refuse)
    rows = [_row(seed=i, temperature=1.0, top_k=5 + i, top_p=0.9) for i in range(4)]
    tokens = Sampler()(_logits(4, seed=15), rows).token_ids
    assert len(tokens) == 4


def test_bad_words_mask_like_transformers_no_bad_words_over_the_output() -> None:
    """vLLM's rule, which is transformers' NoBadWordsLogitsProcessor's over the output tokens
    alone: a sequence's last token is masked when the output ends with the rest of it."""
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor

    bad = [[7], [3, 9], [1, 2, 11], [4, 4]]
    outputs = [[5], [3], [5, 1, 2], [1, 2, 3], [4], [0, 4, 4]]
    logits = _logits(len(outputs), seed=21)
    rows = [_row(index=len(o), output=o, bad_words_token_ids=bad) for o in outputs]
    got = sampler_module._adjust(logits, rows)
    processor = NoBadWordsLogitsProcessor(bad, eos_token_id=None)
    for b, output in enumerate(outputs):
        expected = processor(torch.tensor([output]), logits[b : b + 1].clone())[0]
        assert torch.equal(got[b], expected), (b, output)
    masked = {b: set(torch.nonzero(got[b].isinf()).flatten().tolist()) for b in range(len(rows))}
    assert masked == {0: {7}, 1: {7, 9}, 2: {7, 11}, 3: {7, 9}, 4: {7, 4}, 5: {7, 4}}
    # Greedy rows then take the best token that is left.
    tokens = Sampler()(logits, rows).token_ids
    assert tokens.tolist() == got.argmax(-1).tolist()
    # The runner hands the outputs as int64 tensors: the same mask.
    as_tensors = [replace(row, output_token_ids=torch.tensor(o, dtype=torch.int64))
                  for row, o in zip(rows, outputs, strict=True)]  # fmt: skip
    assert torch.equal(sampler_module._adjust(logits, as_tensors), got)


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_allowed_token_ids_keep_only_those_logits_for_greedy_and_random_rows(native) -> None:
    allowed = [3, 17, 17, 40]
    logits = _logits(3, seed=22)
    rows = [_row(allowed_token_ids=allowed), _row(), _row(allowed_token_ids=[9])]
    got = sampler_module._adjust(logits, rows)
    expected = torch.full_like(logits, float("-inf"))
    expected[0, allowed] = logits[0, allowed]
    expected[1] = logits[1]
    expected[2, 9] = logits[2, 9]
    assert torch.equal(got, expected)
    tokens = Sampler(native=native)(logits, rows).token_ids.tolist()
    assert tokens == expected.argmax(-1).tolist()
    # Random rows draw only allowed tokens, in the softmax's proportions among them.
    num_draws = 4000
    draws = [
        _row(seed=5, index=i, temperature=1.0, allowed_token_ids=allowed) for i in range(num_draws)
    ]
    one = _logits(1, seed=23, scale=1.0)
    drawn = Sampler(native=native)(one.expand(num_draws, -1), draws).token_ids
    counts = torch.bincount(drawn, minlength=VOCAB)
    assert set(torch.nonzero(counts).flatten().tolist()) == {3, 17, 40}
    probs = torch.zeros(VOCAB)
    probs[[3, 17, 40]] = one[0, [3, 17, 40]].softmax(-1)
    statistic, degrees = _chi_square(counts, probs)
    assert statistic < _chi_square_bound(degrees), (statistic, degrees)


def test_token_filter_ids_outside_the_vocabulary_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=rf"row 0: allowed_token_ids \[{VOCAB}\] are outside"):
        Sampler()(_logits(1), [_row(allowed_token_ids=[1, VOCAB])])
    with pytest.raises(ValueError, match=rf"bad words' token ids \[{VOCAB + 2}\] are outside"):
        check_row(_row(bad_words_token_ids=[[1, VOCAB + 2]]), VOCAB)


# -- errors ----------------------------------------------------------------------------------------
def test_a_logit_bias_id_outside_the_vocabulary_names_row_and_id() -> None:
    rows = [_row(), _row(logit_bias={3: 1.0, VOCAB + 5: 2.0})]
    outside = rf"logit_bias token ids \[{VOCAB + 5}\] are outside the vocabulary \[0, 50\)"
    with pytest.raises(ValueError, match=rf"row 1: {outside}"):
        Sampler()(_logits(2), rows)
    with pytest.raises(ValueError, match=rf"^{outside}"):
        check_row(rows[1], VOCAB)  # what the runner asks of each row before the batch
    check_row(rows[1], VOCAB + 6)


def test_a_history_id_outside_the_vocabulary_is_refused_not_aliased() -> None:
    """row * V + id would land in the next row's logits; the row is refused by name instead."""
    rows = [_row(), _row(output=[3, VOCAB + 1], frequency_penalty=0.5), _row()]
    with pytest.raises(ValueError, match=rf"row 1: token ids \[{VOCAB + 1}\] in its history"):
        Sampler()(_logits(3), rows)


def test_min_tokens_masking_the_whole_vocabulary_is_refused() -> None:
    row = _row(min_tokens=2, stops=range(VOCAB + 3))
    with pytest.raises(ValueError, match="row 0: min_tokens=2 would mask every token"):
        Sampler()(_logits(1), [row])


def test_stop_ids_beyond_the_vocabulary_are_ignored_by_min_tokens() -> None:
    row = _row(min_tokens=2, stops=[2**40])
    assert Sampler()(_logits(1), [row]).token_ids.item() == _logits(1).argmax().item()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Sampler()(_logits(3), [_row(), _row()]), r"B = 2 rows, got \(3, 50\)"),
        (lambda: Sampler("processed_logits"), "logprobs_mode must be one of"),
        (lambda: _row(seed=-1), r"seed must be in \[0, 2\*\*64 - 1\], got -1"),
        (lambda: _row(index=-2), "index must be >= 0, got -2"),
        (lambda: prompt_logprobs(_logits(3), torch.zeros(4, dtype=torch.long), 1), "token_ids"),
    ],
)
def test_bad_calls_raise(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("vocab", [32000, 32003, 1000, 300])
@pytest.mark.parametrize("num_rows", [1, 8, 64])
def test_blocked_argmax_is_argmax_exactly(num_rows, vocab):
    """The CPU's blocked greedy pick returns `argmax`'s index for every row: the first of equal
    maxima (within a block, across blocks, in the tail), the first NaN, all -inf, exact zeros."""
    generator = torch.Generator().manual_seed(vocab * 100 + num_rows)
    logits = torch.randn(num_rows, vocab, generator=generator)
    # Rows with planted ties and specials (the rest random): equal maxima in two blocks, in one
    # block, one in the body and one in the tail; NaNs; a row of -inf; a row of zeros.
    top = logits.max().item() + 1.0
    special = [
        (0, [5, 400]), (1, [130, 131]), (2, [7, vocab - 1]), (3, [vocab - 2, vocab - 1])
    ]  # fmt: skip
    for row, columns in special:
        if row < num_rows:
            logits[row, [c % vocab for c in columns]] = top
    if num_rows > 4:
        logits[4, [9, vocab - 1]] = float("nan")
        logits[5, vocab - 1] = float("nan")  # a NaN in the tail only
        logits[6] = float("-inf")
        logits[7] = 0.0
    # Forced to the blocked path whatever the size; the plain one is the reference.
    original = sampler_module._ARGMAX_BLOCKED_MIN
    sampler_module._ARGMAX_BLOCKED_MIN = 0
    try:
        picked = sampler_module.argmax_rows(logits)
    finally:
        sampler_module._ARGMAX_BLOCKED_MIN = original
    assert picked.dtype == torch.int64
    assert torch.equal(picked, logits.argmax(-1))


@pytest.mark.parametrize("same_threshold", [True, False])
def test_zeroing_below_a_threshold_is_the_masked_fill_exactly(same_threshold):
    """The CPU's `F.threshold_` path keeps exactly what `masked_fill_(probs < t, 0)` keeps: an
    entry equal to its row's threshold, the float just above and below it, subnormals, zeros
    and NaN; one threshold for the batch, or one per row."""
    tiny = torch.finfo(torch.float32).tiny
    generator = torch.Generator().manual_seed(7)
    probs = torch.rand(6, 512, generator=generator).pow(8)
    if same_threshold:
        threshold = torch.full((6,), tiny)
    else:
        threshold = torch.tensor([tiny, 1e-3, 0.25, 0.5, 0.01, 0.9])
    for row in range(6):
        t = threshold[row]
        probs[row, :6] = torch.stack(
            [
                t,
                torch.nextafter(t, torch.tensor(1.0)),
                torch.nextafter(t, torch.tensor(0.0)),
                torch.tensor(tiny / 4),
                torch.tensor(0.0),
                torch.tensor(float("nan")),
            ]
        )
    expected = probs.clone().masked_fill_(probs < threshold.unsqueeze(1), 0.0)
    got = sampler_module._zero_below(probs, threshold)
    assert got.data_ptr() == probs.data_ptr()
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(-1.0), expected.nan_to_num(-1.0))
    assert (got[:, 0] == threshold).all() and (got[:, 2] == 0).all()


def test_the_cpus_integer_sort_gives_the_float_sorts_values_exactly():
    """`_sorted_descending` sorts non-negative float32 rows as int32 on the CPU: the same values,
    in the same order, as the float sort, with ties, zeros, subnormals and the largest floats;
    a row holding a NaN of either sign falls back to the float sort and matches it too."""
    tiny = torch.finfo(torch.float32).tiny
    generator = torch.Generator().manual_seed(11)
    probs = torch.rand(5, 700, generator=generator).pow(6)
    probs[:, :4] = torch.tensor([0.0, tiny / 8, tiny, torch.finfo(torch.float32).max])
    probs[:, 4:40] = probs[:, 40:76]  # ties
    probs[1, 9] = float("nan")
    probs[2, 17] = -float("nan")
    probs[2, 3] = float("inf")
    got = sampler_module._sorted_descending(probs)
    expected = probs.sort(dim=-1, descending=True).values
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(-1.0), expected.nan_to_num(-1.0))
    assert torch.equal(got[[0, 3, 4]], expected[[0, 3, 4]])


def test_the_native_draw_is_pytorchs_but_at_a_tokens_edge_and_leaves_odd_rows_to_it():
    """`sampler_backend: native` draws the same inverse CDF over the same blocks, from
    unnormalised weights by the kernels' exp: on 4000 draws over three vocabularies (one
    block, several, not a whole number of them) and two temperatures it picks PyTorch's
    token but where the uniform lands within rounding of an edge (at most 2 in 1000 here).
    Rows it cannot take (a NaN; everything but one token masked is fine) are PyTorch's."""
    from dist_engine.kernels.compute import sample_rows

    assert sample_rows() is not None, "the CPU kernels failed to build (see the warning)"
    for vocab, temperature in ((200, 1.0), (3 * 256 + 17, 0.7), (4096, 1.3)):
        logits = _logits(40, seed=vocab, vocab=vocab, scale=2.0).repeat(100, 1)
        rows = [_row(seed=3, index=i, temperature=temperature) for i in range(4000)]
        native = Sampler(native=True)(logits, rows).token_ids
        reference = Sampler()(logits, rows).token_ids
        assert (native != reference).sum() <= 8, (vocab, temperature)
    logits = _logits(4, seed=1, vocab=VOCAB)
    logits[1] = float("-inf")
    logits[1, 17] = 0.0  # one token left
    logits[2, 5] = float("nan")
    rows = [_row(seed=5, index=i, temperature=1.0) for i in range(4)]
    native = Sampler(native=True)(logits, rows).token_ids
    reference = Sampler()(logits, rows).token_ids
    assert int(native[1]) == 17
    assert int(native[2]) == int(reference[2])  # the NaN row went PyTorch's way
    kernel = sample_rows()
    raw = kernel(logits, torch.ones(4), torch.full((4,), 0.5, dtype=torch.float64), 256)
    assert int(raw[2]) == -1 and int(raw[1]) == 17


def test_a_row_takes_the_native_draw_by_its_own_settings_not_its_batch(monkeypatch):
    """An unfiltered row goes to the kernel whether or not filtered rows share its batch (so
    its token never depends on them, even at a token's edge); the filtered rows do not."""
    from dist_engine.kernels import compute

    kernel = compute.sample_rows()
    seen: list[int] = []

    def spy(logits, temperatures, uniforms, block):
        seen.append(logits.shape[0])
        return kernel(logits, temperatures, uniforms, block)

    monkeypatch.setattr(compute, "sample_rows", lambda: spy)
    logits = _logits(3, seed=4)
    unfiltered = _row(seed=8, index=2, temperature=0.9)
    alone = Sampler(native=True)(logits[:1], [unfiltered]).token_ids
    mixed_rows = [unfiltered, _row(seed=9, index=2, top_p=0.5), _row(seed=1, index=2, top_k=4)]
    mixed = Sampler(native=True)(logits, mixed_rows).token_ids
    assert seen == [1, 1] and int(mixed[0]) == int(alone[0])
    reference = Sampler()(logits, mixed_rows).token_ids
    assert torch.equal(mixed[1:], reference[1:])  # the filtered rows drawn PyTorch's way
