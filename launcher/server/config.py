"""The server's own settings: the `server:` section of a job's YAML, or `--set server.KEY=V`.

    server:
      host: 127.0.0.1              # loopback unless told otherwise
      port: 8000
      api_key: null                # or $LOCKSTEP_API_KEY; with one, the API (/v1/*) wants
                                   # `Authorization: Bearer KEY` (/health, /metrics do not)
      served_model_name: null      # a name or a list of them (default: the model
                                   # directory's name); requests may give any, /v1/models
                                   # lists each, replies carry the one asked for
      chat_template: null          # a file, or the Jinja text itself (default: the
                                   # tokenizer_config.json's); chat renders with it
      max_pending_requests: 256    # open requests (queued or running) before 503 + Retry-After
      max_body_bytes: 1048576      # larger request bodies get 413
      drain_timeout_s: 30          # on SIGTERM: how long in-flight requests may take to finish
      read_timeout_s: 30           # how long a request's body may take to arrive (else 408)
      keepalive_timeout_s: 5       # how long a connection may sit idle, or take to send its
                                   # request's headers, before it is closed
      routing: least_loaded        # or round_robin (launcher/routing.py)
      stats_log_interval_s: 10     # a stats line this often while there is traffic; 0: never
      access_log: false            # one log line per HTTP request (method, path, status, time)
      strict_requests: false       # unknown request fields: false ignores each (one warning per
                                   # field name, as vLLM does), true refuses them with a 400
      reasoning_parser: null       # deepseek_r1 or qwen3: chat replies carry the model's
                                   # <think> block as `reasoning` (launcher/server/reasoning.py)
      enable_auto_tool_choice: false  # tool_choice "auto" (with tool_call_parser), as vLLM's
      tool_call_parser: null       # hermes, deepseek_v3, deepseek_v31, kimi_k2, qwen3_coder,
                                   # glm45 or mistral (vLLM's names): how "auto" replies'
                                   # tool calls are read (launcher/server/tools.py)

The engine's sections are left to `EngineConfig`; nothing here reaches a rank. Every field is
also a flag of `lockstep serve` (launcher/flags.py): `--served-model-name a b`, `--port 0`, ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from math import inf
from pathlib import Path
from typing import Any

from launcher.routing import ROUTING_POLICIES
from launcher.server.reasoning import REASONING_PARSERS
from launcher.server.tools import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: tuple[str, ...] | None = None  # a string or a list is taken as well
    chat_template: str | None = None
    max_pending_requests: int = 256
    max_body_bytes: int = 1 << 20
    drain_timeout_s: float = 30.0
    read_timeout_s: float = 30.0
    keepalive_timeout_s: float = 5.0
    routing: str = "least_loaded"
    stats_log_interval_s: float = 10.0
    access_log: bool = False
    strict_requests: bool = False
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"server.host must be a host name or address, got {self.host!r}")
        if not _is_int(self.port) or not 0 <= self.port <= 65535:
            raise ValueError(
                f"server.port must be an int in [0, 65535] (0: any free port), got {self.port!r}"
            )
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("server.api_key must be a non-empty string or null")
        names = self.served_model_name
        if isinstance(names, str):
            names = (names,)
        if names is not None and (
            not isinstance(names, (list, tuple))
            or not names
            or not all(isinstance(name, str) and name for name in names)
        ):
            raise ValueError(
                "server.served_model_name must be a non-empty string, a non-empty list of them "
                f"or null, got {self.served_model_name!r}"
            )
        if names is not None:
            # Normalized once, at construction: one form for the server to read.
            object.__setattr__(self, "served_model_name", tuple(dict.fromkeys(names)))
        template = self.chat_template
        if template is not None and (not isinstance(template, str) or not template.strip()):
            raise ValueError(
                f"server.chat_template must be a file or Jinja text, or null, got {template!r}"
            )
        for name in ("max_pending_requests", "max_body_bytes"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"server.{name} must be an int >= 1, got {value!r}")
        for name, low in (("drain_timeout_s", 0), ("read_timeout_s", 0.1)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < low:
                raise ValueError(
                    f"server.{name} must be a number of seconds >= {low}, got {value!r}"
                )
        value = self.keepalive_timeout_s
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"server.keepalive_timeout_s must be a number of seconds > 0, got {value!r}"
            )
        ROUTING_POLICIES.check("server.routing", self.routing)
        value = self.stats_log_interval_s
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < inf:
            raise ValueError(
                f"server.stats_log_interval_s must be a number of seconds >= 0 (0: no stats "
                f"line), got {value!r}"
            )
        if not isinstance(self.access_log, bool):
            raise ValueError(f"server.access_log must be true or false, got {self.access_log!r}")
        if not isinstance(self.strict_requests, bool):
            raise ValueError(
                f"server.strict_requests must be true or false, got {self.strict_requests!r}"
            )
        if not isinstance(self.enable_auto_tool_choice, bool):
            raise ValueError(
                "server.enable_auto_tool_choice must be true or false, got "
                f"{self.enable_auto_tool_choice!r}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"server.tool_call_parser must be one of {list(TOOL_CALL_PARSERS)} or null, got "
                f"{self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "server.enable_auto_tool_choice needs server.tool_call_parser (which format "
                "the model's tool calls take)"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"server.reasoning_parser must be one of {list(REASONING_PARSERS)} or null, got "
                f"{self.reasoning_parser!r}"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ServerConfig:
        if not isinstance(values, dict):
            raise ValueError(f"server must be a mapping, got {values!r}")
        unknown = sorted(set(values) - SERVER_KEYS)
        if unknown:
            raise ValueError(
                f"unknown setting(s) {['server.' + k for k in unknown]}; allowed: "
                f"{sorted('server.' + k for k in SERVER_KEYS)}"
            )
        return cls(**values)

    def with_overrides(self, **overrides: Any) -> ServerConfig:
        return ServerConfig.from_dict({**dataclasses.asdict(self), **overrides})

    def chat_template_text(self) -> str | None:
        """The chat template's Jinja source: the file `chat_template` names, else the value
        itself when it reads as a template (vLLM's rule); None when unset. ValueError when it
        is neither a file nor a template, or the file cannot be read."""
        value = self.chat_template
        if value is None:
            return None
        path = Path(value)
        if "\n" not in value and len(value) < 4096 and path.is_file():
            try:
                return path.read_text()
            except (OSError, UnicodeDecodeError) as error:
                raise ValueError(
                    f"server.chat_template {value!r}: cannot read it: {error}"
                ) from None
        if "{{" in value or "{%" in value:
            return value
        raise ValueError(
            f"server.chat_template {value!r}: no such file, and not a Jinja template (no '{{{{' "
            "or '{%' in it)"
        )

    def public(self) -> dict[str, Any]:
        """The settings, with the API key hidden: for logs."""
        values = dataclasses.asdict(self)
        values["api_key"] = "(set)" if self.api_key else None
        return values


SERVER_KEYS = frozenset(f.name for f in fields(ServerConfig))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
