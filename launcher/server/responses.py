"""OpenAI response bodies and stream chunks for completions and chat completions.

A `ResponseShape` knows one request's id, model, creation time and endpoint, and builds the
whole-reply body or each server-sent-event chunk. `return_token_ids` adds the output token ids
to the choice (whole reply) or the chunk's tokens to each chunk's choice.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def body(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass(frozen=True)
class ResponseShape:
    request_id: str
    model: str
    endpoint: str  # "completion" or "chat"
    return_token_ids: bool
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def _object(self) -> str:
        return "text_completion" if self.endpoint == "completion" else "chat.completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(
        self, text: str, token_ids: list[int], finish_reason: str, usage: Usage
    ) -> dict[str, Any]:
        """The whole reply of a request that did not stream."""
        if self.endpoint == "completion":
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
            choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        body = self._envelope(self._object, [choice])
        body["usage"] = usage.body()
        return body

    def chunk(
        self,
        text: str,
        token_ids: list[int],
        finish_reason: str | None = None,
        *,
        first: bool = False,
    ) -> dict[str, Any]:
        """One streamed piece; ``first`` opens a chat reply with the assistant's role."""
        if self.endpoint == "completion":
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None}
            obj = "text_completion"
        else:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None}
            obj = "chat.completion.chunk"
        choice["finish_reason"] = finish_reason
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return self._envelope(obj, [choice])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk when the client asked for stream_options.include_usage."""
        obj = "text_completion" if self.endpoint == "completion" else "chat.completion.chunk"
        body = self._envelope(obj, [])
        body["usage"] = usage.body()
        return body


def sse(body: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying ``body`` (JSON, or the literal ``[DONE]``)."""
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
