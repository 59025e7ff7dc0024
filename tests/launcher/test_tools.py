"""Tool calling on /v1/chat/completions (launcher/server/tools.py): the hermes reader on its
own, and a server driven by the official `openai` client, its replies forced (a regex, or the
tool_choice grammar itself) so that what the reply must be is known."""

from __future__ import annotations

import json
import re

import openai
import pytest
from server_harness import ServerThread

from dist_engine.engine.config import EngineConfig
from launcher.server.config import ServerConfig
from launcher.server.tools import ToolCallReader, ToolError, Tools, finish_reason, parse_tools

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
    content, calls, reasons = "", [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
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


def test_an_auto_tool_request_keeps_special_tokens_in_its_text():
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
