"""OpenAI request bodies in, validated `GenerationRequest`s out; errors name the field.

Everything a client sends is checked here, before anything reaches a rank: types, ranges,
token ids against the vocabulary, the prompts and `max_tokens` against `max_model_len`.

The policy on fields is vLLM's, so the clients written for it work unchanged:
- the fields vLLM and OpenAI define are honoured (`_HONOURED`): sampling settings and
  penalties, `n` / `best_of`, `logprobs` / `top_logprobs` / `echo` / `prompt_logprobs`, stop
  strings and ids, `allowed_token_ids`, `bad_words`, `truncate_prompt_tokens` /
  `truncation_side`, `cache_salt`, `request_id`, batched prompts on `/v1/completions`,
  structured output, chat's tools (server/tools.py), `documents` and
  `continue_final_message`, streaming options;
- a field this server cannot honour is accepted at its neutral value and refused with a 400
  naming it otherwise (`_NEUTRAL`: beam search, suffix, logits processors, priority, ...);
- fields that do not change the output (`user`, `metadata`, ...) are accepted;
- an unknown field is ignored, and the server logs one warning per field name
  (`GenerationRequest.ignored_fields`); with `server.strict_requests` it is a 400, as
  OpenAI's own API answers.

Lockstep's extensions: `dp_rank` (pin the request to one DP rank) and vLLM's `return_token_ids`.
A request without `temperature`, `top_p` or `top_k` takes the model's defaults
(`ModelLimits.defaults`: its generation_config.json, else vLLM's), and `model` may be any of
the served names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from launcher.generation_config import GenerationDefaults
from launcher.samples import rank_params, truncated, truncation, with_bad_words
from launcher.server.reasoning import CLOSE, prompt_end, thinks_first
from launcher.server.tokenization import ModelTokenizer
from launcher.server.tools import ToolError, Tools, parse_tools
from scheduler import SamplingParams, StructuredOutputsParams

# Completions' default `max_tokens` is OpenAI's; chat's default is the rest of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16
MAX_CHOICES = 128  # n, best_of, and prompts x n in one request
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for logprobs / top_logprobs
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


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
    strict_requests: bool = False  # unknown fields: 400 instead of a warning
    # Tool calling: whether tool_choice "auto" may be asked, and the parser that reads it.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # With a reasoning parser, structured output constrains the answer after `</think>`.
    reasoning_parser: str | None = None
    # The model's tokenizer as llguidance reads it, to check grammars (None: no structured
    # output: the model has no tokenizer.json).
    grammar_tokenizer: Any = None
    other_model_names: tuple[str, ...] = ()  # more names a request may give (aliases)
    # What a request that sets no temperature, top_p or top_k gets (generation_config).
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.other_model_names)


@dataclass(frozen=True)
class GenerationRequest:
    """One request of either endpoint: every choice it asks for, and how to answer it.

    Sample ``s`` samples prompt ``s // best_of``; its settings are `sample_params(s)` (with
    `best_of` > n, `num_samples` samples are drawn and the `n` most likely of each prompt's
    kept)."""

    endpoint: str  # "completion" or "chat"
    prompts: list[list[int]]  # one prompt for chat; a batch for completions
    n: int  # choices returned per prompt
    best_of: int  # samples drawn per prompt (>= n); the n with the best cumulative logprob win
    params: SamplingParams
    stop: tuple[str, ...]  # stop strings, cut from the text
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool  # stream_options.continuous_usage_stats: usage in every chunk
    dp_rank: int | None
    return_token_ids: bool
    echo: bool  # completions: the prompt's text (and logprobs) before the output's
    logprobs: int | None  # top logprobs per output token (None: no logprobs at all)
    prompt_logprobs: int | None  # top logprobs per prompt token (echo with logprobs, or asked)
    ignored_fields: tuple[str, ...] = ()  # unknown fields, for the server's one warning each
    model: str = ""  # the served name the request gave; its reply carries the same
    include_reasoning: bool = True  # chat, with a reasoning parser: send the reasoning too
    tools: Tools | None = None  # chat: the request's tools and tool_choice (server/tools.py)
    client_request_id: str | None = None  # vLLM's request_id: the reply's id (after its prefix)
    echo_fields: dict[str, Any] | None = None  # /v1/responses: instructions, metadata to echo

    @property
    def prompt_token_ids(self) -> list[int]:
        """The first (for chat: the only) prompt."""
        return self.prompts[0]

    @property
    def num_samples(self) -> int:
        return len(self.prompts) * self.best_of

    def sample_params(self, sample: int) -> SamplingParams:
        """The settings of sample ``sample`` (prompt ``sample // best_of``): each sample of a
        prompt draws its own random stream, derived from the request's seed when it has one
        (`launcher.samples.rank_params`, as the offline `LLM` derives them)."""
        return rank_params(self.params, sample % self.best_of)


# Fields honoured by both endpoints.
_HONOURED = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "n",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "prompt_logprobs",
    "dp_rank",
    "return_token_ids",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "cache_salt",
    "request_id",
    "allowed_token_ids",
    "bad_words",
    "truncate_prompt_tokens",
    "truncation_side",
}
_COMPLETION_FIELDS = _HONOURED | {"prompt", "best_of", "echo", "add_special_tokens"}
_CHAT_FIELDS = _HONOURED | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "add_generation_prompt",
    "chat_template_kwargs",
    "include_reasoning",
    "continue_final_message",
    "documents",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}
# Fields that do not change what is generated: accepted whatever their value.
_HARMLESS = {
    "user",
    "metadata",
    "store",
    "service_tier",
    "spaces_between_special_tokens",
    "mm_processor_kwargs",
    "kv_transfer_params",
    "vllm_xargs",
}
# field -> the values that mean "not used"; anything else is refused as unsupported here.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    # vLLM refuses a priority without its priority policy, which this scheduler does not have.
    "priority": (None, 0),
    "suffix": (None, ""),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "prompt_embeds": (None,),
    "chat_template": (None,),
    "guided_decoding_backend": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}


def parse_completion(body: Any, limits: ModelLimits) -> GenerationRequest:
    body = _object(body)
    ignored = _check_fields(body, _COMPLETION_FIELDS, limits)
    add_special = _optional_bool(body, "add_special_tokens", True)
    truncate = _truncation(body, limits)
    prompts = _completion_prompts(body, limits, add_special, check_fits=truncate is None)
    prompts = [truncated(prompt, truncate) for prompt in prompts]
    return _generation(body, limits, "completion", prompts, "max_tokens", ignored)


def _truncation(body: dict[str, Any], limits: ModelLimits) -> tuple[int, str] | None:
    """`truncate_prompt_tokens` / `truncation_side` (`launcher.samples.truncation`)."""
    try:
        return truncation(
            body.get("truncate_prompt_tokens"), body.get("truncation_side"), limits.max_model_len
        )
    except ValueError as error:
        name = str(error).split(" ", 1)[0].split("=", 1)[0]
        raise RequestError(str(error), param=name) from None


def parse_chat(body: Any, limits: ModelLimits) -> GenerationRequest:
    body = _object(body)
    ignored = _check_fields(body, _CHAT_FIELDS, limits)
    if limits.tokenizer is None:
        raise RequestError("chat needs the model's tokenizer", param="messages")
    messages = _messages(body)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError(
            f"chat_template_kwargs must be an object, got {shorten(kwargs)}",
            param="chat_template_kwargs",
        )
    try:
        tools = parse_tools(
            body, auto_enabled=limits.enable_auto_tool_choice, parser=limits.tool_call_parser
        )
    except ToolError as error:
        raise RequestError(str(error), param=error.param) from None
    if tools is not None and tools.grammar is not None:
        if _grammar_asked(body):
            raise RequestError(
                f"tool_choice {tools.mode} constrains the reply itself; give no structured "
                "output with it",
                param="tool_choice",
            )
        if limits.grammar_tokenizer is None:
            raise RequestError(
                f"tool_choice {tools.mode} needs the model's tokenizer.json", param="tool_choice"
            )
        _check_compiles(tools.grammar, limits, "the tools' parameters do not compile", "tools")
    extra = {"tools": tools.template_tools()} if tools is not None else {}
    documents = body.get("documents")
    if documents is not None:  # retrieval documents, for the templates that show them
        if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
            raise RequestError("documents must be a list of objects", param="documents")
        extra["documents"] = documents
    try:
        continuing = _optional_bool(body, "continue_final_message", False)
        text = limits.tokenizer.render_chat(
            messages,
            add_generation_prompt=_optional_bool(body, "add_generation_prompt", not continuing),
            continue_final_message=continuing,
            **{**(kwargs or {}), **extra},
        )
    except ValueError as error:
        raise RequestError(str(error), param="messages") from None
    truncate = _truncation(body, limits)
    if truncate is None:
        _check_text_fits(text, limits, "messages")
    prompt = truncated(limits.tokenizer.encode(text, add_special_tokens=False), truncate)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    if key is not None and body.get("max_tokens") is not None:
        raise RequestError(
            "give max_completion_tokens or max_tokens, not both", param="max_completion_tokens"
        )
    generation = _generation(
        body, limits, "chat", [prompt], key or "max_tokens", ignored, tools=tools
    )
    return _grammar_after_thinking(generation, limits, prompt)


def _grammar_after_thinking(
    generation: GenerationRequest, limits: ModelLimits, prompt: list[int]
) -> GenerationRequest:
    """With a reasoning parser, a reply that thinks first is constrained only after its
    `</think>` (vLLM's rule: the grammar is for the answer). A reply thinks first under
    deepseek_r1 always, under qwen3 unless the prompt closed the block already (thinking
    switched off)."""
    params = generation.params
    parser = limits.reasoning_parser
    if parser is None or params.grammar is None or limits.tokenizer is None:
        return generation
    if not thinks_first(parser, prompt_end(limits.tokenizer, prompt)):
        return generation
    marker = tuple(limits.tokenizer.encode(CLOSE, add_special_tokens=False))
    return replace(generation, params=replace(params, grammar_after=marker))


# -- the shared part ----------------------------------------------------------------------------
def _generation(
    body: dict[str, Any],
    limits: ModelLimits,
    endpoint: str,
    prompts: list[list[int]],
    max_tokens_key: str,
    ignored: tuple[str, ...],
    *,
    tools: Tools | None = None,
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
    refuse_unsupported(body, _NEUTRAL)
    param = "messages" if endpoint == "chat" else "prompt"
    longest = max(len(prompt) for prompt in prompts)
    room = limits.max_model_len - longest
    if room < 1:
        raise RequestError(
            f"the prompt has {longest} tokens; max_model_len is {limits.max_model_len}, "
            "which leaves no room for output",
            param=param,
        )
    max_tokens = body.get(max_tokens_key)
    if max_tokens is None:
        default = COMPLETION_DEFAULT_MAX_TOKENS if endpoint == "completion" else room
        max_tokens = min(default, room)
    else:
        _int(max_tokens, max_tokens_key, minimum=1)
        if max_tokens > room:
            raise RequestError(
                f"{max_tokens_key} is {max_tokens}, but the prompt's {longest} tokens leave "
                f"{room} of max_model_len {limits.max_model_len}",
                param=max_tokens_key,
            )
    n, best_of = _choices(body, len(prompts))
    stream = _optional_bool(body, "stream", False)
    if stream and best_of > n:
        raise RequestError("best_of > n cannot stream: the best is known only at the end",
                           param="best_of")  # fmt: skip
    logprobs = _logprobs(body, endpoint)
    echo = endpoint == "completion" and _optional_bool(body, "echo", False)
    prompt_logprobs = _optional_count(body, "prompt_logprobs", MAX_TOP_LOGPROBS)
    if echo and logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = logprobs  # echoed prompt tokens come with their logprobs
    stop, stop_ids = _stops(body, limits)
    ignore_eos = _optional_bool(body, "ignore_eos", False)
    if not ignore_eos and limits.tokenizer is not None:
        # End-of-turn ids the engine does not know (generation_config.json, the tokenizer's
        # eos_token); ignore_eos leaves them out like the engine's own EOS ids.
        stop_ids |= limits.tokenizer.eos_token_ids
    if not ignore_eos:
        stop_ids |= limits.defaults.eos_token_ids  # the generation_config setting's file
    # best_of ranks the samples by cumulative logprob: they need the sampled token's.
    sample_logprobs = logprobs if logprobs is not None else (0 if best_of > n else None)
    params = _sampling_params(
        body, max_tokens, stop_ids, ignore_eos, sample_logprobs, prompt_logprobs, limits,
        grammar=tools.grammar if tools is not None else None,
    )  # fmt: skip
    include_usage, continuous = _stream_options(body, stream)
    dp_rank = body.get("dp_rank")
    if dp_rank is not None and (not _is_int(dp_rank) or not 0 <= dp_rank < limits.num_ranks):
        raise RequestError(
            f"dp_rank must be an int in [0, {limits.num_ranks}) or null, got {shorten(dp_rank)}",
            param="dp_rank",
        )
    return GenerationRequest(
        endpoint=endpoint,
        prompts=prompts,
        n=n,
        best_of=best_of,
        params=params,
        stop=stop,
        include_stop_str_in_output=_optional_bool(body, "include_stop_str_in_output", False),
        # A tool-call parser reads markers that may be special tokens: kept (vLLM's rule).
        skip_special_tokens=_optional_bool(body, "skip_special_tokens", True)
        and (tools is None or tools.mode != "auto"),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        dp_rank=dp_rank,
        return_token_ids=_optional_bool(body, "return_token_ids", False),
        echo=echo,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        ignored_fields=ignored,
        model=model,
        include_reasoning=_optional_bool(body, "include_reasoning", True),
        tools=tools,
        client_request_id=_client_request_id(body.get("request_id"), "request_id"),
    )


def _client_request_id(value: Any, param: str) -> str | None:
    """A client's id for its request (vLLM's `request_id` field or `X-Request-Id` header):
    printable ASCII, at most 128 characters. It names the reply, never a rank's request (two
    clients may send the same one)."""
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= 128
        or not all(" " < c <= "~" for c in value)
    ):
        raise RequestError(
            f"{param} must be 1-128 printable ASCII characters without spaces, got "
            f"{shorten(value)}",
            param=param,
        )
    return value


def client_request_id(header: str | None) -> str | None:
    """The `X-Request-Id` header's id (checked as the field's)."""
    return _client_request_id(header, "X-Request-Id")


def refuse_unsupported(body: dict[str, Any], neutral: dict[str, tuple[Any, ...]]) -> None:
    """A 400 naming the first field of ``neutral`` the body gives at another value than the
    ones listed for it (those that mean "not used")."""
    for name, values in neutral.items():
        if name in body and not any(_same(body[name], value) for value in values):
            allowed = " or ".join(repr(v) for v in values if v is not None) or "null"
            raise RequestError(
                f"{name}={shorten(body[name])} is not supported by this server "
                f"(allowed: {allowed})",
                param=name,
            )


def _choices(body: dict[str, Any], num_prompts: int) -> tuple[int, int]:
    n = body.get("n")
    n = 1 if n is None else n
    _int(n, "n", minimum=1)
    best_of = body.get("best_of")
    best_of = n if best_of is None else best_of
    _int(best_of, "best_of", minimum=1)
    if best_of < n:
        raise RequestError(f"best_of ({best_of}) must be >= n ({n})", param="best_of")
    if num_prompts * best_of > MAX_CHOICES:
        raise RequestError(
            f"{num_prompts} prompt(s) x {best_of} samples is more than this server takes in "
            f"one request ({MAX_CHOICES})",
            param="best_of" if best_of > n else "n",
        )
    return n, best_of


def _logprobs(body: dict[str, Any], endpoint: str) -> int | None:
    """Top logprobs per output token: completions' `logprobs` is that count; chat's
    `logprobs` is a bool and `top_logprobs` the count."""
    if endpoint == "completion":
        return _optional_count(body, "logprobs", MAX_TOP_LOGPROBS)
    wanted = _optional_bool(body, "logprobs", False)
    top = _optional_count(body, "top_logprobs", MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def _optional_count(body: dict[str, Any], name: str, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value <= high:
        raise RequestError(
            f"{name} must be an int in [0, {high}] or null, got {shorten(value)}", param=name
        )
    return value


def _sampling_params(
    body: dict[str, Any],
    max_tokens: int,
    stop_ids: set[int],
    ignore_eos: bool,
    logprobs: int | None,
    prompt_logprobs: int | None,
    limits: ModelLimits,
    grammar: str | None = None,
) -> SamplingParams:
    # A field the request leaves out takes the model's default (generation_config.json, else
    # vLLM's: temperature 1.0, no filters), each on its own, as vLLM's server does.
    defaults = limits.defaults
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
    min_tokens = body.get("min_tokens")
    min_tokens = 0 if min_tokens is None else min_tokens
    _int(min_tokens, "min_tokens", minimum=0)
    if min_tokens > max_tokens:
        raise RequestError(
            f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})", param="min_tokens"
        )
    values = {
        "min_p": _number(body, "min_p", 0.0, low=0.0, high=1.0),
        "presence_penalty": _number(body, "presence_penalty", 0.0, low=-2.0, high=2.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, low=-2.0, high=2.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, low=0.01, high=100.0),
    }
    if grammar is None:
        grammar = _grammar(body, limits)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=top_k,
            seed=seed,
            stop_token_ids=frozenset(stop_ids),
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            logit_bias=_logit_bias(body, limits),
            allowed_token_ids=_allowed_token_ids(body, limits),
            cache_salt=body.get("cache_salt"),
            bad_words=body.get("bad_words") or (),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            grammar=grammar,
            **values,
        )
    except ValueError as error:  # what only SamplingParams checks; its message names the field
        raise RequestError(str(error)) from None
    try:
        return with_bad_words(params, limits.tokenizer)
    except ValueError as error:
        raise RequestError(str(error), param="bad_words") from None


def _allowed_token_ids(body: dict[str, Any], limits: ModelLimits) -> list[int] | None:
    allowed = body.get("allowed_token_ids")
    if allowed is None:
        return None
    if not isinstance(allowed, list) or not allowed or not all(_is_int(t) for t in allowed):
        raise RequestError(
            f"allowed_token_ids must be a non-empty list of token ids, got {shorten(allowed)}",
            param="allowed_token_ids",
        )
    outside = [t for t in allowed if not 0 <= t < limits.vocab_size]
    if outside:
        raise RequestError(
            f"allowed_token_ids holds {outside[0]}, outside the vocabulary "
            f"[0, {limits.vocab_size})",
            param="allowed_token_ids",
        )
    return allowed


# vLLM's guided_* fields and the kind of constraint each gives (`structured.grammar_from`).
_GUIDED = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "lark"),
)


def _format_asked(body: dict[str, Any]) -> bool:
    """Whether `response_format` asks for something other than plain text."""
    response_format = body.get("response_format")
    return response_format is not None and response_format != {"type": "text"}


def _grammar_asked(body: dict[str, Any]) -> bool:
    """Whether the body asks for structured output in any of its spellings."""
    asked = any(body.get(name) is not None for name, _ in _GUIDED)
    return asked or _format_asked(body) or body.get("structured_outputs") is not None


def _check_compiles(grammar: str, limits: ModelLimits, what: str, param: str) -> None:
    """A 400 (``what``: llguidance's reason) where ``grammar`` does not compile against the
    model's tokenizer."""
    from dist_engine.engine import structured

    problem = structured.check_grammar(grammar, limits.grammar_tokenizer)
    if problem:
        raise RequestError(f"{what}: {shorten(problem, 300)}", param=param)


def _grammar(body: dict[str, Any], limits: ModelLimits) -> str | None:
    """Structured output, in OpenAI's and vLLM's spellings, as one llguidance grammar:
    `response_format` (json_object, json_schema), vLLM's `guided_json` / `guided_regex` /
    `guided_choice` / `guided_grammar` (Lark), and `structured_outputs` {json, regex, choice,
    grammar, json_object}. At most one may be given; it must compile against the model."""
    from dist_engine.engine import structured

    asked: list[tuple[str, Any]] = []
    response_format = body.get("response_format")
    if _format_asked(body):
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            asked.append(("response_format", ("json", {"type": "object"})))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise RequestError(
                    "response_format json_schema needs json_schema.schema (an object)",
                    param="response_format",
                )
            asked.append(("response_format", ("json", schema)))
        else:
            raise RequestError(
                f"response_format type must be text, json_object or json_schema, got "
                f"{shorten(kind)}",
                param="response_format",
            )
    for name, kind in _GUIDED:
        if body.get(name) is not None:
            asked.append((name, (kind, body[name])))
    outputs = body.get("structured_outputs")
    json_options: dict[str, Any] = {}
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise RequestError("structured_outputs must be an object", param="structured_outputs")
        try:  # vLLM's StructuredOutputsParams, its checks and its whitespace options
            params = StructuredOutputsParams(**outputs)
        except (TypeError, ValueError) as error:
            message = str(error).replace("__init__() ", "")
            raise RequestError(
                f"structured_outputs: {shorten(message, 300)}", param="structured_outputs"
            ) from None
        kind, spec = params.constraint()
        key = next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                   if getattr(params, k) is not None)  # fmt: skip
        asked.append((f"structured_outputs.{key}", (kind, spec)))
        json_options = params.json_options()
    if not asked:
        return None
    if len(asked) > 1:
        raise RequestError(
            f"give one structured output, got {[name for name, _ in asked]}", param=asked[1][0]
        )
    ((name, (kind, spec)),) = asked
    if limits.grammar_tokenizer is None:
        raise RequestError("structured output needs the model's tokenizer.json", param=name)
    try:
        grammar = structured.grammar_from(kind, spec, **json_options)
    except (ValueError, TypeError) as error:  # llguidance's and json's messages name the spot
        raise RequestError(f"{name}: {shorten(str(error), 300)}", param=name) from None
    _check_compiles(grammar, limits, f"{name} does not compile", name)
    return grammar


