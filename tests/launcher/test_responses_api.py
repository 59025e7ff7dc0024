"""`POST /v1/responses` (launcher/server/responses_api.py) driven by the official `openai`
client's `responses` resource, each reply against the same request on /v1/chat/completions
(the path it runs on): the same tokens, whole and streamed, in the Responses API's shapes."""

from __future__ import annotations

import json

import openai
import pytest
from server_harness import ServerThread

from dist_engine.engine.config import EngineConfig
from launcher.server.config import ServerConfig

ENGINE = {
    "dtype": "float32",
    "parallel": {"dp_size": 1, "launcher": "local", "threads_per_rank": 1},
    "scheduler": {"max_num_seqs": 8, "max_model_len": 256, "num_blocks": 256, "block_size": 8},
}


@pytest.fixture(scope="module")
def servers(model_dir):
    engine = EngineConfig.from_dict({"model": model_dir, **ENGINE})
    plain = ServerThread(engine, ServerConfig(port=0, served_model_name="tiny"))
    # qwen3 under a template that closes an empty think block in the prompt: the regex the
    # tests force a think block with applies from the first token (test_reasoning.py).
    no_thinking = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] <think>\n\n</think>\n\n{% endif %}"
    )
    thinking = ServerThread(
        engine,
        ServerConfig(
            port=0, served_model_name="tiny", reasoning_parser="qwen3", chat_template=no_thinking
        ),
    )
    yield (
        openai.OpenAI(base_url=f"{plain.url}/v1", api_key="none", max_retries=0),
        openai.OpenAI(base_url=f"{thinking.url}/v1", api_key="none", max_retries=0),
    )
    plain.stop()
    thinking.stop()


def _chat(client, messages, max_tokens=12, **extra):
    return client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, **extra
    )


def test_a_response_is_the_chat_reply_to_its_instructions_and_input(servers):
    client, _ = servers
    chat = _chat(client, [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Hello there"}])  # fmt: skip
    reply = client.responses.create(
        model="tiny", instructions="Be brief.", input="Hello there", max_output_tokens=12,
        temperature=0, metadata={"k": "v"},
    )  # fmt: skip
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.output_text == chat.choices[0].message.content
    (message,) = reply.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.metadata == {"k": "v"} and reply.instructions == "Be brief."
    assert (reply.status, reply.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    # A list of messages (text parts, the developer role) is the same conversation.
    listed = client.responses.create(
        model="tiny", max_output_tokens=12, temperature=0,
        input=[{"role": "developer", "content": "Be brief."},
               {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Hello there"}]}],
    )  # fmt: skip
    assert listed.output_text == reply.output_text


def test_a_streamed_response_sends_the_event_sequence_with_the_same_text(servers):
    client, _ = servers
    whole = client.responses.create(model="tiny", input="Stream me", max_output_tokens=12,
                                    temperature=0)  # fmt: skip
    stream = client.responses.create(
        model="tiny", input="Stream me", max_output_tokens=12, temperature=0, stream=True
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"  # 12 tokens: cut by max_output_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == whole.output_text
    assert events[-1].response.output[0].content[0].text == whole.output_text
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.content_part.done", "response.output_item.done"):  # fmt: skip
        assert kinds.count(kind) == 1, kind


def test_structured_output_and_reasoning_items(servers):
    plain, thinking = servers
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    reply = plain.responses.create(
        model="tiny", input="json please", max_output_tokens=30, temperature=0,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema}},
    )  # fmt: skip
    if reply.status == "completed":
        assert set(json.loads(reply.output_text)) == {"n"}
    else:
        assert reply.output_text.lstrip().startswith("{")
    # With a reasoning parser the <think> block is a reasoning item before the message.
    forced = {"structured_outputs": {"regex": "<think>[a-z]{5}</think>[a-z]{3}"}}
    chat = _chat(thinking, [{"role": "user", "content": "think"}], 40, extra_body=forced)
    thought = chat.choices[0].message.model_extra["reasoning"]
    reply = thinking.responses.create(
        model="tiny", input="think", max_output_tokens=40, temperature=0, extra_body=forced
    )
    kinds = [item.type for item in reply.output]
    assert kinds == ["reasoning", "message"]
    assert reply.output[0].content[0].text == thought
    assert reply.output_text == chat.choices[0].message.content
    stream = thinking.responses.create(
        model="tiny", input="think", max_output_tokens=40, temperature=0, extra_body=forced,
        stream=True,
    )  # fmt: skip
    events = list(stream)
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        reply.output_text
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"input": [{"type": "computer_call_output", "output": {}}]}, "input[0]"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0]"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_this_server_does_not_do_is_a_400_naming_the_field(servers, extra, param):
    client, _ = servers
    body = {"model": "tiny", "input": "x", **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/responses", body=body, cast_to=object)
    assert info.value.body["param"] == param


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_function_tools_give_function_call_items_whole_and_streamed(servers):
    client, _ = servers
    named = {"type": "function", "name": "get_weather"}
    reply = client.responses.create(
        model="tiny", input="Weather?", tools=[WEATHER], tool_choice=named, temperature=0,
        max_output_tokens=40,
    )  # fmt: skip
    (call,) = reply.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert set(json.loads(call.arguments)) == {"city"} and call.call_id.startswith("call_")
    # The same call, through chat: the arguments are the chat tool call's.
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], temperature=0,
        max_tokens=40, tools=[{"type": "function", "function": {
            "name": "get_weather", "parameters": WEATHER["parameters"]}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    events = list(client.responses.create(model="tiny", input="Weather?", tools=[WEATHER],
                                          tool_choice=named, temperature=0,
                                          max_output_tokens=40, stream=True))  # fmt: skip
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (done.name, done.arguments) == ("get_weather", call.arguments)
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["function_call"] and events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == call.arguments


def test_a_calls_output_continues_the_conversation_as_chat_does(servers):
    client, _ = servers
    call_id = "call_1"
    items = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call_id, "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": call_id, "output": "cold"},
    ]  # fmt: skip
    reply = client.responses.create(model="tiny", input=items, tools=[WEATHER], tool_choice="none",
                                    temperature=0, max_output_tokens=8)  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "cold"},
    ]  # fmt: skip
    chat = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=8, tool_choice="none",
        tools=[{"type": "function", "function": {"name": "get_weather",
                                                 "parameters": WEATHER["parameters"]}}],
    )  # fmt: skip
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}])
    assert info.value.body["param"] == "tools[0]"


def test_a_calls_call_id_keeps_an_id_the_model_gave():
    """Ids this server made become `call_` + their hex; a model's own (Kimi-K2's
    `functions.NAME:N`, Mistral's 9 characters) stay as they are: its template checks or
    writes back that id when the call returns."""
    from launcher.server.responses_api import _call_id
    from launcher.server.tools import CALL_ID_PREFIX

    assert _call_id(f"{CALL_ID_PREFIX}0123abcd") == "call_0123abcd"
    assert _call_id("functions.get_weather:0") == "functions.get_weather:0"
    assert _call_id("a1B2c3D4e") == "a1B2c3D4e"
