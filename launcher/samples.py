"""A request's samples as the front ends (the `LLM`, the server) handle them: vLLM's `n` and
stop strings, which no rank applies.

    SamplingParams(n=3, stop=["\\n"]) -> rank_params(params, j), j = 0..n-1: one rank request
        each, with n=1, no stop strings and sample j's own seed
    each output of sample j -> SampleText.take -> the text to show (stop strings cut), the
        token ids kept, their logprobs; `stopped` once a stop string matched, and the front
        end then aborts the rank request

Both front ends go through these, so a request gives the same samples, text and token ids
offline and over HTTP.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dist_engine.engine.outputs import RequestOutput, TokenLogprob
from launcher.server.tokenization import IncrementalDetokenizer, ModelTokenizer
from scheduler import SamplingParams
from scheduler.sampling_params import resolve_bad_words


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed``: the seed itself for
    sample 0, a 64-bit hash of both for the others, so a seeded request with n > 1 is
    reproducible and its samples differ."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def rank_params(params: SamplingParams, index: int = 0) -> SamplingParams:
    """What a rank is sent for sample ``index`` of a request: n=1 and no stop strings (the
    front end applies them), seeded with `sample_seed` when the request has a seed. A sample
    of an unseeded request is left unseeded here: its front end fixes one per sample
    (`DriverSeeds`), as for any request."""
    seed = None if params.seed is None else sample_seed(params.seed, index)
    front_end = (params.n, params.stop, params.include_stop_str_in_output)
    if front_end == (1, (), False) and seed == params.seed:
        return params
    return replace(params, n=1, stop=(), include_stop_str_in_output=False, seed=seed)


def with_bad_words(params: SamplingParams, tokenizer: ModelTokenizer | None) -> SamplingParams:
    """``params`` with its `bad_words` as the token-id sequences a rank masks (ValueError where
    there is no tokenizer to encode them, or a word encodes to nothing)."""
    if not params.bad_words:
        return params
    if tokenizer is None:
        raise ValueError(
            f"bad_words={list(params.bad_words)!r} are encoded with the model's tokenizer, and "
            "this model has none (give token ids in bad_words_token_ids)"
        )
    sequences = resolve_bad_words(
        params.bad_words, lambda text: tokenizer.encode(text, add_special_tokens=False)
    )
    merged = tuple(dict.fromkeys(params.bad_words_token_ids + sequences))
    return replace(params, bad_words_token_ids=merged)


def truncation(count: object, side: object, max_model_len: int) -> tuple[int, str] | None:
    """vLLM's `truncate_prompt_tokens` and `truncation_side` as (tokens kept, side), or None:
    k >= 1 keeps k of a prompt's tokens, -1 as many as max_model_len leaves room for one
    output token; "left" (vLLM's default for generation) keeps the last ones, "right" the
    first. ValueError naming the field for anything else."""
    if side is not None and side not in ("left", "right"):
        raise ValueError(f"truncation_side must be 'left' or 'right', got {side!r}")
    if count is None:
        return None
    if not isinstance(count, int) or isinstance(count, bool) or not (count >= 1 or count == -1):
        raise ValueError(
            f"truncate_prompt_tokens must be an int >= 1, or -1 (as many as max_model_len "
            f"allows), got {count!r}"
        )
    if count > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens={count} cannot be greater than max_model_len ({max_model_len})"
        )
    return (max_model_len - 1 if count == -1 else count), str(side or "left")


def truncated(prompt: list[int], spec: tuple[int, str] | None) -> list[int]:
    """``prompt`` cut as `truncation` said (unchanged where it fits)."""
    if spec is None or len(prompt) <= spec[0]:
        return prompt
    count, side = spec
    return prompt[-count:] if side == "left" else prompt[:count]


def grammar_tokenizer(tokenizer_dir: str | Path, model_config: Any) -> Any:
    """The tokenizer llguidance checks grammars with, or None without a tokenizer.json."""
    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        return None
    from dist_engine.engine.structured import model_tokenizer

    return model_tokenizer(
        str(tokenizer_dir), model_config.vocab_size, tuple(model_config.eos_token_ids)
    )


def with_grammar(params: SamplingParams, checker: Any) -> SamplingParams:
    """``params`` with vLLM's `structured_outputs` as the llguidance `grammar` a rank runs,
    checked against the model's tokenizer (``checker``, `grammar_tokenizer`'s) as the server
    checks it. ValueError (or json's own error) for a constraint that is not of its kind or
    does not compile, and where there is no tokenizer to compile it against."""
    outputs = params.structured_outputs
    if outputs is None:
        return params
    from dist_engine.engine import structured

    if checker is None:
        raise ValueError("structured_outputs need the model's tokenizer.json")
    grammar = structured.grammar_from(*outputs.constraint(), **outputs.json_options())
    problem = structured.check_grammar(grammar, checker)
    if problem:
        raise ValueError(
            f"structured_outputs {outputs.constraint()[0]} does not compile: {problem}"
        )
    return replace(params, grammar=grammar, structured_outputs=None)


@dataclass(frozen=True)
class Piece:
    """What one output adds to a sample: its text, its token ids, their logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None

    @property
    def empty(self) -> bool:
        return not self.text and not self.token_ids


class SampleText:
    """One sample's outputs as its caller sees them: the text (`IncrementalDetokenizer`,
    stop strings cut; an EOS or stop token that ended the sample is not part of it), the
    token ids kept (through the one that completed a stop string, as vLLM keeps them) and
    their logprobs. Without a tokenizer the text stays empty and no stop string can match."""

    def __init__(
        self,
        tokenizer: ModelTokenizer | None,
        stop: Sequence[str] = (),
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        stop_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, stop, include_stop=include_stop, skip_special_tokens=skip_special_tokens
        )
        self.stop_token_ids = stop_token_ids
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []

    @classmethod
    def of(cls, params: SamplingParams, tokenizer: ModelTokenizer | None) -> SampleText:
        """The sample text of a request with ``params`` (its stop strings and stop ids)."""
        return cls(
            tokenizer if params.detokenize else None,
            params.stop,
            include_stop=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            stop_token_ids=params.stop_token_ids,
        )

    @property
    def text(self) -> str:
        return self.detokenizer.text

    @property
    def stopped(self) -> bool:
        """A stop string matched: the sample is over, whatever its rank is still doing."""
        return self.detokenizer.stopped

    def take(self, output: RequestOutput) -> Piece:
        """Account one output of the sample; returns what it adds."""
        tokens = list(output.new_token_ids)
        text_tokens = tokens
        if output.finish_reason == "stop" and tokens and tokens[-1] in self.stop_token_ids:
            text_tokens = tokens[:-1]  # an EOS or stop token ends the text; it is not part of it
        before = len(self.detokenizer.token_ids)
        delta = self.detokenizer.add(text_tokens, finished=output.finished)
        kept = tokens[: len(self.detokenizer.token_ids) - before] if delta.stopped else tokens
        logprobs = list(output.new_logprobs[: len(kept)]) if output.new_logprobs else None
        self.token_ids += kept
        if logprobs:
            self.logprobs += logprobs
        return Piece(delta.text, kept, logprobs)
