"""Per-request generation settings, validated at construction.

Field names, meanings and defaults follow vLLM's ``SamplingParams`` except where this file says
otherwise (``temperature`` defaults to 0, greedy; ``top_k`` takes 0, not -1, for "off"). This is
the only place sampling settings are validated: every value a tensor op could later reject is
refused here, with a message naming the field, the value and what is allowed.
"""

from __future__ import annotations

import copy
import json as jsonlib
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

# Seeds are hashed as unsigned 64-bit integers (the sampler's counter-based draws).
MAX_SEED = 2**64 - 1
# Temperatures below this sample greedily: dividing logits by ~1e-38 overflows to inf and the
# softmax of infs is NaN (vLLM uses the same cut-off).
GREEDY_TEMPERATURE = 1e-5
# Token ids are int64 on every path (and a vocabulary is far smaller).
MAX_TOKEN_ID = 2**63 - 1
# vLLM's (and OpenAI's) range for the additive penalties.
MAX_ABS_PENALTY = 2.0
# OpenAI's range for a logit bias; vLLM clamps to it, here a value outside is refused.
MAX_ABS_LOGIT_BIAS = 100.0
# vLLM only asks repetition_penalty > 0. Useful values lie near 1 to 2; these bounds keep a
# penalised logit finite in float32 even after the smallest temperature divides it.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# Bad words are matched in Python at every step of the request: at most this many token-id
# sequences (vLLM's default limit, VLLM_MAX_NUM_BAD_WORDS) of this many ids each.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 64


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured-output constraint of one request: exactly one of ``json`` (a JSON
    schema, as a dict or its text), ``regex``, ``choice`` (the output is one of these strings),
    ``grammar`` (a Lark grammar) or ``json_object=True`` (any JSON object). The `LLM` turns it
    into `SamplingParams.grammar` (llguidance's form) before a rank sees the request.

    For JSON, `disable_any_whitespace` allows no whitespace between tokens and
    `whitespace_pattern` sets the regex whitespace must match (vLLM's options); vLLM's
    `disable_additional_properties` and `structural_tag` are accepted at their defaults only:
    anything else is refused, not ignored."""

    json: str | dict | None = field(default=None, hash=False)
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise ValueError(f"choice must be a list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, dict):  # a private copy: nobody changes it after validation
            object.__setattr__(self, "json", copy.deepcopy(self.json))
        given = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"structured outputs take exactly one of {list(_CONSTRAINTS)}, got "
                f"{given or 'none'}"
            )
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"json_object must be True when given, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                f"disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}"
            )
        pattern = self.whitespace_pattern
        if pattern is not None and not isinstance(pattern, str):
            raise ValueError(f"whitespace_pattern must be a regex string, got {pattern!r}")
        json_kind = self.json is not None or self.json_object is not None
        if (self.disable_any_whitespace or pattern is not None) and not json_kind:
            raise ValueError(
                "disable_any_whitespace and whitespace_pattern apply to json and json_object "
                "constraints only"
            )
        for name, default in (
            ("disable_additional_properties", False),
            ("structural_tag", None),
        ):
            if getattr(self, name) != default:
                raise ValueError(
                    f"structured outputs' {name}={getattr(self, name)!r} is not supported here "
                    f"(only its default, {default!r})"
                )

    def json_options(self) -> dict[str, object]:
        """The JSON compiler's options these settings ask for (`structured.json_schema`)."""
        options: dict[str, object] = {}
        if self.disable_any_whitespace:
            options["any_whitespace"] = False
        if self.whitespace_pattern is not None:
            options["whitespace_pattern"] = self.whitespace_pattern
        return options

    def constraint(self) -> tuple[str, object]:
        """(kind, spec) for `dist_engine.engine.structured.grammar_from`."""
        if self.json is not None:
            return "json", self.json
        if self.json_object:
            return "json", {"type": "object"}
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", list(self.choice)
        return "lark", self.grammar

    def __hash__(self) -> int:
        return hash(
            (
                _json_key(self.json),
                self.regex,
                self.choice,
                self.grammar,
                self.json_object,
                self.disable_any_whitespace,
                self.whitespace_pattern,
            )
        )


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _json_key(value: object) -> object:
    return jsonlib.dumps(value, sort_keys=True) if isinstance(value, dict) else value


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` (or below ``GREEDY_TEMPERATURE``) means greedy. ``top_k == 0``,
    ``top_p == 1.0`` and ``min_p == 0`` disable those filters. ``seed`` (0 to 2**64 - 1) makes
    sampling reproducible per request, whatever else shares its batch and on whichever rank it
    runs, also after a resumption.

    Penalties (vLLM's): ``presence_penalty`` subtracts itself from the logit of every token already
    in the output, ``frequency_penalty`` subtracts itself once per occurrence there (both in
    [-2, 2], 0 disables); ``repetition_penalty`` divides a positive logit and multiplies a
    negative one of every token seen in the prompt or the output (1 disables). ``min_tokens``
    masks the stop ids and EOS until that many tokens are out. ``logit_bias`` maps token ids to a
    bias added to their logits (ids are checked against the vocabulary by the sampler, which
    knows it). ``logprobs``: None, or how many top log-probabilities to return per output token
    besides the sampled token's (0: that one only; -1: the whole vocabulary);
    ``prompt_logprobs`` the same per prompt token.

    Front-end fields (vLLM's), applied by the `LLM` and the server before a rank sees the
    request: ``n`` samples of the prompt, each sent to a rank as its own request (n=1, a seed
    of its own derived from ``seed``, launcher/samples.py); ``stop`` strings (a string or a
    list of them), matched on the decoded text: the sample ends with finish reason "stop",
    its text cut before the stop string (after it with ``include_stop_str_in_output``). A rank
    refuses a request that still has n != 1 or stop strings (they would be ignored there).

    Everything a tensor op could later reject is checked here, at the door: a request must never
    fail inside a step, where it would cost every other request of the group.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    # vLLM's further fields, after the existing ones so positional use keeps its meaning.
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # A private copy, so nobody can change it after validation; left out of the hash (a dict
    # has none) but compared.
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured output: an llguidance grammar (its JSON form, as `dist_engine.engine.
    # structured` builds from a JSON schema, a regex, a choice list or a Lark grammar); every
    # token is drawn from what the grammar allows next.
    grammar: str | None = None
    # The grammar applies only after the output first holds this token-id sequence (a
    # reasoning model's end of thinking, `</think>`: vLLM constrains the answer, not the
    # reasoning). Empty: from the first token.
    grammar_after: tuple[int, ...] = ()
    # Token ids the sample may draw from (vLLM's `allowed_token_ids`): every other logit is
    # masked. None: the whole vocabulary.
    allowed_token_ids: tuple[int, ...] | None = None
    # `bad_words` as token-id sequences, which a rank applies: a sequence's last token is
    # masked while the output ends with the rest of it (all of a one-token sequence always).
    # The front end fills this from `bad_words` with the model's tokenizer (`resolve_bad_words`).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's `cache_salt` (a prompt's, there): the rank's prefix cache shares blocks only
    # between requests with the same salt (or none), so one tenant cannot learn from cache
    # hits which prompts another sent. Carried here so every path (heals included) keeps it.
    cache_salt: str | None = None
    # Front-end fields: the `LLM` (launcher/llm.py) and the server apply them, never a rank
    # (which refuses a request that still carries n or stop strings, engine/request.py).
    n: int = 1
    stop: str | list[str] | tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    # Words the output must not contain, turned into `bad_words_token_ids` by the front end.
    bad_words: tuple[str, ...] = ()
    # vLLM's spelling of structured output, turned into `grammar` by the front end.
    structured_outputs: StructuredOutputsParams | None = None
    # How the front end turns tokens into text: ``detokenize=False`` leaves the text empty
    # (token ids only; stop strings then cannot match, so they are refused);
    # ``skip_special_tokens`` leaves special tokens out of it. ``spaces_between_special_tokens``
    # is accepted for vLLM's sake: it concerns "slow" (Python) tokenizers, and the `tokenizers`
    # library this front end decodes with has no such option (vLLM ignores it there too).
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an int in [0, 2**64 - 1] or None, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2] (0 disables it), got {value!r}")
        penalty = self.repetition_penalty
        if not _is_real(penalty) or not (
            MIN_REPETITION_PENALTY <= penalty <= MAX_REPETITION_PENALTY
        ):
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                f"{MAX_REPETITION_PENALTY:g}] (1 disables it), got {penalty!r}"
            )
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise ValueError(
                    f"{name} must be None, an int >= 0 or -1 (the whole vocabulary), got {value!r}"
                )
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError(f"grammar must be a non-empty string or None, got {self.grammar!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1 (samples per prompt), got {self.n!r}")
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        for name in (
            "include_stop_str_in_output",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop={list(self.stop)!r} needs detokenize=True: stop strings are matched on "
                "the text (stop_token_ids end a sample on token ids)"
            )
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 1024):
            raise ValueError(
                "cache_salt must be a non-empty string (at most 1024 characters) or None, got "
                f"{str(salt)[:80]!r}"
            )
        outputs = self.structured_outputs
        if isinstance(outputs, dict):  # vLLM's dict form, as the server receives it
            outputs = StructuredOutputsParams(**outputs)
            object.__setattr__(self, "structured_outputs", outputs)
        if outputs is not None and not isinstance(outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {outputs!r}"
            )
        if outputs is not None and self.grammar is not None:
            raise ValueError("give structured_outputs or grammar, not both")
        if self.grammar_after:
            marker = _id_sequence(self.grammar_after, "grammar_after")
            if self.grammar is None:
                raise ValueError("grammar_after needs a grammar (or structured output)")
            object.__setattr__(self, "grammar_after", marker)
        else:
            object.__setattr__(self, "grammar_after", ())
        if self.allowed_token_ids is not None:
            ids = _id_sequence(self.allowed_token_ids, "allowed_token_ids")
            object.__setattr__(self, "allowed_token_ids", tuple(dict.fromkeys(ids)))
        object.__setattr__(self, "bad_words", _bad_words(self.bad_words))
        sequences = self.bad_words_token_ids
        if isinstance(sequences, (str, bytes)) or not isinstance(sequences, (list, tuple)):
            raise ValueError(
                f"bad_words_token_ids must be a list of token id lists, got {sequences!r}"
            )
        if len(sequences) > MAX_BAD_WORDS:
            raise ValueError(
                f"bad_words_token_ids holds {len(sequences)} sequences; at most {MAX_BAD_WORDS}"
            )
        sequences = tuple(_id_sequence(ids, "bad_words_token_ids") for ids in sequences)
        if any(len(ids) > MAX_BAD_WORD_TOKENS for ids in sequences):
            raise ValueError(
                f"a bad word's token ids are at most {MAX_BAD_WORD_TOKENS}, got one of "
                f"{max(map(len, sequences))}"
            )
        object.__setattr__(self, "bad_words_token_ids", sequences)
        # Read for every row of every step (the sampler's `_adjust`): computed once here, not
        # a field (equality, hashing and `replace` see only the fields, and recompute it).
        object.__setattr__(self, "adjusts_logits", _adjusts_logits(self))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def reads_output(self) -> bool:
        """Whether the sampler reads the output token ids (penalties, bad words)."""
        return self.uses_penalties or bool(self.bad_words_token_ids)

    @property
    def uses_penalties(self) -> bool:
        """Whether the output token ids (and, for repetition_penalty, the prompt's) matter."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def params_to_plain(params: SamplingParams) -> dict[str, object]:
    """``params`` as JSON-ready values: the fields that differ from their defaults, each as
    lists, strings, numbers and dicts with string keys (`params_from_plain` reverses it)."""
    default = _DEFAULT_PARAMS
    plain: dict[str, object] = {}
    for item in fields(SamplingParams):
        value = getattr(params, item.name)
        if value == getattr(default, item.name):
            continue
        if item.name == "logit_bias":
            value = [[token, bias] for token, bias in value.items()]
        elif item.name == "structured_outputs":
            value = {
                sub.name: _plain_value(getattr(value, sub.name))
                for sub in fields(StructuredOutputsParams)
                if getattr(value, sub.name) != sub.default
            }
        plain[item.name] = _plain_value(value)
    return plain


def params_from_plain(plain: dict[str, Any]) -> SamplingParams:
    """The `SamplingParams` `params_to_plain` made, equal to the original: its checks run
    again and give each field its type. Params a caller forced past the checks (a field set
    with ``object.__setattr__``) come back as they were, as an unpickled copy would, so that
    a rank's own admission refuses that request alone."""
    values: dict[str, Any] = dict(plain)
    if "stop_token_ids" in values:
        values["stop_token_ids"] = frozenset(values["stop_token_ids"])
    if "logit_bias" in values:
        values["logit_bias"] = {int(token): bias for token, bias in values["logit_bias"]}
    for name in ("grammar_after", "allowed_token_ids", "stop", "bad_words"):
        if isinstance(values.get(name), list):
            values[name] = tuple(values[name])
    if "bad_words_token_ids" in values:
        values["bad_words_token_ids"] = tuple(tuple(ids) for ids in values["bad_words_token_ids"])
    if "structured_outputs" in values:
        outputs = dict(values["structured_outputs"])
        if isinstance(outputs.get("choice"), list):
            outputs["choice"] = tuple(outputs["choice"])
        values["structured_outputs"] = _checked_or_restored(StructuredOutputsParams, outputs)
    return _checked_or_restored(SamplingParams, values)


