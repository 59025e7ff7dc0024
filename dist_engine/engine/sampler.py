"""Token sampling: batched tensor ops over a step's rows, with counter-based randomness.

Shape legend: B = rows (one per sequence that needs a token), V = vocab, R = rows that sample at
random, W = V rounded up to whole blocks, G = rows of one filter group, L = a sorted prefix's
length, A = rows that asked for logprobs, T = positions, K = top logprobs per position.

Order (vLLM's): allowed_token_ids, bad words, logit_bias and min_tokens masking, then the
repetition, frequency and presence penalties; greedy rows take the argmax of that. Random rows
divide by their temperature, take the softmax, keep what min_p, top_k and top_p leave (in that
order, each on what the one before kept) and draw one token by inverse CDF. Ties at a cut-off
are all kept.

Reproducibility: a row's only randomness is one uniform number, a pure function of (its seed, the
index of the output token being drawn): the seed's SplitMix64 stream read at that index. Every
float a decision rests on comes from a row-wise kernel (softmax, log_softmax), is an exact copy
(topk and sort values), or is a prefix sum or a fixed block's sum of the row's own values; never
a reduction whose order depends on the batch. So a seeded row draws the same token whatever
shares its batch, on whichever rank and step it runs, and again after a resumption that recomputes
its prompt and committed output (same seed, same index, same logits). tests/engine/test_sampler.py
checks this bit for bit on CPU.

Logprobs follow vLLM's ``logprobs_mode``: ``raw_logprobs`` (vLLM's default) are the log-softmax of
the model's logits before any penalty, bias, temperature or filter; ``processed_logprobs`` are
those of the distribution the token was drawn from.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import chain
from typing import Literal

import torch
import torch.nn.functional as F

from scheduler.sampling_params import MAX_SEED, SamplingParams

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")

# An inverse-CDF draw first picks a block of this many vocabulary entries, then a token in it, so
# its prefix sums run over [R, W / BLOCK] and [R, BLOCK] instead of [R, V].
_BLOCK = 256
# A top_p row without top_k first looks for its cut-off among this many most likely tokens; only
# a row whose nucleus is wider sorts its whole vocabulary.
_TOP_P_PREFIX = 1024
# Prompt logprobs are computed over at most this many logits at a time ([T, V] can be gigabytes).
_PROMPT_CHUNK_ELEMENTS = 1 << 24
_TINY = torch.finfo(torch.float32).tiny
# Greedy rows on the CPU: `argmax` over [B, V] runs a scalar loop there, ~5x slower than the
# vectorized `amax` over blocks of this many entries followed by two small argmaxes (0.9 against
# 0.15 ms at [64, 32000], 4.5 against 0.9 ms at [64, 151936] with two threads on an AMD EPYC).
# Below _ARGMAX_BLOCKED_MIN elements the plain argmax is as fast.
_ARGMAX_BLOCK = 128
_ARGMAX_BLOCKED_MIN = 1 << 17

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


@dataclass(slots=True)  # not frozen: one is built per row per step, and a frozen
class SamplingRow:  # dataclass's __init__ costs twice as much (143 vs 80 us at 256 rows)
    """One row of a step's sample: a request's settings and where it stands.

    params: the request's settings. seed: its resolved seed (its own, or one drawn once when the
    request was created). index: how many output tokens it already has, i.e. the index of the one
    being drawn. prompt_token_ids, output_token_ids: what the penalties count (and the bad words
    match); needed only when ``params.reads_output`` (the prompt's only for
    ``repetition_penalty != 1``); lists, or 1-D int64 tensors (the runner's).
    stop_token_ids: masked while ``index < params.min_tokens`` (the stop ids and the EOS ids).
    """

    params: SamplingParams
    seed: int
    index: int
    prompt_token_ids: Sequence[int] | torch.Tensor = ()
    output_token_ids: Sequence[int] | torch.Tensor = ()
    stop_token_ids: AbstractSet[int] = frozenset()

    def __post_init__(self) -> None:
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64 - 1], got {self.seed}")
        if self.index < 0:
            raise ValueError(f"index must be >= 0, got {self.index}")


@dataclass(frozen=True)
class Logprobs:
    """Log-probabilities of one scored token per position and of the most likely tokens.

    token_logprobs: [N] float32 (NaN for a row that asked for none); token_ranks: [N] int64, 1 for
    the most likely token (0 for a row that asked for none); top_token_ids: [N, K] int64, most
    likely first (a row that asked for n < K has its n in front, -1 after); top_logprobs: [N, K]
    float32 (NaN where the id is -1).
    """

    token_logprobs: torch.Tensor
    token_ranks: torch.Tensor
    top_token_ids: torch.Tensor
    top_logprobs: torch.Tensor


@dataclass(frozen=True)
class SampleOutput:
    """token_ids: [B] int64; logprobs: per row whose params ask for them, None if none asks."""

    token_ids: torch.Tensor
    logprobs: Logprobs | None


def draw_uniform(seed: int, index: int) -> float:
    """The one uniform number in (0, 1) a row of `seed` uses to draw output token `index`.

    Output `index` of SplitMix64 seeded with a mix of `seed`: distinct indices of one seed give
    distinct 64-bit values, and the top 53 bits become the float.
    """
    state = (_mix64(seed) + (index + 1) * _GOLDEN_GAMMA) & _MASK64
    return ((_mix64(state) >> 11) + 0.5) * 2.0**-53


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: a bijection on 64-bit ints in which every bit moves every bit."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class Sampler:
    """Turns logits into one token per row (and logprobs where asked); stateless.
    `native`: draw the unfiltered random rows with the compiled kernel where it applies
    (`sampler_backend: native`; `_native_draw`)."""

    def __init__(self, logprobs_mode: LogprobsMode = "raw_logprobs", native: bool = False) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}"
            )
        self.logprobs_mode = logprobs_mode
        self.native = native

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], *, checked: bool = False
    ) -> SampleOutput:
        return self.sample(logits, rows, checked=checked)

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], *, checked: bool = False
    ) -> SampleOutput:
        """logits: [B, V] float, rows: B rows → tokens [B] int64 (+ logprobs where asked).

        Raises ValueError naming the row for a row the vocabulary refuses (a logit_bias id beyond
        it, min_tokens masking all of it); the caller retries row by row to end only that one.
        ``checked``: the caller has passed every row through `check_row` against this vocabulary
        already (the runner does, to end a refused request alone), so it is not done again.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [B, V] with B = {len(rows)} rows, got {tuple(logits.shape)}"
            )
        vocab = logits.shape[1]
        for b, row in enumerate(() if checked else rows):
            try:
                check_row(row, vocab)
            except ValueError as error:
                raise ValueError(f"row {b}: {error}") from None
        if not rows:
            return SampleOutput(torch.empty(0, dtype=torch.int64, device=logits.device), None)
        logits = logits.float()
        asking = [b for b, row in enumerate(rows) if row.params.logprobs is not None]
        raw_mode = self.logprobs_mode == "raw_logprobs"
        scored = logits[asking].log_softmax(-1) if asking and raw_mode else None
        logits = _adjust(logits, rows)
        greedy: list[int] = []
        random: list[int] = []
        for b, row in enumerate(rows):
            (greedy if row.params.greedy else random).append(b)
        tokens = (
            argmax_rows(logits)
            if greedy
            else torch.empty(len(rows), dtype=torch.int64, device=logits.device)
        )
        if asking and not raw_mode:
            scored = torch.empty(len(asking), vocab, device=logits.device)
            _write_rows(scored, asking, greedy, logits.log_softmax(-1) if greedy else None)
        if random:
            subset = logits if len(random) == len(rows) else logits[random]
            params = [rows[b].params for b in random]
            uniforms = [draw_uniform(rows[b].seed, rows[b].index) for b in random]
            # Which way a row is drawn depends on its own settings only (never on its batch):
            # the kernel takes the unfiltered ones, PyTorch's path the rest.
            by_kernel = []
            if self.native and not (asking and not raw_mode):
                by_kernel = [r for r, p in enumerate(params) if _unfiltered(p, vocab)]
            drawn = _native_draw(subset, params, uniforms, by_kernel) if by_kernel else None
            if drawn is not None:
                tokens[_long([random[r] for r in by_kernel], tokens.device)] = drawn
                taken = set(by_kernel)
                others = [r for r in range(len(random)) if r not in taken]
            else:
                others = list(range(len(random)))
            if others:
                if len(others) != len(random):
                    subset = subset[_long(others, subset.device)]
                scaled, kept = _filtered_probs(subset, [params[r] for r in others])
                chosen = _draw(
                    kept, torch.tensor([uniforms[r] for r in others], dtype=torch.float64)
                )
                tokens[_long([random[r] for r in others], tokens.device)] = chosen
            if asking and not raw_mode:
                drawn = scaled.masked_fill(kept == 0, float("-inf")).log_softmax(-1)
                _write_rows(scored, asking, random, drawn[:, :vocab])
        if not asking:
            return SampleOutput(tokens, None)
        assert scored is not None
        counts = [_num_top(rows[b].params.logprobs, vocab) for b in asking]
        return SampleOutput(tokens, _spread(_score(scored, tokens[asking], counts), asking, rows))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] → [B] int64: `logits.argmax(-1)` exactly (the first maximum; the first NaN
    where a row has one), computed on the CPU as the maximum of each block of _ARGMAX_BLOCK
    entries, the first block holding the row's maximum, and the first maximum inside it (the
    last V % _ARGMAX_BLOCK entries compared apart). Other devices take `argmax` itself."""
    num_rows, vocab = logits.shape
    blocks = vocab // _ARGMAX_BLOCK
    if logits.device.type != "cpu" or num_rows * vocab < _ARGMAX_BLOCKED_MIN or blocks == 0:
        return logits.argmax(-1)
    body = logits[:, : blocks * _ARGMAX_BLOCK].unflatten(1, (blocks, _ARGMAX_BLOCK))
    maxima = body.amax(-1)  # [B, blocks]; NaN where a block holds one
    block = maxima.argmax(-1)  # the first block with the row's maximum (or its first NaN)
    rows = torch.arange(num_rows, device=logits.device)
    tokens = block * _ARGMAX_BLOCK + body[rows, block].argmax(-1)
    if blocks * _ARGMAX_BLOCK < vocab:
        tail_value, tail_index = logits[:, blocks * _ARGMAX_BLOCK :].max(-1)
        best = maxima[rows, block]
        # The tail wins only when strictly greater, or NaN where the body has none.
        later = (tail_value > best) | (tail_value.isnan() & ~best.isnan())
        tokens = torch.where(later, tail_index + blocks * _ARGMAX_BLOCK, tokens)
    return tokens


def _write_rows(
    out: torch.Tensor, asking: list[int], rows: list[int], values: torch.Tensor | None
) -> None:
    """out[a] = values[i] wherever asking[a] == rows[i]. out: [A, V], values: [len(rows), V]."""
    position = {b: a for a, b in enumerate(asking)}
    pairs = [(position[b], i) for i, b in enumerate(rows) if b in position]
    if pairs and values is not None:
        device = out.device
        out[_long([a for a, _ in pairs], device)] = values[_long([i for _, i in pairs], device)]


def prompt_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> Logprobs:
    """Raw log-probabilities of given tokens and the `num_top` most likely at each position.

    logits: [T, V], position t predicting token_ids[t] (for a prompt: the logits of positions
    0..T-1 and the prompt's tokens 1..T); token_ids: [T] int64; num_top: >= 0, or -1 for all V.
    What ``echo`` with ``logprobs`` and vLLM's ``prompt_logprobs`` return.
    """
    if logits.dim() != 2 or token_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"need logits [T, V] and token_ids [T], got {tuple(logits.shape)} and "
            f"{tuple(token_ids.shape)}"
        )
    positions, vocab = logits.shape
    count = _num_top(num_top, vocab)
    step = max(1, _PROMPT_CHUNK_ELEMENTS // max(vocab, 1))
    parts = [
        _score(
            logits[start : start + step].float().log_softmax(-1),
            token_ids[start : start + step],
            [count] * min(step, positions - start),
        )
        for start in range(0, positions, step)
    ]
    if not parts:
        return _score(logits.float(), token_ids, [])
    return Logprobs(
        torch.cat([p.token_logprobs for p in parts]),
        torch.cat([p.token_ranks for p in parts]),
        torch.cat([p.top_token_ids for p in parts]),
        torch.cat([p.top_logprobs for p in parts]),
    )


# -- validation --------------------------------------------------------------------------------
def check_row(row: SamplingRow, vocab_size: int) -> None:
    """Refuse what only the vocabulary can rule out: a logit_bias id beyond it, or min_tokens
    masking all of it. SamplingParams has checked everything else."""
    params = row.params
    if not params.adjusts_logits and row.index >= params.min_tokens:
        return  # nothing the vocabulary could refuse (every row of every step comes here)
    if params.allowed_token_ids is not None and max(params.allowed_token_ids) >= vocab_size:
        outside = sorted({t for t in params.allowed_token_ids if t >= vocab_size})
        raise ValueError(
            f"allowed_token_ids {outside[:8]} are outside the vocabulary [0, {vocab_size})"
        )
    outside = sorted({t for ids in params.bad_words_token_ids for t in ids if t >= vocab_size})
    if outside:
        raise ValueError(
            f"bad words' token ids {outside[:8]} are outside the vocabulary [0, {vocab_size})"
        )
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        outside = sorted(t for t in params.logit_bias if t >= vocab_size)
        raise ValueError(
            f"logit_bias token ids {outside[:8]} are outside the vocabulary [0, {vocab_size})"
        )
    masking = row.index < params.min_tokens and len(row.stop_token_ids) >= vocab_size
    if masking and sum(1 for t in row.stop_token_ids if t < vocab_size) == vocab_size:
        raise ValueError(
            f"min_tokens={params.min_tokens} would mask every token of the vocabulary of "
            f"{vocab_size} (its stop ids cover it)"
        )


def _num_top(count: int | None, vocab: int) -> int:
    assert count is not None
    return vocab if count == -1 else min(count, vocab)


# -- logit adjustments (greedy and random rows alike) -------------------------------------------
def _adjust(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """allowed_token_ids, bad words, logit_bias, min_tokens masking and penalties.
    logits: [B, V] → [B, V] (a copy if any)."""
    vocab = logits.shape[1]
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    masked_rows: list[int] = []
    masked_ids: list[int] = []
    allowing: list[int] = []
    penalised: list[int] = []
    for b, row in enumerate(rows):
        params = row.params
        if not params.adjusts_logits and row.index >= params.min_tokens:
            continue  # most rows: one check (this loop runs for every row of every step)
        if params.allowed_token_ids is not None:
            allowing.append(b)
        if params.uses_penalties:
            penalised.append(b)
        for ids in params.bad_words_token_ids:
            *before, last = ids
            if not before or _ends_with(row.output_token_ids, before):
                masked_rows.append(b)
                masked_ids.append(last)
        if params.logit_bias:
            bias_rows += [b] * len(params.logit_bias)
            bias_ids += params.logit_bias.keys()
            bias_values += params.logit_bias.values()
        if row.index < params.min_tokens:
            ids = [t for t in row.stop_token_ids if t < vocab]
            masked_rows += [b] * len(ids)
            masked_ids += ids
    if not (allowing or bias_ids or masked_ids or penalised):
        return logits
    logits = logits.clone()  # edited in place below; the caller's logits stay untouched
    device = logits.device
    if allowing:
        keep = torch.zeros(len(allowing), vocab, dtype=torch.bool, device=device)
        pairs = [(i, t) for i, b in enumerate(allowing) for t in rows[b].params.allowed_token_ids]
        keep[_long([i for i, _ in pairs], device), _long([t for _, t in pairs], device)] = True
        index = _long(allowing, device)
        logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    if bias_ids:
        where = (_long(bias_rows, device), _long(bias_ids, device))
        logits.index_put_(where, torch.tensor(bias_values, device=device), accumulate=True)
    if masked_ids:
        where = (_long(masked_rows, device), _long(masked_ids, device))
        logits.index_put_(where, torch.tensor(float("-inf"), device=device))
    if penalised:
        _penalise(logits, rows, penalised)
    return logits


def _ends_with(tokens: Sequence[int] | torch.Tensor, tail: list[int]) -> bool:
    if len(tokens) < len(tail):
        return False
    end = tokens[len(tokens) - len(tail) :]
    return (end.tolist() if isinstance(end, torch.Tensor) else list(end)) == tail


def _penalise(logits: torch.Tensor, rows: Sequence[SamplingRow], penalised: list[int]) -> None:
    """vLLM's repetition, then frequency and presence penalties, in place. logits: [B, V].

    Only the logits of tokens a row has seen change, so the step's (row, token) pairs are
    counted once (torch.unique over row * V + token) and just those logits are gathered,
    penalised and written back: the cost follows the histories, not the vocabulary.
    """
    vocab = logits.shape[1]
    device = logits.device
    flat = logits.view(-1)
    output_keys, output_counts = _keys(
        penalised, [rows[b].output_token_ids for b in penalised], vocab, device
    ).unique(return_counts=True)
    repeating = [b for b in penalised if rows[b].params.repetition_penalty != 1.0]
    if repeating:
        prompt_keys = _keys(repeating, [rows[b].prompt_token_ids for b in repeating], vocab, device)
        keys = torch.cat([prompt_keys, output_keys]).unique()  # a row at 1.0 keeps its values
        penalty = _per_row(rows, "repetition_penalty", device)[keys // vocab]
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / penalty, values * penalty)
    owners = output_keys // vocab
    frequency = _per_row(rows, "frequency_penalty", device)[owners]
    presence = _per_row(rows, "presence_penalty", device)[owners]
    flat[output_keys] = flat[output_keys] - frequency * output_counts - presence


def _keys(
    batch_rows: list[int],
    ids_per_row: Sequence[Sequence[int] | torch.Tensor],
    vocab: int,
    device: torch.device,
) -> torch.Tensor:
    """row * vocab + token for every token of ids_per_row[i], row = batch_rows[i]. → [N] int64.

    An id outside the vocabulary would land in another row's logits: it is refused instead.
    A row's ids may be a list or a 1-D int64 tensor (the runner's, grown a step at a time).
    """
    if ids_per_row and all(isinstance(row_ids, torch.Tensor) for row_ids in ids_per_row):
        flat = torch.cat(list(ids_per_row))
        low, high = torch.aminmax(flat) if flat.numel() else (0, 0)
        if int(low) < 0 or int(high) >= vocab:
            ids_per_row = [row_ids.tolist() for row_ids in ids_per_row]  # to name the row
        else:
            lengths = _long([row_ids.numel() for row_ids in ids_per_row], device)
            owners = _long(batch_rows, device).repeat_interleave(lengths)
            return owners * vocab + flat.to(device)
    ids_per_row = [
        row_ids.tolist() if isinstance(row_ids, torch.Tensor) else row_ids
        for row_ids in ids_per_row
    ]
    ids = list(chain.from_iterable(ids_per_row))
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        row, bad = next(
            (b, [t for t in row_ids if not 0 <= t < vocab])
            for b, row_ids in zip(batch_rows, ids_per_row, strict=True)
            if any(not 0 <= t < vocab for t in row_ids)
        )
        raise ValueError(
            f"row {row}: token ids {bad[:8]} in its history are outside the vocabulary [0, {vocab})"
        )
    lengths = _long([len(row_ids) for row_ids in ids_per_row], device)
    owners = _long(batch_rows, device).repeat_interleave(lengths)
    return owners * vocab + _long(ids, device)


def _per_row(rows: Sequence[SamplingRow], name: str, device: torch.device) -> torch.Tensor:
    """One float setting of every row's params. → [B]."""
    return torch.tensor([getattr(row.params, name) for row in rows], device=device)


