"""Structured output: grammars that decide which tokens a request may draw next (llguidance).

Shape legend: V = vocab, W = ceil(V / 32) words of a token bitmask.

A request whose `SamplingParams.grammar` is set gets a matcher in its record at intake (the
grammar compiled against the model's tokenizer; a grammar that does not compile refuses the
request at once). Its mask for the next token is computed **off the step's critical path**:
right after a step commits the request's token, the matcher consumes it and a worker thread
computes the next bitmask while the group schedules and runs the next step; the runner only
waits for a mask that is not ready yet, and applies it to the request's logits row before the
sampler draws. Nothing here is a collective, and no other request's row changes.

The grammar builders (`json_schema`, `regex`, `choice`, `lark`) turn what clients send into the
grammar string that `SamplingParams.grammar` carries; the server validates it first
(`check_grammar`), so a bad one is a 400 naming the field.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

_WORKERS = 2
_tokenizers: dict[tuple[str, int, tuple[int, ...]], Any] = {}
_tokenizers_lock = threading.Lock()


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency; the message says what to install
        raise ValueError(
            "structured output needs the llguidance package: pip install llguidance"
        ) from None
    return llguidance


# -- grammars from what clients send --------------------------------------------------------
def json_schema(
    schema: Any, *, any_whitespace: bool = True, whitespace_pattern: str | None = None
) -> str:
    """A grammar for JSON matching ``schema`` (a dict, or its JSON text); ``{}`` or True for
    any JSON value, `{"type": "object"}` for OpenAI's json_object. ``any_whitespace=False``
    (vLLM's `disable_any_whitespace`) allows none between tokens (compact JSON);
    ``whitespace_pattern`` is the regex whitespace there must match instead."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    options: dict[str, Any] = {}
    if not any_whitespace:
        options["whitespace_flexible"] = False
    if whitespace_pattern is not None:
        options["whitespace_pattern"] = whitespace_pattern
    return _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=options or None)


def regex(pattern: str) -> str:
    return _llguidance().LLMatcher.grammar_from_regex(pattern)


def choice(options: list[str]) -> str:
    """Exactly one of ``options``."""
    return regex("|".join(re.escape(option) for option in options))


def lark(grammar: str) -> str:
    return _llguidance().LLMatcher.grammar_from_lark(grammar)


def grammar_from(kind: str, spec: Any, **json_options: Any) -> str:
    """The grammar of one structured-output constraint as clients give it: ``kind`` "json"
    (a schema, a dict or its JSON text), "regex" (a pattern), "choice" (a non-empty list of
    strings) or "lark" (a Lark grammar); ``json_options`` go to `json_schema`. ValueError (or
    llguidance's / json's own error, naming the spot) for a spec that is not of its kind."""
    if kind == "json":
        return json_schema(spec, **json_options)
    if json_options:
        raise ValueError(f"whitespace options apply to JSON only, not to a {kind} constraint")
    if kind == "regex" and isinstance(spec, str):
        return regex(spec)
    if (
        kind == "choice"
        and isinstance(spec, (list, tuple))
        and spec
        and all(isinstance(option, str) for option in spec)
    ):
        return choice(list(spec))
    if kind == "lark" and isinstance(spec, str):
        return lark(spec)
    raise ValueError(f"not a {kind} specification: {repr(spec)[:80]}")


def check_grammar(grammar: str, tokenizer: Any) -> str | None:
    """Why ``grammar`` does not compile against ``tokenizer`` (an LLTokenizer), or None."""
    # validate_grammar returns the error text, empty when the grammar is fine.
    return _llguidance().LLMatcher.validate_grammar(grammar, tokenizer) or None


def model_tokenizer(model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    """The model's tokenizer as llguidance reads it (tokenizer.json), built once per process."""
    key = (str(model_dir), vocab_size, tuple(sorted(eos_token_ids)))
    with _tokenizers_lock:
        if key not in _tokenizers:
            path = Path(model_dir) / "tokenizer.json"
            if not path.is_file():
                raise ValueError(f"structured output needs {path}")
            eos = sorted(eos_token_ids) or None
            _tokenizers[key] = _llguidance().LLTokenizer(
                path.read_text(), n_vocab=vocab_size, eos_token=eos
            )
        return _tokenizers[key]


# -- the engine's side ----------------------------------------------------------------------
class GrammarMasks:
    """Per rank: matchers for the requests that have a grammar, and their next-token masks
    computed on worker threads between steps."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._pool: ThreadPoolExecutor | None = None

    def matcher(self, grammar: str) -> Any:
        """A matcher for a new request; ValueError if the grammar does not compile."""
        tokenizer = model_tokenizer(self.model_dir, self.vocab_size, self.eos_token_ids)
        matcher = _llguidance().LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    def next_mask(self, matcher: Any) -> Future:
        """Start computing ``matcher``'s mask for the next token."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="lockstep-grammar")
        return self._pool.submit(matcher.compute_bitmask)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def allowed_tokens(bitmask: bytes, vocab_size: int) -> torch.Tensor:
    """A packed bitmask (W little-endian int32 words, bit i of word w = token 32 w + i) -> a
    bool [V] of the tokens allowed."""
    words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).to(torch.int64)
    bits = (words.unsqueeze(1) >> torch.arange(32)) & 1
    return bits.reshape(-1)[:vocab_size].bool()
