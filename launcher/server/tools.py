"""Tool calling on /v1/chat/completions, as vLLM's server offers it.

A request's `tools` (OpenAI's function definitions) reach the chat template as its `tools`
variable, and `tool_choice` says what the reply may do with them:

- "none": the reply is text; nothing is parsed.
- "auto" (the default when tools are given): the model decides. Its reply is read by the
  server's tool-call parser (`server.tool_call_parser`, which, as in vLLM, needs
  `server.enable_auto_tool_choice` too): `hermes`, the format of Qwen2.5 / Qwen3 / Hermes
  models, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after any text;
  `deepseek_v3` and `deepseek_v31`, DeepSeek-V3's and V3.1's (below). The text before the
  first call is the message's `content`; a reply whose calls do not parse is all content,
  with no calls. Their markers can be special tokens, so such replies are decoded with
  special tokens kept (as vLLM's parsers ask).
- "required": the reply is constrained (the structured-output grammar) to a JSON list of
  `{"name", "parameters"}` objects, one of the tools each; every item is a call.
- a named function (`{"type": "function", "function": {"name": ...}}`): the reply is
  constrained to that function's parameters, and is its one call's arguments.

With `parallel_tool_calls: false` a reply keeps its first call only ("required" is
constrained to one). Calls come back as OpenAI's `tool_calls` (`id`, `type` "function",
`function.name`, `function.arguments` as JSON text), with finish reason "tool_calls" where
the model chose them ("auto", "required"); a named function keeps "stop", as OpenAI's API
does. Streamed, text before a call streams as it comes (a possible `<tool_call>` start held
back); the calls, whole, ride the choice's last content chunk.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from launcher.server.reasoning import partial_suffix

_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# DeepSeek-V3's calls: <｜tool▁calls▁begin｜>, then per call <｜tool▁call▁begin｜>function
# <｜tool▁sep｜>NAME, a ```json fenced block of arguments, <｜tool▁call▁end｜>; V3.1 (and R1-0528
# in its V3.1 form) drops the type and the fence: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS.
_DEEPSEEK_OPEN = "<｜tool▁calls▁begin｜>"
_DEEPSEEK_V3_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?:.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<arguments>.*?)\n```"
    r"<｜tool▁call▁end｜>",
    re.DOTALL,
)
_DEEPSEEK_V31_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?P<name>.*?)<｜tool▁sep｜>(?P<arguments>.*?)<｜tool▁call▁end｜>",
    re.DOTALL,
)
# Where a parser's calls start in a reply.
_OPENING = {"hermes": "<tool_call>", "deepseek_v3": _DEEPSEEK_OPEN, "deepseek_v31": _DEEPSEEK_OPEN}
TOOL_CALL_PARSERS = tuple(_OPENING)


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be served; the message names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """A chat request's tools: their definitions (for the template), the tool_choice mode
    ("none", "auto", "required", "named"), the named function, and the grammar that
    "required" and "named" constrain the reply with (llguidance's form)."""

    definitions: tuple[dict[str, Any], ...]
    mode: str
    name: str | None = None
    parser: str | None = None
    grammar: str | None = None
    parallel: bool = True  # parallel_tool_calls: false keeps the reply to one call

    def template_tools(self) -> list[dict[str, Any]]:
        return [dict(tool) for tool in self.definitions]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def body(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def parse_tools(body: dict[str, Any], *, auto_enabled: bool, parser: str | None) -> Tools | None:
    """The request's `tools` and `tool_choice`, checked (ToolError naming the field)."""
    given = body.get("tools")
    choice = body.get("tool_choice")
    if given is None or given == []:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(given, list):
        raise ToolError(f"tools must be a list, got {type(given).__name__}", "tools")
    functions: dict[str, dict[str, Any]] = {}
    for index, tool in enumerate(given):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise ToolError(
                f'tools[{index}] must be {{"type": "function", "function": {{"name": ..., '
                f'"parameters": {{...}}}}}}',
                f"tools[{index}]",
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ToolError(f"tools[{index}].function.parameters must be an object", "tools")
        functions[function["name"]] = function
    definitions = tuple(given)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    parallel = parallel is not False
    if choice is None or choice == "auto":
        if not (auto_enabled and parser):
            raise ToolError(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser (as vLLM's does)",
                "tool_choice",
            )
        return Tools(definitions, "auto", parser=parser, parallel=parallel)
    if choice == "none":
        return Tools(definitions, "none")
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": _schema(function)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, function in functions.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        return Tools(definitions, "required", grammar=_grammar(schema), parallel=parallel)
    named = choice.get("function") if isinstance(choice, dict) else None
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(named, dict)
        and isinstance(named.get("name"), str)
    ):
        name = named["name"]
        if name not in functions:
            raise ToolError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        return Tools(definitions, "named", name=name, grammar=_grammar(_schema(functions[name])))
    raise ToolError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
        f'{{"name": ...}}}}, got {str(choice)[:80]!r}',
        "tool_choice",
    )


def _schema(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object"}


def _grammar(schema: dict[str, Any]) -> str:
    from dist_engine.engine import structured

    try:  # compact JSON: a call's tokens go to its content, not to whitespace
        return structured.json_schema(schema, any_whitespace=False)
    except (ValueError, TypeError) as error:
        raise ToolError(f"a tool's parameters schema does not compile: {error}", "tools") from None


class ToolCallReader:
    """One choice's content, fed piece by piece: the text to show now, and at the end the
    calls (`finish`)."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self._pending = ""  # held back: a possible block start, or everything of a call
        self._in_calls = False

    def feed(self, text: str) -> str:
        if self.tools.mode in ("required", "named"):
            self._pending += text  # the whole reply is the calls
            return ""
        if self._in_calls:
            self._pending += text
            return ""
        self._pending += text
        opening = _OPENING[self.tools.parser or "hermes"]
        start = self._pending.find(opening)
        if start >= 0:
            shown, self._pending = self._pending[:start], self._pending[start:]
            self._in_calls = True
            return shown
        keep = partial_suffix(self._pending, opening)
        shown = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return shown

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content still to show, the calls); a reply whose calls do not parse gives
        its held text back as content and no calls."""
        text, self._pending = self._pending, ""
        try:
            calls = self._calls(text)
        except (ValueError, KeyError, TypeError, AttributeError):
            return text, []
        if not self.tools.parallel:
            calls = calls[:1]  # parallel_tool_calls false: the first call only
        return ("", calls) if calls else (text, [])

    def _calls(self, text: str) -> list[ToolCall]:
        mode = self.tools.mode
        if mode == "named":
            json.loads(text)  # a cut-off reply is not a call
            return [_call(self.tools.name or "", text)]
        if mode == "required":
            items = json.loads(text)
            return [_call(item["name"], json.dumps(item["parameters"])) for item in items]
        if not self._in_calls:
            return []
        if self.tools.parser in ("deepseek_v3", "deepseek_v31"):
            pattern = (
                _DEEPSEEK_V3_CALL if self.tools.parser == "deepseek_v3" else _DEEPSEEK_V31_CALL
            )
            calls = []
            for found in pattern.finditer(text):
                arguments = found.group("arguments").strip()
                json.loads(arguments)  # arguments that are not JSON are not a call
                calls.append(_call(found.group("name").strip(), arguments))
            return calls
        calls = []
        for block in _HERMES_BLOCK.findall(text):
            value = json.loads(block)
            arguments = value.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            calls.append(_call(str(value["name"]), arguments))
        return calls


def finish_reason(tools: Tools | None, reason: str | None, calls: list[ToolCall]) -> str | None:
    """The reply's finish reason: "tool_calls" where the model chose to call."""
    if calls and reason == "stop" and tools is not None and tools.mode != "named":
        return "tool_calls"
    return reason


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(name, arguments, f"chatcmpl-tool-{uuid.uuid4().hex}")