# -- random rows --------------------------------------------------------------------------------
def _filtered_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, softmax, then min_p, top_k and top_p. logits: [R, V] → (scaled logits [R, W],
    kept probabilities [R, W]: the softmax where the filters keep a token, 0 elsewhere and in the
    padding up to whole blocks)."""
    num_rows, vocab = logits.shape
    device = logits.device
    temperatures = [p.temperature for p in params]
    if all(t == 1.0 for t in temperatures):  # vLLM's default; dividing by 1 changes nothing
        scaled = logits
    else:
        scaled = logits / torch.tensor(temperatures, device=device).unsqueeze(1)
    if vocab % _BLOCK:
        scaled = F.pad(scaled, (0, _BLOCK - vocab % _BLOCK), value=float("-inf"))
    probs = scaled.softmax(-1)
    # Nothing below the smallest normal float is kept: a token needs a positive weight.
    floor = torch.full((num_rows,), _TINY, device=device)
    min_p_rows = [r for r, p in enumerate(params) if p.min_p > 0]
    if min_p_rows:
        index = _long(min_p_rows, device)
        min_p = torch.tensor([params[r].min_p for r in min_p_rows], device=device)
        floor[index] = (min_p * _take(probs, min_p_rows).amax(-1)).clamp_min(_TINY)
    threshold = floor.clone()
    top_k_rows = [r for r, p in enumerate(params) if 0 < p.top_k < vocab]
    top_p_rows = [r for r, p in enumerate(params) if p.top_p < 1.0 and not 0 < p.top_k < vocab]
    if top_k_rows:
        threshold[_long(top_k_rows, device)] = _top_k_cutoffs(probs, floor, params, top_k_rows)
    if top_p_rows:
        threshold[_long(top_p_rows, device)] = _top_p_cutoffs(probs, floor, params, top_p_rows)
    return scaled, _zero_below(probs, threshold)


def _zero_below(probs: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """probs: [R, W], threshold: [R] positive → probs, in place, with 0 where an entry is below
    its row's threshold (NaN stays).

    On the CPU a broadcast comparison and `masked_fill_` take ~3 ms at [64, 32000] (two
    threads, AMD EPYC), `F.threshold_` (x if x > t else 0) 0.14 ms: x >= t is x > the float32
    just below t. One call when every row has the same threshold (no filter: the floor), else
    one per row.
    """
    if probs.device.type != "cpu":
        return probs.masked_fill_(probs < threshold.unsqueeze(1), 0.0)
    below = torch.nextafter(threshold, torch.zeros_like(threshold)).tolist()
    if all(value == below[0] for value in below):
        return F.threshold_(probs, below[0], 0.0)
    for row, value in enumerate(below):
        F.threshold_(probs[row], value, 0.0)
    return probs


def _top_k_cutoffs(
    probs: torch.Tensor, floor: torch.Tensor, params: Sequence[SamplingParams], rows: list[int]
) -> torch.Tensor:
    """Cut-offs of rows with top_k (and maybe top_p). probs: [R, W] → [G].

    The group's largest k bounds the prefix; a row reads only its own first k values, exact
    copies, so the group's size and make-up cannot change its result.
    """
    device = probs.device
    top_k = [params[r].top_k for r in rows]
    values = _take(probs, rows).topk(max(top_k), dim=-1).values
    cut, _ = _cutoff(
        values, _long(top_k, device), _take(floor, rows), _top_p(params, rows, device), total=None
    )
    return cut


def _top_p_cutoffs(
    probs: torch.Tensor, floor: torch.Tensor, params: Sequence[SamplingParams], rows: list[int]
) -> torch.Tensor:
    """Cut-offs of rows with top_p and no top_k. probs: [R, W] → [G].

    The nucleus is measured against the row's whole min_p-kept mass (summed by blocks, the same
    way whatever the batch). A row looks for it among its _TOP_P_PREFIX most likely tokens and
    sorts everything only when it is wider, or surely wider (that many tokens, none above the
    row's largest probability, cannot reach it). Both give the same cut-off: the same prefix.
    """
    device = probs.device
    group = _take(probs, rows)
    group_floor = _take(floor, rows)
    width = group.shape[1]
    top_p = _top_p(params, rows, device)
    total = _block_mass(group.masked_fill(group < group_floor.unsqueeze(1), 0.0)).sum(-1)
    unbounded = torch.full((len(rows),), width, dtype=torch.int64, device=device)
    cut = torch.empty(len(rows), device=device)
    length = min(_TOP_P_PREFIX, width)
    # Host syncs, for these rows only: which try the prefix, and which of those must sort.
    may_fit = length * group.amax(-1).double() >= top_p * total
    prefix = may_fit.nonzero().flatten().tolist() if length < width else list(range(len(rows)))
    to_sort = sorted(set(range(len(rows))) - set(prefix))
    if prefix:
        values = _take(group, prefix).topk(length, dim=-1).values
        index = _long(prefix, device)
        cut[index], num_kept = _cutoff(
            values, unbounded[index], group_floor[index], top_p[index], total[index]
        )
        if length < width:
            wider = [prefix[i] for i in (num_kept == length).nonzero().flatten().tolist()]
            to_sort = sorted(to_sort + wider)
    if to_sort:
        values = _sorted_descending(_take(group, to_sort))
        index = _long(to_sort, device)
        cut[index], _ = _cutoff(
            values, unbounded[index], group_floor[index], top_p[index], total[index]
        )
    return cut


def _sorted_descending(probs: torch.Tensor) -> torch.Tensor:
    """probs: [G, W] float32, each entry >= 0 or NaN → each row's values sorted, largest first.

    On the CPU the rows are sorted as int32: a non-negative float's bits order as its value, and
    the integer sort takes about half the float sort's time ([64, 32768]: 52 against 99 ms, two
    threads, AMD EPYC). The values are the float sort's exactly. A row holding a NaN (whose sign
    bit x86 may set) is sorted as floats.
    """
    if probs.device.type != "cpu" or probs.dtype != torch.float32:
        return probs.sort(dim=-1, descending=True).values
    values = probs.view(torch.int32).sort(dim=-1, descending=True).values.view(torch.float32)
    has_nan = probs.isnan().any(-1)
    if bool(has_nan.any()):
        rows = has_nan.nonzero().flatten()
        values[rows] = probs[rows].sort(dim=-1, descending=True).values
    return values


def _top_p(params: Sequence[SamplingParams], rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([params[r].top_p for r in rows], dtype=torch.float64, device=device)


def _cutoff(
    values: torch.Tensor,
    top_k: torch.Tensor,
    floor: torch.Tensor,
    top_p: torch.Tensor,
    total: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest kept probability of each row, and how many of `values` are kept.

    values: [G, L] probabilities, descending; top_k: [G] (L or more: no limit); floor: [G]
    (min_p's threshold); top_p: [G] float64; total: [G] float64, the mass top_p is measured
    against, or None for the mass that top_k and min_p keep inside the prefix. A token is kept
    while the mass of the kept tokens before it is below top_p of that (the first always is).
    """
    ranks = torch.arange(values.shape[1], device=values.device)
    inside = (ranks < top_k.unsqueeze(1)) & (values >= floor.unsqueeze(1))
    num_inside = inside.sum(-1)  # top_k and min_p keep a prefix: its length
    # Prefix sums in float32, as vLLM's top_p; the draw itself sums in float64.
    cumulative = torch.where(inside, values, 0.0).cumsum(-1)
    if total is None:
        total = cumulative[:, -1]
    # Token j is kept while cumulative[j - 1] < top_p * total: 1 + how many prefix sums are.
    # (Counted, not binary-searched: a parallel scan need not be exactly monotone.)
    num_nucleus = (cumulative < (top_p * total).unsqueeze(1)).sum(-1) + 1
    num_kept = torch.where(top_p >= 1.0, num_inside, torch.minimum(num_nucleus, num_inside))
    return values.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1), num_kept


