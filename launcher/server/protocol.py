"""OpenAI request bodies in, validated `GenerationRequest`s out; errors name the field.

Everything a client sends is checked here, before anything reaches a rank: types, ranges,
token ids against the vocabulary, the prompt and `max_tokens` against `max_model_len`. A field
OpenAI defines but Lockstep does not implement is refused when set to anything but its
neutral value (`n` other than 1, `logprobs`, penalties, tools, ...), and unknown fields are
refused, as OpenAI's own API does, so a client never gets silently different behaviour.

Extensions beyond OpenAI's fields (vLLM spells the first four the same way): `top_k`,
`ignore_eos`, `stop_token_ids`, `return_token_ids` (the output token ids in each choice and
chunk), and `dp_rank` (pin the request to one DP rank). A request without `temperature`,
`top_p` or `top_k` takes the model's defaults (`ModelLimits.defaults`: its
generation_config.json, else vLLM's), and `model` may be any of the served names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from launcher.generation_config import GenerationDefaults
from launcher.server.tokenization import ModelTokenizer
from scheduler import SamplingParams

# Completions' default `max_tokens` is OpenAI's; chat's default is the rest of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant")


class RequestError(Exception):
    """A request the server refuses, with the status and OpenAI error body it is answered with."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        error_type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.error_type = error_type
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about the served model and group."""

    served_model_name: str  # the first of the names; metrics count under it
    max_model_len: int
    vocab_size: int
    num_ranks: int
    tokenizer: ModelTokenizer | None
    other_model_names: tuple[str, ...] = ()  # more names a request may give (aliases)
    # What a request that sets no temperature, top_p or top_k gets (generation_config).
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.other_model_names)


@dataclass(frozen=True)
class GenerationRequest:
    endpoint: str  # "completion" or "chat"
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]  # stop strings, cut from the text
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    dp_rank: int | None
    return_token_ids: bool
    model: str  # the served name the request gave; its reply carries the same


# Fields both endpoints accept, and the neutral values of those Lockstep does not implement.
_COMMON_FIELDS = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "ignore_eos",
    "dp_rank",
    "return_token_ids",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "best_of", "echo", "suffix"}
_CHAT_FIELDS = _COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "metadata",
    "store",
}
# field -> values that mean "not used"; anything else is refused as unsupported.
_NEUTRAL = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, False, True),
    "response_format": (None, {"type": "text"}),
    "metadata": (None, {}),
    "store": (None, False),
}


def parse_completion(body: Any, limits: ModelLimits) -> GenerationRequest:
    body = _object(body)
    _check_fields(body, _COMPLETION_FIELDS)
    prompt = _completion_prompt(body, limits)
    return _generation(body, limits, "completion", prompt, "max_tokens")


def parse_chat(body: Any, limits: ModelLimits) -> GenerationRequest:
    body = _object(body)
    _check_fields(body, _CHAT_FIELDS)
    if limits.tokenizer is None:
        raise RequestError("chat needs the model's tokenizer.json", param="messages")
    messages = _messages(body)
    try:
        text = limits.tokenizer.render_chat(messages)
    except ValueError as error:
        raise RequestError(str(error), param="messages") from None
    _check_text_fits(text, limits, "messages")
    prompt = limits.tokenizer.encode(text, add_special_tokens=False)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    if key is not None and body.get("max_tokens") is not None:
        raise RequestError(
            "give max_completion_tokens or max_tokens, not both", param="max_completion_tokens"
        )
    return _generation(body, limits, "chat", prompt, key or "max_tokens")


# -- the shared part ----------------------------------------------------------------------------
def _generation(
    body: dict[str, Any],
    limits: ModelLimits,
    endpoint: str,
    prompt: list[int],
    max_tokens_key: str,
) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError(f"model must be a string, got {shorten(model)}", param="model")
    if model not in limits.served_model_names:
        served = " or ".join(repr(name) for name in limits.served_model_names)
        raise RequestError(
            f"the model {shorten(model)} does not exist; this server serves {served}",
            param="model",
            status=404,
            code="model_not_found",
        )
    for name, neutral in _NEUTRAL.items():
        if name in body and not any(_same(body[name], value) for value in neutral):
            allowed = " or ".join(repr(v) for v in neutral if v is not None)
            raise RequestError(
                f"{name}={shorten(body[name])} is not supported by this server "
                f"(allowed: {allowed})",
                param=name,
            )
    room = limits.max_model_len - len(prompt)
    if room < 1:
        raise RequestError(
            f"the prompt has {len(prompt)} tokens; max_model_len is {limits.max_model_len}, "
            "which leaves no room for output",
            param="messages" if endpoint == "chat" else "prompt",
        )
    max_tokens = body.get(max_tokens_key)
    if max_tokens is None:
        default = COMPLETION_DEFAULT_MAX_TOKENS if endpoint == "completion" else room
        max_tokens = min(default, room)
    else:
        _int(max_tokens, max_tokens_key, minimum=1)
        if max_tokens > room:
            raise RequestError(
                f"{max_tokens_key} is {max_tokens}, but the prompt's {len(prompt)} tokens leave "
                f"{room} of max_model_len {limits.max_model_len}",
                param=max_tokens_key,
            )
    stop, stop_ids = _stops(body, limits)
    ignore_eos = _optional_bool(body, "ignore_eos", False)
    if not ignore_eos and limits.tokenizer is not None:
        # End-of-turn ids the engine does not know (generation_config.json, the tokenizer's
        # eos_token); ignore_eos leaves them out like the engine's own EOS ids.
        stop_ids |= limits.tokenizer.eos_token_ids
    if not ignore_eos:
        stop_ids |= limits.defaults.eos_token_ids  # the generation_config setting's file
    params = _sampling_params(body, max_tokens, stop_ids, ignore_eos, limits.defaults)
    stream = _optional_bool(body, "stream", False)
    include_usage = _stream_options(body, stream)
    dp_rank = body.get("dp_rank")
    if dp_rank is not None and (not _is_int(dp_rank) or not 0 <= dp_rank < limits.num_ranks):
        raise RequestError(
            f"dp_rank must be an int in [0, {limits.num_ranks}) or null, got {shorten(dp_rank)}",
            param="dp_rank",
        )
    return GenerationRequest(
        endpoint=endpoint,
        prompt_token_ids=prompt,
        params=params,
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        dp_rank=dp_rank,
        return_token_ids=_optional_bool(body, "return_token_ids", False),
        model=model,
    )


def _sampling_params(
    body: dict[str, Any],
    max_tokens: int,
    stop_ids: set[int],
    ignore_eos: bool,
    defaults: GenerationDefaults,
) -> SamplingParams:
    # A field the request leaves out takes the model's default (generation_config.json, else
    # vLLM's: temperature 1.0, no filters), each on its own, as vLLM's server does.
    temperature = _number(body, "temperature", defaults.temperature, low=0.0, high=2.0)
    top_p = _number(body, "top_p", defaults.top_p, low=0.0, high=1.0)
    if top_p == 0.0:
        raise RequestError("top_p must be in (0, 1], got 0", param="top_p")
    top_k = body.get("top_k")
    if top_k is None:
        top_k = defaults.top_k
    elif top_k == -1:  # -1 is vLLM's spelling of "off"
        top_k = 0
    _int(top_k, "top_k", minimum=0)
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        raise RequestError(
            f"seed must be an int in [0, 2**63) or null, got {shorten(seed)}", param="seed"
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        seed=seed,
        stop_token_ids=frozenset(stop_ids),
        ignore_eos=ignore_eos,
    )


def _stops(body: dict[str, Any], limits: ModelLimits) -> tuple[tuple[str, ...], set[int]]:
    stop = body.get("stop")
    if stop is None:
        strings: list[str] = []
    elif isinstance(stop, str):
        strings = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        strings = list(stop)
    else:
        raise RequestError(
            f"stop must be a string or a list of strings, got {shorten(stop)} "
            "(token ids go in stop_token_ids)",
            param="stop",
        )
    if len(strings) > MAX_STOP_STRINGS or any(not s for s in strings):
        raise RequestError(
            f"stop takes at most {MAX_STOP_STRINGS} non-empty strings, got {shorten(strings)}",
            param="stop",
        )
    if strings and limits.tokenizer is None:
        raise RequestError("stop strings need the model's tokenizer.json", param="stop")
    ids = body.get("stop_token_ids")
    if ids is None:
        ids = []
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < limits.vocab_size for t in ids):
        raise RequestError(
            f"stop_token_ids must be a list of token ids in [0, {limits.vocab_size}), "
            f"got {shorten(ids)}",
            param="stop_token_ids",
        )
    return tuple(strings), set(ids)


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise RequestError("stream_options needs stream: true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError(
            f"stream_options must be an object with include_usage, got {shorten(options)}",
            param="stream_options",
        )
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise RequestError(
            f"stream_options.include_usage must be true or false, got {shorten(include)}",
            param="stream_options.include_usage",
        )
    return include


def _completion_prompt(body: dict[str, Any], limits: ModelLimits) -> list[int]:
    if "prompt" not in body:
        raise RequestError("prompt is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if limits.tokenizer is None:
            raise RequestError(
                "text prompts need the model's tokenizer.json; send token ids", param="prompt"
            )
        _check_text_fits(prompt, limits, "prompt")
        tokens = limits.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
        if bad:
            raise RequestError(
                f"prompt token id {bad[0]} at position {prompt.index(bad[0])} is outside the "
                f"vocabulary [0, {limits.vocab_size})",
                param="prompt",
            )
        tokens = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(
            f"prompt holds {len(prompt)} prompts; this server takes one prompt per request",
            param="prompt",
        )
    else:
        raise RequestError(
            f"prompt must be a string or a list of token ids, got {shorten(prompt)}",
            param="prompt",
        )
    if not tokens:
        raise RequestError("prompt is empty", param="prompt")
    return tokens


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            f"messages must be a non-empty list, got {shorten(messages)}", param="messages"
        )
    result = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object, got {shorten(message)}", param=where)
        unknown = sorted(set(message) - {"role", "content", "name"})
        if unknown:
            raise RequestError(f"{where} has unsupported field(s) {shorten(unknown)}", param=where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(
                f"{where}.role must be one of {list(CHAT_ROLES)}, got {shorten(role)}",
                param=f"{where}.role",
            )
        result.append({"role": role, "content": _content(message.get("content"), where)})
    return result


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    f"{where}.content[{index}] must be a text part "
                    f'{{"type": "text", "text": "..."}}, got {shorten(part)}',
                    param=f"{where}.content[{index}]",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(
        f"{where}.content must be a string or a list of text parts, got {shorten(content)}",
        param=f"{where}.content",
    )


# -- small checks -------------------------------------------------------------------------------
def _check_text_fits(text: str, limits: ModelLimits, param: str) -> None:
    """Refuse text too long for max_model_len before paying for its encoding."""
    assert limits.tokenizer is not None
    at_least = limits.tokenizer.min_num_tokens(text)
    if at_least >= limits.max_model_len:
        raise RequestError(
            f"the prompt's {len(text)} characters make at least {at_least} tokens; "
            f"max_model_len is {limits.max_model_len}, which leaves no room for output",
            param=param,
        )


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {shorten(body)}")
    return body


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(
            f"unrecognized request argument(s): {shorten(unknown)}; supported: {sorted(allowed)}",
            param=unknown[0][:80],
        )


def _int(value: Any, name: str, *, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        raise RequestError(f"{name} must be an int >= {minimum}, got {shorten(value)}", param=name)


def _number(body: dict[str, Any], name: str, default: float, *, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise RequestError(
            f"{name} must be a number in [{low}, {high}], got {shorten(value)}", param=name
        )
    return float(value)


def _optional_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {shorten(value)}", param=name)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _same(value: Any, neutral: Any) -> bool:
    # Compare types too: bool is an int in Python, and `n: true` must not pass as `n: 1`.
    return type(value) is type(neutral) and value == neutral


def shorten(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages that echo what a client
    sent: a 1 MB field must not come back in full."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 20]}... ({len(text)} characters)"
