"""OpenAI's Responses API (`POST /v1/responses`), as vLLM's server offers it, over the chat
path: a request becomes a chat request (its `instructions` a system message, its `input` the
messages), runs as one, and its reply is written as a `response` object, or, streamed, as the
Responses event sequence (`response.created` ... `response.output_text.delta` ...
`response.completed`), each event with its `sequence_number`.

Taken: `input` (a string, or messages whose content is a string or text parts), `instructions`,
`max_output_tokens`, `temperature`, `top_p`, `stream`, `text.format` (text, json_schema,
json_object: structured output), `store` (nothing is kept here, so a stored response cannot be
fetched later), `metadata` (echoed), and the chat path's sampling extensions (`seed`, `top_k`,
...). With a reasoning parser the model's <think> block is a `reasoning` output item before the
message. Function `tools` and `tool_choice` are the chat path's (so "auto" needs the server's
tool-call parser, "required" and a named function do not): calls come back as
`function_call` items (streamed whole: added, one arguments delta, done), and a conversation
goes on with `function_call` and `function_call_output` input items (the assistant's tool
calls and the tool's message). Refused with a 400 naming the field, never ignored: built-in
tools, `previous_response_id`, `background`, `reasoning` settings, `include`,
`truncation: auto`, `top_logprobs`, `prompt`, other input items.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

from aiohttp import web

from launcher.server.generation import Choice, held_calls, split_piece
from launcher.server.protocol import (
    GenerationRequest,
    ModelLimits,
    RequestError,
    parse_chat,
    refuse_unsupported,
)
from launcher.server.responses import sse
from launcher.server.tools import CALL_ID_PREFIX, ToolCall

# Fields of a Responses request that are its own (the rest go to the chat path as they are).
_OWN = {
    "input",
    "instructions",
    "max_output_tokens",
    "text",
    "store",
    "metadata",
    "tools",
    "tool_choice",
    "previous_response_id",
    "background",
    "reasoning",
    "include",
    "truncation",
    "top_logprobs",
    "prompt",
    "parallel_tool_calls",
    "max_tool_calls",
}
# field -> the values that mean "not used"; anything else is refused.
_REFUSED = {
    "previous_response_id": (None,),
    "background": (None, False),
    "reasoning": (None, {}),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "top_logprobs": (None, 0),
    "prompt": (None,),
    "n": (None, 1),
}


def parse_responses(body: Any, limits: ModelLimits) -> GenerationRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    refuse_unsupported(body, _REFUSED)
    chat = {key: value for key, value in body.items() if key not in _OWN}
    chat["messages"] = _messages(body)
    chat["stream"] = bool(body.get("stream", False))
    if body.get("max_output_tokens") is not None:
        value = body["max_output_tokens"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RequestError(
                f"max_output_tokens must be an int >= 1, got {str(value)[:80]!r}",
                param="max_output_tokens",
            )
        chat["max_tokens"] = value
    response_format = _format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    tools = body.get("tools")
    if tools:
        chat["tools"] = [_chat_tool(index, tool) for index, tool in enumerate(_list(tools))]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None and (tools or choice not in ("auto", "none")):
        chat["tool_choice"] = choice
    generation = parse_chat(chat, limits)
    echo = {"instructions": body.get("instructions"), "metadata": body.get("metadata") or {}}
    return replace(generation, endpoint="responses", echo_fields=echo)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise RequestError("input must be a string or a non-empty list of messages", param="input")
    for index, item in enumerate(given):
        where = f"input[{index}]"
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        if kind == "function_call":  # an earlier reply's call: the assistant's turn
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            if (
                messages
                and messages[-1].get("role") == "assistant"
                and "tool_calls" in messages[-1]
            ):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            continue
        if kind == "function_call_output":  # what the call gave back: the tool's turn
            output = item.get("output")
            if not isinstance(output, str):
                raise RequestError(f"{where}.output must be a string", param=where)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output})  # fmt: skip
            continue
        if kind != "message":
            raise RequestError(
                f"{where}: messages, function_call and function_call_output items are taken "
                f"here, got {str(kind)[:40]!r}",
                param=where,
            )
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for part_index, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") not in ("input_text", "output_text", "text")
                    or not isinstance(part.get("text"), str)
                ):
                    raise RequestError(
                        f"{where}.content[{part_index}] must be a text part", param=where
                    )
                texts.append(part["text"])
            content = "".join(texts)
        role = item.get("role")
        if role == "developer":
            role = "system"  # OpenAI's name for the system role in this API
        messages.append({"role": role, "content": content})
    return messages


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise RequestError("tools must be a list", param="tools")
    return value


def _chat_tool(index: int, tool: Any) -> dict[str, Any]:
    """A Responses function tool (flat: type, name, parameters) as chat's (nested)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise RequestError(
            f"tools[{index}]: function tools only here (no built-in tools), got {str(kind)[:40]!r}",
            param=f"tools[{index}]",
        )
    function = {"name": tool.get("name"), "parameters": tool.get("parameters")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _format(text: Any) -> dict[str, Any] | None:
    """`text.format` as the chat path's `response_format`."""
    if text is None:
        return None
    spec = text.get("format") if isinstance(text, dict) else None
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(spec.get("schema"), dict):
        name = spec.get("name", "response")
        return {"type": "json_schema", "json_schema": {"name": name, "schema": spec["schema"]}}
    raise RequestError(
        "text.format must be {type: text}, {type: json_object} or {type: json_schema, "
        "schema: {...}}",
        param="text",
    )


class ResponseWriter:
    """One request's `response` object and its stream of events."""

    def __init__(self, generation: GenerationRequest, model: str, response_id: str) -> None:
        self.id = response_id
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.generation = generation
        echo = generation.echo_fields or {}
        self.metadata = echo.get("metadata") or {}
        self.instructions = echo.get("instructions")
        self.sequence = 0

    def finished(self, output: list[dict[str, Any]], choice: Choice) -> dict[str, Any]:
        """The response of a finished choice: "incomplete" where it ran out of tokens."""
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        return self.response(status, output, _usage(choice), choice.finish_reason)

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        params = self.generation.params
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if finish_reason == "length" else None
            ),
            "error": None,
            "model": self.model,
            "instructions": self.instructions,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_output_tokens": params.max_tokens,
            "metadata": self.metadata,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": False,
            "usage": usage,
        }

    def message(self, text: str, status: str) -> dict[str, Any]:
        parts = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": parts if status == "completed" or text else [],
        }

    def function_call(self, call: ToolCall, status: str = "completed") -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": f"fc_{call.id.rsplit('-', 1)[-1]}",
            "call_id": _call_id(call.id),
            "name": call.name,
            "arguments": call.arguments if status == "completed" else "",
            "status": status,
        }

    def reasoning(self, text: str) -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }

    def part_event(self, kind: str, item_id: str, index: int, **fields: Any) -> bytes:
        """An event about the first content part of output item ``index``."""
        return self.event(kind, item_id=item_id, output_index=index, content_index=0, **fields)

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\n".encode() + sse(body)