def _unfiltered(params: SamplingParams, vocab: int) -> bool:
    """Whether a random row keeps its whole softmax (no min_p, top_k or top_p cut)."""
    return params.min_p <= 0 and not 0 < params.top_k < vocab and params.top_p >= 1.0


def _native_draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    uniforms: list[float],
    rows: list[int],
) -> torch.Tensor | None:
    """The draw of `_filtered_probs` + `_draw` for `rows` (unfiltered ones) in one pass per
    row, by the compiled kernel (`kernels.compute.sample_rows`), on float32 logits on the CPU:
    [len(rows)] int64, or None where it does not apply (or the kernels are not built). The
    same inverse CDF over the same blocks; the weights are exp(s - max) unnormalised, by the
    kernels' exp, so a draw can differ from PyTorch's path only where the uniform falls within
    rounding of a token's edge. A row the kernel leaves (-1: a NaN, or no finite logit) is
    drawn PyTorch's way."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return None
    from dist_engine.kernels.compute import sample_rows

    kernel = sample_rows()
    if kernel is None:
        return None
    if len(rows) != logits.shape[0]:
        logits = logits[_long(rows, logits.device)]
    elif logits.stride(-1) != 1:
        logits = logits.contiguous()
    temperatures = torch.tensor([params[r].temperature for r in rows], dtype=torch.float32)
    drawn = torch.tensor([uniforms[r] for r in rows], dtype=torch.float64)
    tokens = kernel(logits, temperatures, drawn, _BLOCK)
    left = (tokens < 0).nonzero().flatten().tolist()
    if left:
        index = _long(left, logits.device)
        _, kept = _filtered_probs(logits[index], [params[rows[r]] for r in left])
        tokens[index] = _draw(kept, drawn[index])
    return tokens


def _draw(kept: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: one token per row with probability proportional to its kept weight.

    kept: [R, W] non-negative weights (W a multiple of _BLOCK), uniforms: [R] float64 in (0, 1)
    → token ids [R] int64. A block is chosen by the block masses' prefix sums, then a token by
    the prefix sums inside that block.
    """
    num_rows, width = kept.shape
    uniforms = uniforms.to(kept.device)
    blocks = kept.view(num_rows, width // _BLOCK, _BLOCK)
    mass = _block_mass(kept)
    cumulative, reachable = _prefix_sums(mass)
    target = (uniforms * reachable[:, -1]).unsqueeze(1)
    block = torch.searchsorted(reachable, target).clamp_(max=mass.shape[1] - 1)
    before = torch.where(block > 0, cumulative.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside = blocks.gather(1, block.unsqueeze(2).expand(-1, -1, _BLOCK)).squeeze(1).double()
    _, reachable_inside = _prefix_sums(inside)
    # The block's float32 mass and its float64 prefix sum differ in the last bits: stay inside.
    residual = torch.minimum(target - before, reachable_inside[:, -1:])
    offset = torch.searchsorted(reachable_inside, residual).clamp_(max=_BLOCK - 1)
    return (block * _BLOCK + offset).squeeze(1)


def _block_mass(weights: torch.Tensor) -> torch.Tensor:
    """weights: [G, W] → [G, W / _BLOCK] float64 sums of each block (reduced per block, so a row's
    sums never depend on the other rows)."""
    return weights.view(weights.shape[0], -1, _BLOCK).sum(-1).double()


def _prefix_sums(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weights: [G, N] float64 ≥ 0 → (prefix sums, their running maximum over positive entries
    only, -inf before the first). The first position whose second value reaches a target has a
    positive weight, even where a parallel scan rounds a zero step upward."""
    cumulative = weights.cumsum(-1)
    reachable = cumulative.masked_fill(weights <= 0, float("-inf")).cummax(-1).values
    return cumulative, reachable


# -- logprobs -------------------------------------------------------------------------------------
def _score(logprobs: torch.Tensor, token_ids: torch.Tensor, counts: list[int]) -> Logprobs:
    """logprobs: [N, V], token_ids: [N], counts: N top counts → Logprobs with K = max(counts).

    Rows with the same count share one topk call: a row's top list is then the same whatever
    other counts share its batch (topk's order among equal values depends on k).
    """
    num_rows = logprobs.shape[0]
    device = logprobs.device
    token_ids = token_ids.to(device)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(-1) + 1
    width = max(counts, default=0)
    top_ids = torch.full((num_rows, width), -1, dtype=torch.int64, device=device)
    top_values = torch.full((num_rows, width), float("nan"), device=device)
    for count in sorted(set(counts) - {0}):
        group = _long([n for n, c in enumerate(counts) if c == count], device)
        values, ids = logprobs[group].topk(count, dim=-1)
        top_ids[group, :count] = ids
        top_values[group, :count] = values
    return Logprobs(chosen, ranks, top_ids, top_values)


def _spread(scored: Logprobs, asking: list[int], rows: Sequence[SamplingRow]) -> Logprobs:
    """Logprobs of the asking rows → one row per sampled row (NaN, 0 and -1 for the others)."""
    if len(asking) == len(rows):
        return scored
    device = scored.token_logprobs.device
    index = _long(asking, device)
    num_rows, width = len(rows), scored.top_token_ids.shape[1]
    token_logprobs = torch.full((num_rows,), float("nan"), device=device)
    token_ranks = torch.zeros(num_rows, dtype=torch.int64, device=device)
    top_ids = torch.full((num_rows, width), -1, dtype=torch.int64, device=device)
    top_values = torch.full((num_rows, width), float("nan"), device=device)
    token_logprobs[index] = scored.token_logprobs
    token_ranks[index] = scored.token_ranks
    top_ids[index] = scored.top_token_ids
    top_values[index] = scored.top_logprobs
    return Logprobs(token_logprobs, token_ranks, top_ids, top_values)


def _take(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """tensor[rows] along dim 0 (rows ascending, distinct), without a copy when they are all."""
    if len(rows) == tensor.shape[0]:
        return tensor
    return tensor[_long(rows, tensor.device)]


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