def _checked_or_restored(cls: type, values: dict[str, Any]) -> Any:
    try:
        return cls(**values)
    except ValueError:
        made = object.__new__(cls)
        for item in fields(cls):
            if item.name in values:
                value = values[item.name]
            elif item.default is not MISSING:
                value = item.default
            else:
                value = item.default_factory()
            object.__setattr__(made, item.name, value)
        if cls is SamplingParams:
            object.__setattr__(made, "adjusts_logits", _adjusts_logits(made))
        return made


def _adjusts_logits(params: SamplingParams) -> bool:
    return bool(
        params.logit_bias
        or params.allowed_token_ids is not None
        or params.bad_words_token_ids
        or params.uses_penalties
    )


def _plain_value(value: object) -> object:
    if isinstance(value, frozenset):
        return sorted(value)
    if isinstance(value, (tuple, list)):
        return [_plain_value(item) for item in value]
    return value


def _token_ids(ids: object) -> frozenset[int]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"stop_token_ids must be a collection of ints, got {ids!r}")
    result = frozenset(ids)
    bad = [t for t in result if not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID]
    if bad:
        raise ValueError(f"stop_token_ids must be ints >= 0, got {sorted(map(repr, bad))}")
    return result


def _stop_strings(stop: object) -> tuple[str, ...]:
    strings = (stop,) if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) and s for s in strings):
        raise ValueError(
            f"stop must be a non-empty string or a list of them (token ids go in "
            f"stop_token_ids), got {stop!r}"
        )
    return tuple(strings)