def _call_id(chat_id: str) -> str:
    """A call's `call_id`: `call_` and the hex of an id this server made; an id the model
    gave (kimi_k2's `functions.NAME:N`, mistral's 9 characters) as it is, since the model's
    template checks or writes back that id when the call returns in a later request."""
    if chat_id.startswith(CALL_ID_PREFIX):
        return f"call_{chat_id.removeprefix(CALL_ID_PREFIX)}"
    return chat_id


def _usage(choice: Choice) -> dict[str, Any]:
    prompt, output = len(choice.prompt_token_ids), len(choice.token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


async def answer_responses(
    request: web.Request, generation: GenerationRequest, choice: Choice, response_id: str
) -> web.StreamResponse:
    """The reply to a /v1/responses request: its `response` object, or its event stream."""
    writer = ResponseWriter(generation, generation.model, response_id)
    if not generation.stream:
        while not choice.done:
            choice.take(await choice.stream.next())
        if choice.error is not None:
            raise choice.error
        content, thought = split_piece(generation, choice, choice.text, final=True)
        calls = held_calls(choice)
        content += calls[0]
        output = [writer.reasoning(thought)] if thought else []
        if content or not calls[1]:
            output.append(writer.message(content, "completed"))
        output += [writer.function_call(call) for call in calls[1]]
        return web.json_response(writer.finished(output, choice))
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    started = writer.response("in_progress", [], None)
    await response.write(writer.event("response.created", response=started))
    await response.write(writer.event("response.in_progress", response=started))
    thought_text, content_text = "", ""
    reasoning_open = message_open = False
    message_index = 0

    async def open_message() -> None:
        nonlocal message_open, message_index
        message_open = True
        message_index = 1 if reasoning_open else 0
        item = writer.message("", "in_progress")
        await response.write(
            writer.event("response.output_item.added", output_index=message_index, item=item)
        )
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        await response.write(
            writer.part_event(
                "response.content_part.added",
                writer.message_id,
                message_index,
                part=part,
            )
        )

    async def send(thought: str, content: str) -> None:
        nonlocal thought_text, content_text, reasoning_open
        if thought:
            if not reasoning_open:
                reasoning_open = True
                await response.write(
                    writer.event(
                        "response.output_item.added",
                        output_index=0,
                        item={**writer.reasoning(""), "content": []},
                    )
                )
            thought_text += thought
            await response.write(
                writer.part_event(
                    "response.reasoning_text.delta",
                    writer.reasoning_id,
                    0,
                    delta=thought,
                )
            )
        if content:
            if not message_open:
                await open_message()
            content_text += content
            await response.write(
                writer.part_event(
                    "response.output_text.delta",
                    writer.message_id,
                    message_index,
                    delta=content,
                    logprobs=[],
                )
            )

    while not choice.done:
        piece = choice.take(await choice.stream.next())
        content, thought = split_piece(generation, choice, piece.text)
        await send(thought, content)
    if choice.error is not None:
        error = choice.error.body()["error"]
        await response.write(
            writer.event(
                "error", code=error["code"], message=error["message"], param=error["param"]
            )
        )
        await response.write_eof()
        return response
    content, thought = split_piece(generation, choice, "", final=True)
    rest, calls = held_calls(choice)
    await send(thought, content + rest)
    output = []
    if reasoning_open:
        done = writer.reasoning(thought_text)
        await response.write(
            writer.part_event(
                "response.reasoning_text.done",
                writer.reasoning_id,
                0,
                text=thought_text,
            )
        )
        await response.write(writer.event("response.output_item.done", output_index=0, item=done))
        output.append(done)
    if not message_open and calls:  # calls only: no message item
        await _send_calls(response, writer, calls, len(output))
        output += [writer.function_call(call) for call in calls]
        return await _complete(response, writer, choice, output)
    if not message_open:
        await open_message()
    part = {"type": "output_text", "text": content_text, "annotations": [], "logprobs": []}
    await response.write(
        writer.part_event(
            "response.output_text.done",
            writer.message_id,
            message_index,
            text=content_text,
            logprobs=[],
        )
    )
    await response.write(
        writer.part_event(
            "response.content_part.done",
            writer.message_id,
            message_index,
            part=part,
        )
    )
    item = writer.message(content_text, "completed")
    await response.write(
        writer.event("response.output_item.done", output_index=message_index, item=item)
    )
    output.append(item)
    await _send_calls(response, writer, calls, len(output))
    output += [writer.function_call(call) for call in calls]
    return await _complete(response, writer, choice, output)


async def _send_calls(
    response: web.StreamResponse, writer: ResponseWriter, calls: list[ToolCall], first: int
) -> None:
    """Each call as its item: added, its arguments (whole, as one delta), done."""
    for offset, call in enumerate(calls):
        index = first + offset
        added = writer.function_call(call, "in_progress")
        await response.write(
            writer.event("response.output_item.added", output_index=index, item=added)
        )
        fields = {"item_id": added["id"], "output_index": index}
        await response.write(
            writer.event("response.function_call_arguments.delta", delta=call.arguments, **fields)
        )
        await response.write(
            writer.event(
                "response.function_call_arguments.done",
                arguments=call.arguments,
                name=call.name,
                **fields,
            )
        )
        done = writer.function_call(call)
        await response.write(
            writer.event("response.output_item.done", output_index=index, item=done)
        )


async def _complete(
    response: web.StreamResponse,
    writer: ResponseWriter,
    choice: Choice,
    output: list[dict[str, Any]],
) -> web.StreamResponse:
    final = writer.finished(output, choice)
    await response.write(writer.event(f"response.{final['status']}", response=final))
    await response.write_eof()
    return response
