"""Tool calling on /v1/chat/completions, as vLLM's server offers it.

A request's `tools` (OpenAI's function definitions) reach the chat template as its `tools`
variable, and `tool_choice` says what the reply may do with them:

- "none": the reply is text; nothing is parsed.
- "auto" (the default when tools are given): the model decides. Its reply is read by the
  server's tool-call parser (`server.tool_call_parser`, which, as in vLLM, needs
  `server.enable_auto_tool_choice` too), named as vLLM names them:
  - `hermes`, the format of Qwen2.5 / Qwen3 / Hermes models: `<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>` blocks after any text;
  - `deepseek_v3` and `deepseek_v31`, DeepSeek-V3's and V3.1's marker tokens;
  - `kimi_k2`, Kimi-K2's marker tokens, its calls keeping the model's own ids
    (`functions.NAME:INDEX`, which its template writes back in later turns);
  - `qwen3_coder`, Qwen3-Coder's `<tool_call><function=NAME><parameter=KEY>` blocks;
  - `glm45`, GLM-4.5 / 4.6's `<tool_call>NAME<arg_key>..<arg_value>..` blocks;
  - `mistral`, Mistral / Mixtral's `[TOOL_CALLS]`: a JSON list of calls (older
    tokenizers), or one `NAME[ARGS]{...}` per call (newer), its calls with 9-character
    ids as Mistral's chat templates require.
  The formats are written out by their patterns below. qwen3_coder's and glm45's argument
  values are text; each is read by the type the request's tool declares for it (below).
  The text before the first call is the message's `content`; a reply whose calls do not
  parse (one cut off by max_tokens) is all content, with no calls. The markers can be
  special tokens, so such replies are decoded with special tokens kept (as vLLM's parsers
  ask).
- "required": the reply is constrained (the structured-output grammar) to a JSON list of
  `{"name", "parameters"}` objects, one of the tools each; every item is a call.
- a named function (`{"type": "function", "function": {"name": ...}}`): the reply is
  constrained to that function's parameters, and is its one call's arguments.

With `parallel_tool_calls: false` a reply keeps its first call only ("required" is
constrained to one). Calls come back as OpenAI's `tool_calls` (`id`, `type` "function",
`function.name`, `function.arguments` as JSON text), with finish reason "tool_calls" where
the model chose them ("auto", "required"); a named function keeps "stop", as OpenAI's API
does. Streamed, text before a call streams as it comes (a possible start of the parser's
opening marker held back); the calls, whole, ride the choice's last content chunk.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
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
# Kimi-K2's calls (its chat template; MoonshotAI/Kimi-K2 docs/tool_call_guidance.md):
# <|tool_calls_section_begin|>, then per call <|tool_call_begin|>ID<|tool_call_argument_begin|>
# ARGS (JSON)<|tool_call_end|>, then <|tool_calls_section_end|>. ID is functions.NAME:INDEX.
# The model also writes the section markers in the singular (<|tool_call_section_begin|>,
# <|tool_call_section_end|>) at times; vLLM's parser takes both, and so does this one.
_KIMI_OPEN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
_KIMI_CLOSE = re.compile(r"<\|tool_calls?_section_end\|>")
_KIMI_CALL = re.compile(
    r"\s*<\|tool_call_begin\|>\s*(?P<id>[^<]*?)\s*<\|tool_call_argument_begin\|>"
    r"(?P<arguments>.*?)<\|tool_call_end\|>",
    re.DOTALL,
)
_KIMI_ID = re.compile(r"(?:functions\.)?(?P<name>\S+?)(?P<index>:\d+)?")
# Qwen3-Coder's calls (the system prompt of its chat template shows the form):
# <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n
# </tool_call>, one block a call. A value is raw text (a newline either side is the
# format's); a parameter whose </parameter> the model left out ends at the next one, or at
# </function>.
_QWEN3_CODER_CALL = re.compile(
    r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>(?P<body>.*?)</function>\s*(?:</tool_call>)?",
    re.DOTALL,
)
_QWEN3_CODER_PARAMETER = re.compile(
    r"\s*<parameter=(?P<key>[^>\n]+)>(?P<value>.*?)(?:</parameter>|(?=<parameter=)|\Z)",
    re.DOTALL,
)
# GLM-4.5 / 4.6's calls (their chat template; zai-org/GLM-4.5 resources/glm_4.6_tir_guide.md):
# <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n...</tool_call>, one
# block a call, the whitespace between tags varying (GLM-4.7 writes none). A value is raw
# text, its surrounding whitespace not part of it.
_GLM45_CALL = re.compile(
    r"\s*<tool_call>(?P<name>[^<]*)(?P<body>(?:\s*<arg_key>(?:(?!</arg_key>).)*</arg_key>"
    r"\s*<arg_value>(?:(?!</arg_value>).)*</arg_value>)*)\s*</tool_call>",
    re.DOTALL,
)
_GLM45_ARGUMENT = re.compile(
    r"\s*<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.DOTALL
)
# Mistral's calls (mistral-common's instruct tokenizers; the models' chat templates): up to
# tokenizer v7 (Mixtral-8x22B-Instruct-v0.1, Mistral-7B-Instruct-v0.3, ...) one [TOOL_CALLS]
# and a JSON list [{"name": ..., "arguments": {...}}, ...]; from v11 [TOOL_CALLS]NAME[ARGS]
# {...} per call (v11 may put [CALL_ID]ID before [ARGS]; mistral-common's own decoding, which
# vLLM reads, drops those markers: NAME{...}).
_MISTRAL_OPEN = "[TOOL_CALLS]"
_MISTRAL_CALL = re.compile(
    r"\s*(?P<name>[^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*[^\s\[\]{}]*\s*)?(?:\[ARGS\])?\s*"
)
# Where a parser's calls start in a reply (the first of its markers to appear).
_OPENING: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),
    "deepseek_v3": (_DEEPSEEK_OPEN,),
    "deepseek_v31": (_DEEPSEEK_OPEN,),
    "kimi_k2": _KIMI_OPEN,
    "qwen3_coder": ("<tool_call>",),
    "glm45": ("<tool_call>",),
    "mistral": (_MISTRAL_OPEN,),
}
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
        openings = _OPENING[self.tools.parser or "hermes"]
        starts = [at for at in map(self._pending.find, openings) if at >= 0]
        if starts:
            start = min(starts)
            shown, self._pending = self._pending[:start], self._pending[start:]
            self._in_calls = True
            return shown
        keep = max(partial_suffix(self._pending, opening) for opening in openings)
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
        parser = self.tools.parser
        if parser in _READERS:  # the text starts with the parser's opening marker
            return _READERS[parser](text, self.tools)
        if parser in ("deepseek_v3", "deepseek_v31"):
            pattern = _DEEPSEEK_V3_CALL if parser == "deepseek_v3" else _DEEPSEEK_V31_CALL
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


def _kimi_calls(text: str, tools: Tools) -> list[ToolCall]:
    """Kimi-K2's section: its calls, each keeping the model's id where the reply's ids are
    NAME:INDEX ones, distinct (vLLM keeps them too; the template writes them back)."""
    opening = next(marker for marker in _KIMI_OPEN if text.startswith(marker))
    section = _KIMI_CLOSE.split(text[len(opening) :], maxsplit=1)[0]
    found_calls, at = [], 0
    while found := _KIMI_CALL.match(section, at):
        found_calls.append(found)
        at = found.end()
    if section[at:].strip():
        raise ValueError("a Kimi-K2 call that does not parse (cut off?)")
    calls, ids = [], []
    for found in found_calls:
        call_id = _KIMI_ID.fullmatch(found.group("id"))
        if call_id is None:
            raise ValueError(f"not a Kimi-K2 call id: {found.group('id')!r}")
        arguments = found.group("arguments").strip()
        json.loads(arguments)  # arguments that are not JSON are not a call
        calls.append(_call(call_id.group("name"), arguments))
        ids.append(found.group("id") if call_id.group("index") else None)
    if None not in ids and len(set(ids)) == len(ids):
        calls = [
            ToolCall(call.name, call.arguments, str(id_))
            for call, id_ in zip(calls, ids, strict=True)
        ]
    return calls


def _tagged_calls(
    text: str,
    tools: Tools,
    block: re.Pattern[str],
    read: Callable[[re.Match[str]], tuple[str, list[tuple[str, str]]]],
    untyped_as_json: bool,
    label: str,
) -> list[ToolCall]:
    """The consecutive `<tool_call>` blocks of an XML-like format (qwen3_coder, glm45), each
    matched by `block` and read by `read` into its function's name and (key, text value)
    pairs; each value is read by the type the tool declares for it (`_typed`). A block left
    that does not match is a call cut off or malformed."""
    calls, at = [], 0
    while found := block.match(text, at):
        name, pairs = read(found)
        properties = _properties(tools, name)
        arguments = {
            key: _typed(value, properties.get(key), untyped_as_json=untyped_as_json)
            for key, value in pairs
        }
        calls.append(_call(name, json.dumps(arguments, ensure_ascii=False)))
        at = found.end()
    if text[at:].lstrip().startswith("<tool_call>"):
        raise ValueError(f"a {label} call that does not parse (cut off?)")
    return calls


def _qwen3_coder_block(found: re.Match[str]) -> tuple[str, list[tuple[str, str]]]:
    """A Qwen3-Coder block's name and parameters, each value less the newline either side."""
    body, pairs, inner = found.group("body"), [], 0
    while parameter := _QWEN3_CODER_PARAMETER.match(body, inner):
        value = parameter.group("value")
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        pairs.append((parameter.group("key").strip(), value))
        inner = parameter.end()
    if body[inner:].strip():
        raise ValueError("text inside a Qwen3-Coder call that is not a parameter")
    return found.group("name").strip(), pairs