def _id_sequence(ids: object, name: str) -> tuple[int, ...]:
    """A non-empty list of token ids, in order (duplicates allowed), as a tuple."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(f"{name} must be a non-empty list of token ids, got {ids!r}")
    bad = [t for t in ids if not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID]
    if bad:
        raise ValueError(f"{name} must hold token ids (ints >= 0), got {bad[:8]!r}")
    return tuple(ids)


def _bad_words(words: object) -> tuple[str, ...]:
    if words is None:
        return ()
    if isinstance(words, str) or not isinstance(words, (list, tuple)):
        raise ValueError(f"bad_words must be a list of strings, got {words!r}")
    if not all(isinstance(w, str) and w.strip() for w in words):
        raise ValueError(f"bad_words must be non-blank strings, got {list(words)[:8]!r}")
    if len(words) > MAX_BAD_WORDS:  # each encodes to one sequence at least
        raise ValueError(f"bad_words holds {len(words)} words; at most {MAX_BAD_WORDS}")
    return tuple(words)


def resolve_bad_words(words: tuple[str, ...], encode) -> tuple[tuple[int, ...], ...]:
    """`bad_words` as the token-id sequences a rank masks: each word as it reads at the start of
    the text and, where that encodes differently with the same number of tokens, after a space
    (the usual form inside a text, as vLLM resolves them). `encode(text)` gives token ids
    without special tokens. A word that encodes to nothing is refused."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        if not bare:
            raise ValueError(f"bad_words entry {word!r} encodes to no token")
        sequences.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    sequences = list(dict.fromkeys(sequences))
    if len(sequences) > MAX_BAD_WORDS:
        raise ValueError(
            f"bad_words encode to {len(sequences)} token sequences; at most {MAX_BAD_WORDS}"
        )
    return tuple(sequences)


def _logit_bias(bias: object) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    for token, value in bias.items():
        if not _is_int(token) or not 0 <= token <= MAX_TOKEN_ID:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        if not _is_real(value) or not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias values must be in [-100, 100], got {value!r} for token {token}"
            )
    return {token: float(value) for token, value in bias.items()}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond float's range
        return False


_DEFAULT_PARAMS = SamplingParams()