def _logit_bias(body: dict[str, Any], limits: ModelLimits) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids as JSON object keys (strings), biases in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise RequestError(
            f"logit_bias must be an object of token id -> bias, got {shorten(bias)}",
            param="logit_bias",
        )
    parsed = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else None
        if token is None or not 0 <= token < limits.vocab_size:
            raise RequestError(
                f"logit_bias key {shorten(key)} is not a token id in [0, {limits.vocab_size})",
                param="logit_bias",
            )
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
            or not -100 <= value <= 100
        ):
            raise RequestError(
                f"logit_bias[{key}] must be a number in [-100, 100], got {shorten(value)}",
                param="logit_bias",
            )
        parsed[token] = float(value)
    return parsed


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


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) from stream_options."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise RequestError("stream_options needs stream: true", param="stream_options")
    allowed = {"include_usage", "continuous_usage_stats"}
    if not isinstance(options, dict) or set(options) - allowed:
        raise RequestError(
            f"stream_options must be an object with include_usage and/or "
            f"continuous_usage_stats, got {shorten(options)}",
            param="stream_options",
        )
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name, False)
        if value is None:
            value = False
        if not isinstance(value, bool):
            raise RequestError(
                f"stream_options.{name} must be true or false, got {shorten(value)}",
                param=f"stream_options.{name}",
            )
        flags.append(value)
    return flags[0], flags[1]


def _completion_prompts(
    body: dict[str, Any], limits: ModelLimits, add_special_tokens: bool, *, check_fits: bool
) -> list[list[int]]:
    """`prompt`: a string, a list of token ids, or a batch (a list of strings or of id lists)."""
    if "prompt" not in body:
        raise RequestError("prompt is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(_is_int(t) for t in prompt)):
        batch, where = [prompt], lambda index: "prompt"
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        batch, where = prompt, lambda index: f"prompt[{index}]"
    else:
        raise RequestError(
            f"prompt must be a string, a list of token ids, or a list of those, got "
            f"{shorten(prompt)}",
            param="prompt",
        )
    if len(batch) > MAX_CHOICES:
        raise RequestError(
            f"prompt holds {len(batch)} prompts; this server takes at most {MAX_CHOICES} in "
            "one request",
            param="prompt",
        )
    return [
        _one_prompt(item, limits, where(index), add_special_tokens, check_fits)
        for index, item in enumerate(batch)
    ]


def _one_prompt(
    prompt: Any, limits: ModelLimits, param: str, add_special_tokens: bool, check_fits: bool
) -> list[int]:
    if isinstance(prompt, str):
        if limits.tokenizer is None:
            raise RequestError(
                "text prompts need the model's tokenizer; send token ids", param=param
            )
        if check_fits:  # a prompt to be truncated may be longer
            _check_text_fits(prompt, limits, param)
        tokens = limits.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
        if bad:
            raise RequestError(
                f"{param} token id {bad[0]} at position {prompt.index(bad[0])} is outside the "
                f"vocabulary [0, {limits.vocab_size})",
                param=param,
            )
        tokens = list(prompt)
    else:
        raise RequestError(
            f"{param} must be a string or a list of token ids, got {shorten(prompt)}",
            param=param,
        )
    if not tokens:
        raise RequestError(f"{param} is empty", param=param)
    return tokens


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """A conversation as the chat template gets it (`_messages`), for callers outside a
    request (`LLM.chat`); ValueError naming the message that is wrong."""
    try:
        return _messages({"messages": messages})
    except RequestError as error:
        raise ValueError(str(error)) from None


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation for the chat template: each message's content as one string (text
    parts joined); its other fields (name, tool_calls, tool_call_id, ...) passed on as they are,
    since templates read them."""
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
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(
                f"{where}.role must be one of {list(CHAT_ROLES)}, got {shorten(role)}",
                param=f"{where}.role",
            )
        content = message.get("content")
        if content is None and role != "assistant":
            raise RequestError(f"{where}.content is required", param=f"{where}.content")
        result.append({**message, "content": _content(content, where)})
    return result


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or a list of text parts (joined); an assistant message
    that only calls tools has none."""
    if content is None:
        return ""
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


# -- /tokenize and /detokenize (vLLM's) ---------------------------------------------------------
def tokenize_body(body: Any, limits: ModelLimits) -> list[int]:
    """`/tokenize`: {"prompt": text, "add_special_tokens"?} or {"messages": [...],
    "add_generation_prompt"?, "chat_template_kwargs"?} -> the token ids."""
    body = _object(body)
    assert limits.tokenizer is not None
    if "messages" in body:
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RequestError(
                "chat_template_kwargs must be an object", param="chat_template_kwargs"
            )
        try:
            text = limits.tokenizer.render_chat(
                _messages(body),
                add_generation_prompt=_optional_bool(body, "add_generation_prompt", True),
                **kwargs,
            )
        except ValueError as error:
            raise RequestError(str(error), param="messages") from None
        return limits.tokenizer.encode(
            text, add_special_tokens=_optional_bool(body, "add_special_tokens", False)
        )
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise RequestError(
            f"prompt must be a string (or give messages), got {shorten(prompt)}", param="prompt"
        )
    return limits.tokenizer.encode(
        prompt, add_special_tokens=_optional_bool(body, "add_special_tokens", True)
    )


def detokenize_body(body: Any, limits: ModelLimits) -> list[int]:
    """`/detokenize`: {"tokens": [ids]} -> the ids, checked against the vocabulary."""
    body = _object(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        _is_int(t) and 0 <= t < limits.vocab_size for t in tokens
    ):
        raise RequestError(
            f"tokens must be a list of token ids in [0, {limits.vocab_size}), got "
            f"{shorten(tokens)}",
            param="tokens",
        )
    return tokens


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


def _check_fields(body: dict[str, Any], honoured: set[str], limits: ModelLimits) -> tuple[str, ...]:
    """The body's unknown fields (to warn about), or a 400 naming them when requests are
    strict. Fields at their neutral value and harmless fields are known."""
    known = honoured | _HARMLESS | set(_NEUTRAL)
    unknown = tuple(sorted(name[:80] for name in set(body) - known))
    if unknown and limits.strict_requests:
        raise RequestError(
            f"unrecognized request argument(s): {shorten(list(unknown))}; supported: "
            f"{sorted(honoured)} (server.strict_requests is on)",
            param=unknown[0],
        )
    return unknown


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
