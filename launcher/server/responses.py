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
    """One request's reply: its id, model, creation time and endpoint; builds the whole body,
    each choice, each server-sent-event chunk and the logprobs in the endpoint's format."""

    request_id: str
    model: str
    endpoint: str  # "completion" or "chat"
    return_token_ids: bool
    tokenizer: Any = None  # a ModelTokenizer, for token texts (None: ids stand in for them)
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

    def choice(
        self,
        index: int,
        text: str | None,
        token_ids: list[int],
        finish_reason: str | None,
        logprobs: dict[str, Any] | None = None,
        *,
        reasoning: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One choice of a whole (not streamed) reply; ``reasoning``: a chat reply's reasoning
        (a reasoning parser split it from ``text``); ``tool_calls``: its calls."""
        if self.endpoint == "completion":
            body: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs}
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning is not None:
                message.update(_reasoning(reasoning))
            if tool_calls:
                message["tool_calls"] = tool_calls
            body = {"index": index, "message": message, "logprobs": logprobs}
        body["finish_reason"] = finish_reason
        if self.return_token_ids:
            body["token_ids"] = token_ids
        return body

    def full(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        """The whole reply of a request that did not stream."""
        body = self._envelope(self._object, choices)
        body["usage"] = usage.body()
        return body

    def chunk(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: str | None = None,
        *,
        first: bool = False,
        logprobs: dict[str, Any] | None = None,
        reasoning: str = "",
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One streamed piece of choice ``index``; ``first`` opens a chat choice with the
        assistant's role; ``reasoning``: what the piece adds to a chat reply's reasoning;
        ``tool_calls``: the reply's calls (each with its index), whole."""
        if self.endpoint == "completion":
            choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs}
            obj = "text_completion"
        else:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if reasoning:
                delta.update(_reasoning(reasoning))
            if text or first:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs}
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

    # -- logprobs ---------------------------------------------------------------------------
    def decode(self, token_ids: list[int]) -> str:
        """A prompt's text for echo: special tokens spelled out, as vLLM echoes them."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """A token's text as logprobs name it (vLLM's `token_id:N` without a tokenizer)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs(
        self, token_ids: list[int], entries: list[Any] | None, text_offset: int
    ) -> dict[str, Any] | None:
        """``entries``: one `TokenLogprob` (or None, for a prompt's first token) per token."""
        if entries is None:
            return None
        if self.endpoint == "completion":
            tokens, values, tops, offsets = [], [], [], []
            offset = text_offset
            for token_id, entry in zip(token_ids, entries, strict=False):
                text = self.token_text(token_id)
                tokens.append(text)
                offsets.append(offset)
                offset += len(text)
                values.append(None if entry is None else entry.logprob)
                tops.append(None if entry is None else self._top_by_text(entry))
            return {
                "tokens": tokens,
                "token_logprobs": values,
                "top_logprobs": tops,
                "text_offset": offsets,
            }
        content = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            if entry is None:
                continue
            text = self.token_text(token_id)
            content.append(
                {
                    "token": text,
                    "logprob": entry.logprob,
                    "bytes": list(text.encode("utf-8", "replace")),
                    "top_logprobs": [
                        {
                            "token": (top := self.token_text(t)),
                            "logprob": lp,
                            "bytes": list(top.encode("utf-8", "replace")),
                        }
                        for t, lp in entry.top
                    ],
                }
            )
        return {"content": content}

    def _top_by_text(self, entry: Any) -> dict[str, float] | None:
        """Completions' top logprobs, keyed by token text, with the token itself among them
        (as vLLM returns them: lm-eval's is-greedy check compares the most likely key with the
        token). Where two tokens have the same text (pieces of one UTF-8 character), the more
        likely one keeps the key."""
        by_text: dict[str, float] = {}
        for token_id, logprob in entry.top:  # most likely first
            by_text.setdefault(self.token_text(token_id), logprob)
        by_text.setdefault(self.token_text(entry.token_id), entry.logprob)
        return by_text

    @staticmethod
    def join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        """Completions' logprobs of the echoed prompt followed by the output's (whose text
        offsets already count the prompt's text)."""
        return {key: first[key] + second[key] for key in first}


def _reasoning(text: str) -> dict[str, str]:
    """A reply's reasoning under vLLM's name and the one DeepSeek's API (and earlier vLLM
    releases) use, so clients of either find it."""
    return {"reasoning": text, "reasoning_content": text}


def sse(body: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying ``body`` (JSON, or the literal ``[DONE]``)."""
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
