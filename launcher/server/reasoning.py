"""Splitting a reasoning model's reply into its reasoning and its answer (vLLM's
`--reasoning-parser`), for /v1/chat/completions.

DeepSeek-R1 and Qwen3 think inside `<think> ... </think>` before they answer. With
`server.reasoning_parser` set, a chat reply's message (or each streamed delta) carries the text
inside the block as `reasoning` (vLLM's field; `reasoning_content`, the name DeepSeek's API and
earlier vLLM releases use, carries the same) and what follows `</think>` as `content`:

- `deepseek_r1`: the reply is reasoning from its start (R1's chat template opens the block in
  the prompt; a `<think>` the model writes itself is dropped) up to the first `</think>`; a
  reply that never closes the block is reasoning only.
- `qwen3`: the same where the prompt leaves a `<think>` open or the reply opens one first;
  otherwise (thinking switched off, the template having closed an empty block in the prompt)
  the whole reply is content.

Streaming holds back the tail of the text that could still become a tag (at most its length
less one character), as the stop strings' hold-back does, so a tag split over several tokens
never leaks into either field. Completions (/v1/completions) are left alone, as vLLM leaves
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OPEN = "<think>"
CLOSE = "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class Split:
    """What one piece of reply text adds to each field."""

    reasoning: str = ""
    content: str = ""


# How many of a chat prompt's last tokens show whether its template left a <think> open.
PROMPT_TAIL = 32


def prompt_end(tokenizer: Any, prompt_ids: list[int]) -> str:
    """The text of a chat prompt's last `PROMPT_TAIL` tokens, special tokens kept."""
    return tokenizer.decode(prompt_ids[-PROMPT_TAIL:], skip_special_tokens=False)


def thinks_first(parser: str, prompt_text: str) -> bool:
    """Whether a reply may start inside a think block: under deepseek_r1 always (its template
    opens the block), under qwen3 unless the prompt closed one already (thinking off)."""
    closed = OPEN in prompt_text and not prompt_opens_thinking(prompt_text)
    return parser == "deepseek_r1" or not closed


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the prompt's text ends inside a think block (its last `<think>` not closed)."""
    opened = prompt_text.rfind(OPEN)
    return opened >= 0 and prompt_text.rfind(CLOSE) < opened


class ReasoningSplitter:
    """One reply's text, fed piece by piece, split into reasoning and content."""

    def __init__(self, parser: str, prompt_text: str = "") -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {parser!r}")
        self.parser = parser
        open_in_prompt = prompt_opens_thinking(prompt_text)
        # "start": the reply's first characters decide (an opening tag may come);
        # "reasoning": inside the block; "content": after it (or no block at all).
        self._phase = "start"
        self._reasoning_by_default = parser == "deepseek_r1" or open_in_prompt
        self._pending = ""  # text not yet given to either field

    def feed(self, text: str, *, final: bool = False) -> Split:
        """The next piece of the reply's text; ``final``: the reply ends here (nothing is
        held back)."""
        self._pending += text
        reasoning, content = [], []
        while True:
            if self._phase == "start":
                if self._pending.startswith(OPEN):
                    self._pending = self._pending[len(OPEN) :]
                    self._phase = "reasoning"
                    continue
                if OPEN.startswith(self._pending) and not final:
                    break  # still maybe the opening tag
                self._phase = "reasoning" if self._reasoning_by_default else "content"
                continue
            if self._phase == "content":
                content.append(self._pending)
                self._pending = ""
                break
            end = self._pending.find(CLOSE)
            if end >= 0:
                reasoning.append(self._pending[:end])
                self._pending = self._pending[end + len(CLOSE) :]
                self._phase = "content"
                continue
            keep = 0 if final else partial_suffix(self._pending, CLOSE)
            reasoning.append(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            break
        return Split("".join(reasoning), "".join(content))


def split_whole(parser: str, prompt_text: str, text: str) -> tuple[str | None, str | None]:
    """A whole reply as (reasoning, content), each None where empty (vLLM's message)."""
    split = ReasoningSplitter(parser, prompt_text).feed(text, final=True)
    return split.reasoning or None, split.content or None


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (shorter than it)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