def _glm45_block(found: re.Match[str]) -> tuple[str, list[tuple[str, str]]]:
    """A GLM-4.5 block's name and arguments, each value less its surrounding whitespace."""
    name = found.group("name").strip()
    if not name or len(name.split()) != 1:
        raise ValueError(f"not a GLM-4.5 function name: {name!r}")
    pairs = [
        (argument.group("key").strip(), argument.group("value").strip())
        for argument in _GLM45_ARGUMENT.finditer(found.group("body"))
    ]
    return name, pairs


def _qwen3_coder_calls(text: str, tools: Tools) -> list[ToolCall]:
    """Qwen3-Coder's blocks; a parameter the tool does not declare stays text (vLLM's rule)."""
    return _tagged_calls(text, tools, _QWEN3_CODER_CALL, _qwen3_coder_block, False, "Qwen3-Coder")


def _glm45_calls(text: str, tools: Tools) -> list[ToolCall]:
    """GLM-4.5's blocks; a parameter the tool does not declare is read as JSON where it is
    JSON (GLM's own parsing guide, and vLLM)."""
    return _tagged_calls(text, tools, _GLM45_CALL, _glm45_block, True, "GLM-4.5")


def _mistral_calls(text: str, tools: Tools) -> list[ToolCall]:
    """Mistral's calls: after [TOOL_CALLS] a JSON list, or NAME[ARGS]{...} segments each
    after its own [TOOL_CALLS]. Ids are 9 letters and digits: Mistral's chat templates
    refuse others when the calls come back in the next request (vLLM's ids are so too)."""
    text = text[len(_MISTRAL_OPEN) :]
    items: list[tuple[str, Any]] = []
    if text.lstrip().startswith("["):
        listed = json.loads(text)
        if not isinstance(listed, list):
            raise ValueError("[TOOL_CALLS] not followed by a list")
        items = [(item["name"], item.get("arguments", {})) for item in listed]
    else:
        decoder = json.JSONDecoder()
        for segment in text.split(_MISTRAL_OPEN):
            head = _MISTRAL_CALL.match(segment)
            if head is None:
                raise ValueError(f"not a Mistral call: {segment[:80]!r}")
            arguments, end = decoder.raw_decode(segment, head.end())
            if segment[end:].strip():
                raise ValueError("text after a Mistral call's arguments")
            items.append((head.group("name"), arguments))
    calls = []
    for name, arguments in items:
        if not isinstance(name, str) or not name:
            raise ValueError(f"not a function name: {name!r}")
        if isinstance(arguments, str):
            arguments = json.loads(arguments)  # JSON text: kept only where it is JSON
        if not isinstance(arguments, dict):
            raise ValueError("a Mistral call's arguments must be an object")
        calls.append(
            ToolCall(name, json.dumps(arguments, ensure_ascii=False), uuid.uuid4().hex[:9])
        )
    return calls


