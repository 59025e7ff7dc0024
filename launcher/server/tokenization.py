"""Text in and out: the checkpoint's tokenizer, its chat template, and incremental detokenizing.

`ModelTokenizer` reads what a Hugging Face checkpoint ships: `tokenizer.json` (the `tokenizers`
library), the chat template in `tokenizer_config.json` (Jinja, rendered in a sandbox as
transformers does) and the end-of-sequence ids of `config.json` and `generation_config.json`.

`IncrementalDetokenizer` turns a request's tokens into text one token at a time, so a stream
can send text as it comes and the full reply is the same text: the sum of its deltas equals
decoding all the tokens at once, less the bytes of a character left incomplete at the very end
(vLLM's text leaves those out too). Two things hold text back:

- a token that ends inside a UTF-8 character (byte-level BPE splits characters over tokens):
  its text is sent once the character is complete (the decode stops ending in U+FFFD);
- stop strings: the last ``len(longest stop) - 1`` characters could be the start of one, so
  they wait until the next token rules that out. A stop string cuts the text just before it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_REPLACEMENT = "\ufffd"  # what a decode ending inside a UTF-8 character ends with


class ModelTokenizer:
    def __init__(self, model_dir: str | Path, *, chat_template: str | None = None) -> None:
        """The tokenizer files in ``model_dir``; ``chat_template`` replaces the one in its
        tokenizer_config.json (`server.chat_template`)."""
        from tokenizers import Tokenizer

        directory = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        settings = _read_json(directory / "tokenizer_config.json")
        self.chat_template: str | None = chat_template or settings.get("chat_template")
        self.bos_token = _token_text(settings.get("bos_token"))
        self.eos_token = _token_text(settings.get("eos_token"))
        # Every id that ends a reply. The engine stops at config.json's ids itself; chat models
        # list their end-of-turn token in generation_config.json (and often as the tokenizer's
        # eos_token), which the server passes as stop ids.
        eos: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            eos.update(_ids(_read_json(directory / name).get("eos_token_id")))
        if self.eos_token is not None and self.tokenizer.token_to_id(self.eos_token) is not None:
            eos.add(self.tokenizer.token_to_id(self.eos_token))
        self.eos_token_ids = frozenset(eos)
        self._template: Any = None
        self._max_chars_per_token = _max_chars_per_token(self.tokenizer, directory)

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))``, found without encoding: no token covers
        more characters than its vocabulary entry spells (times what the normalizer may
        merge). 0 when the tokenizer's normalizer could shrink text without such a bound."""
        if self._max_chars_per_token is None:
            return 0
        return len(text) // self._max_chars_per_token

    @staticmethod
    def load(model_dir: str | Path, *, chat_template: str | None = None) -> ModelTokenizer | None:
        """The checkpoint's tokenizer, or None if it has no tokenizer.json."""
        if not (Path(model_dir) / "tokenizer.json").is_file():
            return None
        return ModelTokenizer(model_dir, chat_template=chat_template)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for ``messages`` (role and string content each), ending with the
        assistant's opening unless ``add_generation_prompt`` is false; ``kwargs`` reach the
        template as variables (vLLM's `chat_template_kwargs`, e.g. `enable_thinking`). Raises
        ValueError if the checkpoint has no chat template or the template rejects the
        conversation."""
        if self.chat_template is None:
            raise ValueError("this model's tokenizer_config.json has no chat_template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        from jinja2 import TemplateError

        try:
            variables = {
                **kwargs,
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token or "",
                "eos_token": self.eos_token or "",
            }
            return self._template.render(**variables)
        except TemplateError as error:
            raise ValueError(f"the chat template rejected the messages: {error}") from None


@dataclass(frozen=True)
class TextDelta:
    text: str  # new text to send (may be empty)
    num_tokens: int  # tokens of the request counted so far (up to the stop, if stopped)
    stopped: bool  # a stop string was found; nothing more will come


class IncrementalDetokenizer:
    """One request's output tokens to text, token by token, with stop strings cut exactly
    (before the stop string, or after it with ``include_stop``)."""

    def __init__(
        self,
        tokenizer: ModelTokenizer | None,
        stop: Sequence[str] = (),
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far, up to any stop string
        self._sent = 0  # characters of text already handed out
        self._prefix_offset = 0  # tokens before this are behind the decode window
        self._read_offset = 0  # tokens before this have their text in self.text
        self._searched = 0  # text before this holds no stop string
        self.stopped = False

    def add(self, token_ids: Sequence[int], *, finished: bool = False) -> TextDelta:
        """Take the next tokens; ``finished``: they are the request's last (flush everything
        but the bytes of a character that never completed)."""
        for token in token_ids:
            if self.stopped:
                break
            self.token_ids.append(token)
            self._decode_tail(flush=False)
            self._find_stop()
        if finished and not self.stopped:
            self._decode_tail(flush=True)
            self._find_stop()
        end = len(self.text)
        if not (finished or self.stopped):
            end = max(self._sent, end - self._hold)
        delta = self.text[self._sent : end]
        self._sent = end
        return TextDelta(delta, len(self.token_ids), self.stopped)

    def _decode_tail(self, *, flush: bool) -> None:
        if self.tokenizer is None:
            return
        tokens = self.token_ids
        # Decode a window that starts a token before the unread ones: tokenizers whose pieces
        # depend on their left neighbour (leading spaces) decode the new part right.
        skip = self.skip_special_tokens
        before = self.tokenizer.decode(
            tokens[self._prefix_offset : self._read_offset], skip_special_tokens=skip
        )
        now = self.tokenizer.decode(tokens[self._prefix_offset :], skip_special_tokens=skip)
        if flush:
            # The request's last tokens: bytes of a character that never completed are left
            # out, as vLLM's detokenizer leaves them (its text and ours stay the same).
            now = now.rstrip(_REPLACEMENT)
        if len(now) > len(before) and (flush or not now.endswith(_REPLACEMENT)):
            self.text += now[len(before) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(tokens)

    def _find_stop(self) -> None:
        if not self.stop:
            return
        start = max(0, self._searched - self._hold)
        found = [(i, len(s)) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if found:
            index, length = min(found)
            self.text = self.text[: index + length if self.include_stop else index]
            self.stopped = True
        self._searched = len(self.text)


# Normalizers by how many characters they may merge into one (NFC/NFKC compose at most three
# code points, Hangul jamo); any other kind (strip, strip accents, precompiled maps) can
# shrink text without bound, and then no lower bound is claimed.
_NORMALIZER_MERGE = {"NFC": 3, "NFKC": 3, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}


def _max_chars_per_token(tokenizer: Any, directory: Path) -> int | None:
    """Characters of text one token can cover at most, or None if that cannot be bounded."""
    settings = _read_json(directory / "tokenizer.json")
    merge = _normalizer_merge(settings.get("normalizer"))
    if merge is None:
        return None
    longest = max((len(piece) for piece in tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return max(1, longest) * merge


def _normalizer_merge(normalizer: Any) -> int | None:
    if normalizer is None:
        return 1
    if not isinstance(normalizer, dict):
        return None
    kind = normalizer.get("type")
    if kind == "Sequence":
        total = 1
        for part in normalizer.get("normalizers") or []:
            merge = _normalizer_merge(part)
            if merge is None:
                return None
            total *= merge
        return total
    if kind == "Replace":
        pattern = normalizer.get("pattern") or {}
        found = pattern.get("String") if isinstance(pattern, dict) else None
        content = normalizer.get("content")
        if isinstance(found, str) and isinstance(content, str) and found:
            return max(1, -(-len(found) // max(1, len(content))))
        return None
    return _NORMALIZER_MERGE.get(kind)


def check_tokenizer_dir(directory: str | Path, key: str) -> None:
    """Refuse a ``key`` (a setting naming a tokenizer directory) without a tokenizer.json."""
    if not (Path(directory) / "tokenizer.json").is_file():
        raise ValueError(
            f"{key} {str(directory)!r}: no tokenizer.json there; give a directory with a "
            "Hugging Face tokenizer's files"
        )


def check_chat_template(source: str, key: str) -> None:
    """Refuse a chat template (the setting ``key``) that is not valid Jinja."""
    from jinja2 import TemplateSyntaxError

    try:
        _compile_template(source)
    except TemplateSyntaxError as error:
        raise ValueError(f"{key}: not a valid Jinja template: {error}") from None


def _compile_template(source: str) -> Any:
    """The template in a sandbox (no attribute access to Python internals), with the settings
    and the `raise_exception` helper transformers gives chat templates."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        from jinja2 import TemplateError

        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(source)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    values = json.loads(path.read_text())
    return values if isinstance(values, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []
