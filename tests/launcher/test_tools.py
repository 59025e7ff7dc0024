"""Tool calling on /v1/chat/completions (launcher/server/tools.py): each parser's reader on
its own, and servers driven by the official `openai` client, their replies forced (a regex,
or the tool_choice grammar itself) so that what the reply must be is known."""

from __future__ import annotations

import json
import random
import re

import openai
import pytest
from server_harness import ServerThread

from dist_engine.engine.config import EngineConfig
from launcher.server.config import ServerConfig
from launcher.server.tools import (
    TOOL_CALL_PARSERS,
    ToolCallReader,
    ToolError,
    Tools,
    finish_reason,
    parse_tools,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
AUTO = Tools((WEATHER,), "auto", parser="hermes")


def _read(tools: Tools, pieces: list[str]) -> tuple[str, list]:
    reader = ToolCallReader(tools)
    shown = "".join(reader.feed(piece) for piece in pieces)
    rest, calls = reader.finish()
    return shown + rest, calls


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_hermes_blocks_become_calls_and_the_text_before_them_content(size):
    text = (
        'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>'
    )
    content, calls = _read(AUTO, [text[i : i + size] for i in range(0, len(text), size)])
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", c.id) for c in calls)
    assert len({c.id for c in calls}) == 2
    one = Tools((WEATHER,), "auto", parser="hermes", parallel=False)  # parallel_tool_calls false
    assert [c.name for c in _read(one, [text])[1]] == ["get_weather"]


def test_text_without_calls_or_with_calls_that_do_not_parse_is_content():
    assert _read(AUTO, ["just ", "an answer <tool", "s>"]) == ("just an answer <tools>", [])
    broken = 'x<tool_call>{"name": "get_weather", "arguments": {"city": '
    assert _read(AUTO, [broken]) == (broken, [])  # cut off by max_tokens: no call
    unclosed = 'y<tool_call>{"name": "get_time", "arguments": {}}'
    content, calls = _read(AUTO, [unclosed])
    assert content == "y" and [c.name for c in calls] == ["get_time"]


def test_named_and_required_replies_are_the_calls_themselves():
    named = Tools((WEATHER,), "named", name="get_weather", grammar="g")
    content, calls = _read(named, ['{"city": ', '"Rome"}'])
    assert content == "" and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Rome"}')
    ]
    required = Tools((WEATHER, TIME), "required", grammar="g")
    text = (
        '[{"name": "get_time", "parameters": {}}, '
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    )
    content, calls = _read(required, [text])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert _read(required, ['[{"name": "get_t']) == ('[{"name": "get_t', [])
    assert finish_reason(required, "stop", calls) == "tool_calls"
    assert finish_reason(named, "stop", calls) == "stop"  # OpenAI's, for a forced function
    assert finish_reason(AUTO, "length", calls) == "length"
    assert finish_reason(AUTO, "stop", []) == "stop"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tool_choice": "auto"}, "tool_choice needs tools"),
        ({"tools": {"a": 1}}, "tools must be a list"),
        ({"tools": [{"type": "function"}]}, r"tools\[0\] must be"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "names 'x', which is not in tools",
        ),
    ],
)
def test_bad_tools_are_refused_naming_the_field(body, message):
    with pytest.raises(ToolError, match=message):
        parse_tools(body, auto_enabled=True, parser="hermes")


def test_the_servers_parser_is_one_of_vllms_names():
    assert set(TOOL_CALL_PARSERS) == {
        "hermes", "deepseek_v3", "deepseek_v31", "kimi_k2", "qwen3_coder", "glm45", "mistral"
    }  # fmt: skip
    for parser in TOOL_CALL_PARSERS:
        config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser=parser)
        assert config.tool_call_parser == parser
    with pytest.raises(ValueError, match=r"server\.tool_call_parser must be one of .*'glm45'"):
        ServerConfig(enable_auto_tool_choice=True, tool_call_parser="llama3_json")


def test_auto_needs_the_server_to_allow_it_as_vllm_does():
    with pytest.raises(ToolError, match="--enable-auto-tool-choice"):
        parse_tools({"tools": [WEATHER]}, auto_enabled=False, parser=None)
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}, auto_enabled=False,
                       parser=None).mode == "none"  # fmt: skip
    with pytest.raises(ValueError, match=r"enable_auto_tool_choice needs server\.tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)


# -- the server --------------------------------------------------------------------------------
ENGINE = {
    "dtype": "float32",
    "parallel": {"dp_size": 1, "launcher": "local", "threads_per_rank": 1},
    "scheduler": {"max_num_seqs": 8, "max_model_len": 512, "num_blocks": 512, "block_size": 8},
}
# A template that shows the tools as Qwen's does (through tojson), and the messages.
TEMPLATE = (
    "{% if documents %}<docs>{{ documents | tojson }}</docs>\n{% endif %}"
    "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
FORCED_CALL = (
    r'Let me check\.<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[a-z]{4}"\}\}\n</tool_call>'
)
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def servers(model_dir):
    engine = EngineConfig.from_dict({"model": model_dir, **ENGINE})
    config = ServerConfig(port=0, served_model_name="tiny", chat_template=TEMPLATE)
    tooled = ServerThread(
        engine, config.with_overrides(enable_auto_tool_choice=True, tool_call_parser="hermes")
    )
    plain = ServerThread(engine, config)
    yield (
        openai.OpenAI(base_url=f"{tooled.url}/v1", api_key="none", max_retries=0),
        openai.OpenAI(base_url=f"{plain.url}/v1", api_key="none", max_retries=0),
    )
    tooled.stop()
    plain.stop()


def _chat(client, max_tokens=80, temperature=1.0, **extra):
    return client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=max_tokens, temperature=temperature, seed=4, **extra
    )


def test_auto_replies_carry_the_models_calls_whole_and_streamed(servers):
    tooled, plain = servers
    forced = {"extra_body": {"structured_outputs": {"regex": FORCED_CALL}}}
    # The same request to a server without a parser: the same prompt, so the same reply, unread.
    raw = _chat(plain, tools=[WEATHER], tool_choice="none", **forced).choices[0].message.content
    city = re.search(r'"city": "([a-z]{4})"', raw).group(1)
    reply = _chat(tooled, tools=[WEATHER], **forced).choices[0]
    assert reply.finish_reason == "tool_calls"
    assert reply.message.content == "Let me check."
    (call,) = reply.message.tool_calls
    assert (call.type, call.function.name) == ("function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": city}
    stream = _chat(tooled, tools=[WEATHER], stream=True, **forced)
    content, calls, reasons = _streamed(stream)
    assert content == "Let me check." and reasons[-1] == "tool_calls"
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": city})
    ]
    # The prompt shows the tools (JSON as transformers' tojson writes it, '<' unescaped).
    assert (
        _chat(tooled, tools=[WEATHER], **forced).usage.prompt_tokens
        > _chat(tooled, **forced).usage.prompt_tokens
    )
    # "none": the tools are shown, the reply is not read.
    untouched = _chat(tooled, tools=[WEATHER], tool_choice="none", **forced).choices[0]
    assert untouched.message.content == raw and not untouched.message.tool_calls


def test_named_and_required_tool_choice_constrain_the_reply_to_calls(servers):
    tooled, plain = servers
    named = {"type": "function", "function": {"name": "get_weather"}}
    for client in (tooled, plain):  # no parser needed: the grammar makes the reply a call
        reply = _chat(client, tools=[WEATHER, TIME], tool_choice=named).choices[0]
        (call,) = reply.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and set(arguments) == {"city"}
        assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 6
        assert reply.finish_reason == "stop" and reply.message.content is None
    reply = _chat(plain, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120)
    choice = reply.choices[0]
    if choice.message.tool_calls:  # the list closed within the budget
        assert choice.finish_reason in ("tool_calls", "length") and not choice.message.content
        for call in choice.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert call.function.name in ("get_weather", "get_time")
            assert (
                arguments == {} if call.function.name == "get_time" else set(arguments) == {"city"}
            )
    else:  # a list the budget cut: returned as text, as vLLM returns it
        assert choice.finish_reason == "length" and choice.message.content.startswith("[")
    streamed = _chat(plain, tools=[WEATHER], tool_choice=named, stream=True)
    calls = [c for chunk in streamed for c in (chunk.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]


def test_tool_requests_a_server_cannot_serve_are_400s_naming_the_field(servers):
    tooled, plain = servers
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice") as info:
        _chat(plain, tools=[WEATHER])
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="give no structured output with it"):
        _chat(tooled, tools=[WEATHER], tool_choice="required",
              extra_body={"guided_regex": "a+"})  # fmt: skip


# A small tool (the tiny model's prompt is short): Qwen3-Coder's reply gives its values as text.
DAYS = {
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
FORCED_CODER_CALL = (
    r"Let me check\.\n<tool_call>\n<function=forecast>\n<parameter=city>\n[a-z]{4}\n"
    r"</parameter>\n<parameter=days>\n[1-9]\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def coder(model_dir):
    engine = EngineConfig.from_dict({"model": model_dir, **ENGINE})
    config = ServerConfig(
        port=0,
        served_model_name="tiny",
        chat_template=TEMPLATE,
        enable_auto_tool_choice=True,
        tool_call_parser="qwen3_coder",
    )
    server = ServerThread(engine, config)
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    server.stop()


def _streamed(stream):
    """A streamed chat reply's content, tool-call deltas and finish reasons, chunk by chunk."""
    content, calls, reasons = "", [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
    return content, calls, reasons


def test_a_qwen3_coder_server_reads_its_calls_with_the_requests_types(coder):
    forced = {"extra_body": {"structured_outputs": {"regex": FORCED_CODER_CALL}}}
    reply = _chat(coder, max_tokens=200, tools=[DAYS], **forced).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content == "Let me check.\n"
    (call,) = reply.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "forecast" and set(arguments) == {"city", "days"}
    assert re.fullmatch("[a-z]{4}", arguments["city"]) and arguments["days"] in range(1, 10)
    stream = _chat(coder, max_tokens=200, tools=[DAYS], stream=True, **forced)
    content, calls, reasons = _streamed(stream)
    assert content == "Let me check.\n" and reasons[-1] == "tool_calls"
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "forecast", arguments)  # the same seed: the same reply
    ]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_deepseek_v3_and_v31_calls_are_read_from_their_markers(size):
    v3 = (
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
        "<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    v31 = (
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    for parser, text in (("deepseek_v3", v3), ("deepseek_v31", v31)):
        tools = Tools((WEATHER, TIME), "auto", parser=parser)
        content, calls = _read(tools, [text[i : i + size] for i in range(0, len(text), size)])
        assert content == "Sure."
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Oslo"}),
            ("get_time", {}),
        ]
    # One parser's format is not the other's: no calls, the text is content.
    tools = Tools((WEATHER,), "auto", parser="deepseek_v31")
    assert _read(tools, [v3.replace("```json\n{}", "```json\n{")]) == (
        v3.replace("```json\n{}", "```json\n{"),
        [],
    )


# -- kimi_k2, qwen3_coder, glm45, mistral -------------------------------------------------------
# Each parser's reply: text, then a call of get_weather and one of get_time, in the model's
# own format (its chat template's), and the content the text before the calls makes.
REPLIES = {
    "kimi_k2": (
        "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>\n<|tool_call_begin|>'
        "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>",
        "Sure.",
    ),
    "qwen3_coder": (
        "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "Sure.\n",
    ),
    "glm45": (
        "Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
        "</tool_call>\n<tool_call>get_time\n</tool_call>",
        "Sure.",
    ),
    # Mixtral-8x22B-Instruct-v0.1's (tokenizer v3): one JSON list.
    "mistral": (
        '[Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "[Sure.",
    ),
}
# Newer Mistral tokenizers' (v11+, their HF templates): NAME[ARGS]{...} per call.
MISTRAL_V11 = (
    'Sure [[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e'
    "[ARGS]{}",
    "Sure [",
)
# Kimi-K2 at times writes its section markers in the singular; the reply reads the same.
KIMI_SINGULAR = (
    REPLIES["kimi_k2"][0]
    .replace("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    .replace("<|tool_calls_section_end|>", "<|tool_call_section_end|>"),
    "Sure.",
)
CASES = [*REPLIES.items(), ("mistral", MISTRAL_V11), ("kimi_k2", KIMI_SINGULAR)]
CASE_IDS = [*REPLIES, "mistral_v11", "kimi_k2_singular"]


def _pieces(text: str, seed: int) -> list[str]:
    rng, pieces, at = random.Random(seed), [], 0
    while at < len(text):
        size = rng.randint(1, 5)
        pieces.append(text[at : at + size])
        at += size
    return pieces


@pytest.mark.parametrize(("parser", "reply"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_each_parsers_calls_are_read_whole_or_in_small_pieces(parser, reply, seed):
    text, content = reply
    tools = Tools((WEATHER, TIME), "auto", parser=parser)
    reader = ToolCallReader(tools)
    shown = ""
    for piece in [text] if seed is None else _pieces(text, seed):
        shown += reader.feed(piece)
        assert content.startswith(shown), shown  # no part of a marker is ever shown
    rest, calls = reader.finish()
    assert shown + rest == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2
    one = Tools((WEATHER, TIME), "auto", parser=parser, parallel=False)
    assert [c.name for c in _read(one, [text])[1]] == ["get_weather"]


def test_kimi_calls_keep_the_models_ids_and_mistral_calls_get_mistral_ids():
    kimi = _read(Tools((WEATHER,), "auto", parser="kimi_k2"), [REPLIES["kimi_k2"][0]])[1]
    assert [c.id for c in kimi] == ["functions.get_weather:0", "functions.get_time:1"]
    for text in (REPLIES["mistral"][0], MISTRAL_V11[0]):
        calls = _read(Tools((WEATHER,), "auto", parser="mistral"), [text])[1]
        assert all(re.fullmatch(r"[0-9A-Za-z]{9}", c.id) for c in calls) and len(calls) == 2
    # Ids the model repeats (or leaves out) are not kept: the call gets one of ours.
    twice = REPLIES["kimi_k2"][0].replace("functions.get_time:1", "functions.get_weather:0")
    calls = _read(Tools((WEATHER,), "auto", parser="kimi_k2"), [twice])[1]
    assert [c.name for c in calls] == ["get_weather", "get_weather"]
    assert all(c.id.startswith("chatcmpl-tool-") for c in calls)
    bare = "<|tool_calls_section_begin|><|tool_call_begin|>get_time<|tool_call_argument_begin|>{}"
    calls = _read(Tools((TIME,), "auto", parser="kimi_k2"), [bare + "<|tool_call_end|>"])[1]
    assert [c.name for c in calls] == ["get_time"] and calls[0].id.startswith("chatcmpl-tool-")


@pytest.mark.parametrize(("parser", "reply"), CASES, ids=CASE_IDS)
def test_a_cut_off_or_malformed_reply_is_all_content(parser, reply):
    text, _ = reply
    tools = Tools((WEATHER, TIME), "auto", parser=parser)
    cut = text[: text.index("Oslo") + 2]  # max_tokens ended it inside the first call
    assert _read(tools, _pieces(cut, 3)) == (cut, [])
    ends = {"kimi_k2": "<|tool_call_end|>", "qwen3_coder": "</function>", "glm45": "</tool_call>"}
    last = text[: text.rindex(ends[parser])] if parser in ends else text[:-1]  # the 2nd cut
    assert _read(tools, [last]) == (last, [])
    # Text alone, a marker's start in it, is content.
    opening = {"kimi_k2": "<|tool_calls", "mistral": "[TOOL_CA"}.get(parser, "<tool_ca")
    assert _read(tools, _pieces(f"a {opening} b", 4)) == (f"a {opening} b", [])


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (
            "kimi_k2",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
            "<|tool_call_argument_begin|>{city: Oslo}<|tool_call_end|>",
        ),
        ("kimi_k2", "<|tool_calls_section_begin|>functions.f:0<|tool_call_argument_begin|>{}"),
        ("qwen3_coder", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
        ("qwen3_coder", "<tool_call>\n<function=get_time>\nnow\n</function>\n</tool_call>"),
        ("glm45", "<tool_call>get time\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"),
        ("glm45", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
        ("mistral", '[TOOL_CALLS]get_time[ARGS]{"a": 1} and more'),
        ("mistral", '[TOOL_CALLS] {"name": "get_time", "arguments": {}}'),
        ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": [1]}]'),
    ],
)
def test_calls_not_in_the_parsers_format_are_content(parser, text):
    tools = Tools((WEATHER, TIME), "auto", parser=parser)
    assert _read(tools, ["x", text]) == ("x" + text, [])


FORECAST = {
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "hours": {"type": "number"},
                "metric": {"type": "boolean"},
                "where": {"type": "object"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "zip": {"type": "string"},
                "id": {"type": ["integer", "string"]},
                "note": {"type": ["string", "null"]},
            },
        },
    },
}
# Each value as the model writes it (text), and what the arguments carry: by the declared type.
VALUES = {
    "city": ("Oslo", "Oslo"),
    "days": ("3", 3),
    "hours": ("2.5", 2.5),
    "metric": ("true", True),
    "where": ('{"lat": 59.9, "name": "Øst"}', {"lat": 59.9, "name": "Øst"}),
    "tags": ('["a", "b"]', ["a", "b"]),
    "zip": ("0150", "0150"),  # a string that looks like a number stays a string
    "id": ("7", 7),  # a union: the value where it is JSON of a declared type
    "note": ("12", "12"),
}


def _forecast_reply(parser: str, values: dict[str, str]) -> str:
    if parser == "qwen3_coder":
        parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
        return f"<tool_call>\n<function=forecast>\n{parameters}</function>\n</tool_call>"
    pairs = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in values.items()
    )
    return f"<tool_call>forecast\n{pairs}</tool_call>"


@pytest.mark.parametrize("parser", ["qwen3_coder", "glm45"])
def test_text_values_become_the_types_the_tool_declares(parser):
    tools = Tools((FORECAST,), "auto", parser=parser)
    text = _forecast_reply(parser, {key: written for key, (written, _) in VALUES.items()})
    content, (call,) = _read(tools, _pieces("Let me see." + text, 7))
    assert content == "Let me see." and call.name == "forecast"
    assert json.loads(call.arguments) == {key: value for key, (_, value) in VALUES.items()}
    assert "Øst" in call.arguments  # ensure_ascii=False, as vLLM writes them
    # Values that are not what their type says stay text; Python's True is a boolean;
    # a union with string keeps text where the JSON is of no declared type.
    odd = {"days": "three", "where": "{lat: 1}", "metric": "True", "id": "true", "hours": "NaN"}
    (call,) = _read(tools, [_forecast_reply(parser, odd)])[1]
    assert json.loads(call.arguments) == {
        "days": "three", "where": "{lat: 1}", "metric": True, "id": "true", "hours": "NaN"
    }  # fmt: skip
    # A parameter the tool does not declare: qwen3_coder keeps the text, glm45 reads JSON where
    # it parses (each as vLLM does; glm45 as GLM's own parsing guide does too).
    (call,) = _read(tools, [_forecast_reply(parser, {"extra": "5", "more": "x y"})])[1]
    extra = "5" if parser == "qwen3_coder" else 5
    assert json.loads(call.arguments) == {"extra": extra, "more": "x y"}


def test_qwen3_coder_values_keep_their_own_lines_and_tolerate_an_unclosed_parameter():
    tools = Tools((FORECAST,), "auto", parser="qwen3_coder")
    text = (
        "<tool_call>\n<function=forecast>\n<parameter=city>\n\n  two\nlines \n\n</parameter>\n"
        "<parameter=zip>\n0150\n<parameter=days>\n4\n</function>\n</tool_call>"
    )
    (call,) = _read(tools, [text])[1]
    assert json.loads(call.arguments) == {"city": "\n  two\nlines \n", "zip": "0150", "days": 4}
    # GLM-4.7's form has no whitespace between tags; glm45 reads it too.
    glm = Tools((FORECAST,), "auto", parser="glm45")
    text = "<tool_call>forecast<arg_key>days</arg_key><arg_value> 2 </arg_value></tool_call>"
    assert json.loads(_read(glm, [text])[1][0].arguments) == {"days": 2}


def test_an_auto_tool_request_keeps_special_tokens_in_its_text():
    from dataclasses import replace

    from launcher.server.protocol import ModelLimits, parse_chat

    class Tokenizer:  # renders and encodes; enough for parse_chat
        chat_template = "t"

        def render_chat(self, messages, add_generation_prompt=True, **kwargs):
            return "prompt" + ("+tools" if kwargs.get("tools") else "")

        def encode(self, text, add_special_tokens=True):
            return [1] * len(text)

        def min_num_tokens(self, text):
            return 0

        eos_token_ids = frozenset()

    limits = ModelLimits("tiny", 256, 100, 1, Tokenizer(), enable_auto_tool_choice=True,
                         tool_call_parser="hermes")  # fmt: skip
    base = {"model": "tiny", "messages": ASK, "max_tokens": 4, "temperature": 0}
    assert parse_chat(base, limits).skip_special_tokens
    auto = parse_chat({**base, "tools": [WEATHER]}, limits)
    assert not auto.skip_special_tokens and auto.tools.mode == "auto"
    for parser in TOOL_CALL_PARSERS:  # every parser's markers may be special tokens
        other = parse_chat({**base, "tools": [WEATHER]}, replace(limits, tool_call_parser=parser))
        assert not other.skip_special_tokens and other.tools.parser == parser
    assert len(auto.prompts[0]) == len("prompt+tools")  # the template saw the tools
    assert parse_chat(
        {**base, "tools": [WEATHER], "tool_choice": "none"}, limits
    ).skip_special_tokens


def test_continue_final_message_continues_the_assistants_turn(servers):
    _, plain = servers
    turn = [*ASK, {"role": "assistant", "content": "It is"}]
    reply = plain.chat.completions.create(
        model="tiny", messages=turn, max_tokens=6, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "return_token_ids": True},
    )  # fmt: skip
    cut = "[user] Weather in Oslo?\n[assistant] It is"  # the template's text, cut after "It is"
    same = plain.completions.create(
        model="tiny", prompt=cut, max_tokens=6, temperature=0,
        extra_body={"add_special_tokens": False, "return_token_ids": True},
    )  # fmt: skip
    assert reply.usage.prompt_tokens == same.usage.prompt_tokens
    assert reply.choices[0].token_ids == same.choices[0].token_ids
    with pytest.raises(openai.BadRequestError, match="cannot also open a new one"):
        plain.chat.completions.create(
            model="tiny", messages=turn, max_tokens=2,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )  # fmt: skip


def test_documents_reach_the_template_and_priority_and_cache_salt_are_vllms(servers):
    _, plain = servers
    docs = [{"title": "Oslo", "text": "Cold."}]
    bare = _chat(plain, max_tokens=2).usage.prompt_tokens
    assert _chat(plain, max_tokens=2, extra_body={"documents": docs}).usage.prompt_tokens > bare
    with pytest.raises(openai.BadRequestError, match="documents must be a list of objects"):
        _chat(plain, max_tokens=2, extra_body={"documents": "Oslo"})
    # priority: 0 (or none) only, as vLLM without a priority policy answers.
    assert _chat(plain, max_tokens=2, extra_body={"priority": 0}).choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="priority=1 is not supported"):
        _chat(plain, max_tokens=2, extra_body={"priority": 1})
    # cache_salt changes which cached blocks a request may reuse, never its tokens.
    salted = _chat(plain, temperature=0, extra_body={"cache_salt": "tenant-1"})
    unsalted = _chat(plain, temperature=0)
    assert salted.choices[0].message.content == unsalted.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="cache_salt must be a non-empty string"):
        _chat(plain, max_tokens=2, extra_body={"cache_salt": ""})


def test_a_clients_request_id_names_the_reply_as_vllm_names_it(servers):
    _, plain = servers
    reply = _chat(plain, max_tokens=2, extra_body={"request_id": "my-req-1"})
    assert reply.id == "chatcmpl-my-req-1"
    again = _chat(plain, max_tokens=2, extra_body={"request_id": "my-req-1"})  # reused: fine
    assert again.id == "chatcmpl-my-req-1"
    headed = plain.with_options(default_headers={"X-Request-Id": "trace-7"})
    assert _chat(headed, max_tokens=2).id == "chatcmpl-trace-7"
    completion = plain.completions.create(
        model="tiny", prompt=[1, 2], max_tokens=2, extra_body={"request_id": "c-1"}
    )
    assert completion.id == "cmpl-c-1"
    with pytest.raises(openai.BadRequestError, match="request_id must be 1-128 printable"):
        _chat(plain, max_tokens=2, extra_body={"request_id": "a b\n"})