def _properties(tools: Tools, name: str) -> dict[str, Any]:
    """The JSON schemas of the named tool's parameters ({} for a tool not in the request)."""
    for tool in tools.definitions:
        function = tool.get("function") or {}
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return properties if isinstance(properties, dict) else {}
    return {}


_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (dict, "object"), (list, "array"), (type(None), "null"))  # fmt: skip


def _typed(raw: str, schema: Any, *, untyped_as_json: bool) -> Any:
    """An argument written as text, as the value its JSON schema's `type` declares: a
    string stays the text; any other type is the text read as JSON (`True` / `False` too
    for a boolean), or the text itself where it is not JSON of a declared type (a text
    that does not parse is kept, as vLLM keeps it). With no type declared: the text, or
    (`untyped_as_json`) its JSON where it parses."""
    declared = schema.get("type") if isinstance(schema, dict) else None
    listed = declared if isinstance(declared, list) else [declared]
    types = {kind for kind in listed if isinstance(kind, str)}
    if (not types and not untyped_as_json) or types == {"string"}:
        return raw
    if "boolean" in types and raw.strip() in ("True", "False"):
        return raw.strip() == "True"
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except ValueError:
        return raw
    if "string" in types:  # a union with string: the parsed value only where declared
        kind = next(label for cls, label in _JSON_TYPES if isinstance(value, cls))
        fits = kind in types or (kind == "integer" and "number" in types)
        return value if fits and kind != "string" else raw
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# The parsers that read their calls with a function of their own (the text from the opening
# marker on, the request's tools).
_READERS = {
    "kimi_k2": _kimi_calls,
    "qwen3_coder": _qwen3_coder_calls,
    "glm45": _glm45_calls,
    "mistral": _mistral_calls,
}


def finish_reason(tools: Tools | None, reason: str | None, calls: list[ToolCall]) -> str | None:
    """The reply's finish reason: "tool_calls" where the model chose to call."""
    if calls and reason == "stop" and tools is not None and tools.mode != "named":
        return "tool_calls"
    return reason


CALL_ID_PREFIX = "chatcmpl-tool-"  # the ids this server makes (a model's own are kept)


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(name, arguments, f"{CALL_ID_PREFIX}{uuid.uuid4().hex}")
