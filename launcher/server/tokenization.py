"""Text in and out: the checkpoint's tokenizer, its chat template, and incremental detokenizing.

`ModelTokenizer` reads what a Hugging Face checkpoint ships: `tokenizer.json` (the `tokenizers`
library), or, where a checkpoint has none, a SentencePiece `tokenizer.model` through
`transformers.AutoTokenizer`; the chat template of `chat_template.jinja` or
`tokenizer_config.json` (Jinja, rendered in a sandbox as transformers does); the
end-of-sequence ids of `config.json`, `generation_config.json` and the tokenizer's eos_token.
The server and the offline `LLM` use the same class.

`IncrementalDetokenizer` turns a request's tokens into text one token at a time, so a stream
can send text as it comes and the full reply is the same text: the sum of its deltas equals
decoding all the tokens at once, less the bytes of a character left incomplete at the very end
(vLLM's text leaves those out too). Two things hold text back:

- a token that ends inside a UTF-8 character (byte-level BPE splits characters over tokens):
  its text is sent once the character is complete (the decode stops ending in U+FFFD); a
  byte-fallback piece (SentencePiece's <0xNN>) waits for the end of its run of bytes, which
  decodes as one;
- stop strings: the last ``len(longest stop) - 1`` characters could be the start of one, so
  they wait until the next token rules that out. A stop string cuts the text just before it.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

TOKENIZER_FILE = "tokenizer.json"
# What a checkpoint without tokenizer.json may ship instead: a SentencePiece model, which
# transformers converts (it needs the sentencepiece package for that).
SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # the hub's newer place for the chat template
_REPLACEMENT = "\ufffd"  # what a decode ending inside a UTF-8 character ends with


class ModelTokenizer:
    def __init__(self, model_dir: str | Path, *, chat_template: str | None = None) -> None:
        """The tokenizer files in ``model_dir``; ``chat_template`` replaces the checkpoint's
        (`server.chat_template`). Raises ValueError when the tokenizer needs a package that is
        not installed, naming it, and FileNotFoundError when there are no tokenizer files."""
        directory = Path(model_dir)
        # A `tokenizers.Tokenizer`, or transformers' tokenizer behind the same methods.
        self.tokenizer: Any = _read_tokenizer(directory)
        settings = _read_json(directory / "tokenizer_config.json")
        self.chat_template: str | None = chat_template or _chat_template(directory, settings)
        self.bos_token = _token_text(settings.get("bos_token"))
        self.eos_token = _token_text(settings.get("eos_token"))
        # Every id that ends a reply. The engine stops at config.json's ids itself; chat models
        # list their end-of-turn token in generation_config.json (and often as the tokenizer's
        # eos_token), which the front ends pass as stop ids.
        eos: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            eos.update(_ids(_read_json(directory / name).get("eos_token_id")))
        if self.eos_token is not None and self.token_to_id(self.eos_token) is not None:
            eos.add(self.token_to_id(self.eos_token))
        self.eos_token_ids = frozenset(eos)
        # SentencePiece's byte-fallback pieces (<0x00> to <0xFF>, Llama's and Mistral's
        # tokenizers): a run of them decodes as one, and a run that is not UTF-8 becomes one
        # U+FFFD per piece, so a later byte can change the text of earlier ones.
        self.byte_fallback_ids = frozenset(
            i for b in range(256) if (i := self.token_to_id(f"<0x{b:02X}>")) is not None
        )
        self._template: Any = None
        self._max_chars_per_token = (
            _max_chars_per_token(self.tokenizer, directory) if self.is_fast else None
        )

    @property
    def is_fast(self) -> bool:
        """Whether the `tokenizers` library reads this tokenizer itself (from tokenizer.json)."""
        return not isinstance(self.tokenizer, _TransformersTokenizer)

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))``, found without encoding: no token covers
        more characters than its vocabulary entry spells (times what the normalizer may
        merge). 0 when the tokenizer's normalizer could shrink text without such a bound."""
        if self._max_chars_per_token is None:
            return 0
        return len(text) // self._max_chars_per_token

    @staticmethod
    def load(model_dir: str | Path, *, chat_template: str | None = None) -> ModelTokenizer | None:
        """The checkpoint's tokenizer, or None if it has no tokenizer files."""
        if tokenizer_file(model_dir) is None:
            return None
        return ModelTokenizer(model_dir, chat_template=chat_template)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` (a vocabulary entry or an added token), or None."""
        return self.tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Entries of the vocabulary, added tokens included."""
        return self.tokenizer.get_vocab_size()

    def decode_stream(self, *, skip_special_tokens: bool = True) -> Any:
        """A `tokenizers.decoders.DecodeStream` for this tokenizer, or None where it does not
        serve: transformers' tokenizers, byte-fallback ones (a stream sends a byte's text
        before the next byte could change it), tokenizers older than 0.21."""
        if not self.is_fast or self.byte_fallback_ids:
            return None
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:
            return None
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text for ``messages`` (role and string content each), ending with the
        assistant's opening unless ``add_generation_prompt`` is false; ``kwargs`` reach the
        template as variables (vLLM's `chat_template_kwargs`, e.g. `enable_thinking`, and the
        request's `tools`). ``continue_final_message``: the text ends inside the last message,
        right after its content (whatever the template closes it with is cut, as transformers
        cuts it), so the reply continues it. Raises ValueError if the checkpoint has no chat
        template or the template rejects the conversation."""
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError(
                    "continue_final_message continues the last message; it cannot also "
                    "open a new one (set add_generation_prompt false)"
                )
            final = (messages[-1].get("content") or "").strip() if messages else ""
            text = self.render_chat(messages, False, **kwargs)
            if not final or final not in text:
                raise ValueError(
                    "continue_final_message: the last message's content does not appear in "
                    "the rendered prompt (or is empty), so there is nothing to continue"
                )
            return text[: text.rindex(final) + len(final)]
        if self.chat_template is None:
            raise ValueError(
                f"this model has no chat template (no {CHAT_TEMPLATE_FILE}, and none in "
                "tokenizer_config.json); give one with --chat-template"
            )
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
    (before the stop string, or after it with ``include_stop``).

    Each token is decoded in a window that starts a token before the unread ones (tokenizers
    whose pieces depend on their left neighbour, leading spaces, decode the new part right):
    by `tokenizers`' `DecodeStream` where the tokenizer has one, one call per token, else by
    decoding the window and the part of it already read. Both keep the same two offsets, so a
    request can change from the one to the other at any token (a stream that refuses a window
    whose text does not extend the previous one; the end of a request, whose tail is decoded
    even inside a character)."""

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
        self._stream = (
            tokenizer.decode_stream(skip_special_tokens=skip_special_tokens)
            if tokenizer is not None
            else None
        )

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
        if self._stream is not None and not flush:
            try:
                piece = self._stream.step(self.tokenizer.tokenizer, tokens[-1])
            except Exception:  # tokenizers refuses a window whose text does not extend the last
                self._stream = None  # this request decodes windows from here on
            else:
                if piece is not None:
                    self._took(piece)
                return
        if self._read_offset == len(tokens):
            return  # flushing with nothing unread
        if not flush and tokens[-1] in self.tokenizer.byte_fallback_ids:
            return  # the next token may be a byte of the same run
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
            self._took(now[len(before) :])

    def _took(self, piece: str) -> None:
        """The text of the tokens up to the last: the window moves past them."""
        self.text += piece
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)

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


def tokenizer_file(directory: str | Path) -> Path | None:
    """The file a tokenizer is read from in ``directory``: tokenizer.json, else a SentencePiece
    model; None if there is neither."""
    for name in (TOKENIZER_FILE, *SENTENCEPIECE_FILES):
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    return None


def check_tokenizer_dir(directory: str | Path, key: str, *, required: bool = True) -> None:
    """Refuse a tokenizer directory (the setting ``key``) that cannot be read: without
    tokenizer files (``required``), or with only a SentencePiece model while transformers or
    sentencepiece is missing. Reads no tokenizer, so it is cheap before any rank starts."""
    found = tokenizer_file(directory)
    if found is None:
        if required:
            raise ValueError(
                f"{key} {str(directory)!r}: no {TOKENIZER_FILE} there (nor a SentencePiece "
                f"{' or '.join(SENTENCEPIECE_FILES)}); give a directory with a Hugging Face "
                "tokenizer's files"
            )
        return
    if found.name != TOKENIZER_FILE:
        missing = [m for m in ("transformers", "sentencepiece") if not _installed(m)]
        if missing:
            raise ValueError(_needs_packages(found, missing))


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _needs_packages(found: Path, missing: list[str]) -> str:
    return (
        f"{found.parent} has a SentencePiece tokenizer ({found.name}) and no {TOKENIZER_FILE}: "
        f"reading it needs {' and '.join(missing)} (pip install {' '.join(missing)}), or "
        f"save the tokenizer with a {TOKENIZER_FILE}"
    )


def _read_tokenizer(directory: Path) -> Any:
    found = tokenizer_file(directory)
    if found is None:
        raise FileNotFoundError(
            f"{directory}: no {TOKENIZER_FILE} (nor {' or '.join(SENTENCEPIECE_FILES)})"
        )
    if found.name == TOKENIZER_FILE:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(found))
    return _TransformersTokenizer(found)


class _Encoding(NamedTuple):
    ids: list[int]


class _TransformersTokenizer:
    """A tokenizer only transformers reads (a SentencePiece model without tokenizer.json),
    behind the part of `tokenizers.Tokenizer`'s interface that `ModelTokenizer` uses, so both
    encode and decode exactly as transformers does."""

    def __init__(self, found: Path) -> None:
        check_tokenizer_dir(found.parent, "tokenizer")
        from transformers import AutoTokenizer

        try:
            # local_files_only: the directory is complete; no custom code is run.
            self._tokenizer = AutoTokenizer.from_pretrained(
                str(found.parent), local_files_only=True
            )
        except ImportError as error:  # a further package the tokenizer class asks for
            raise ValueError(f"{found.parent}: reading its tokenizer needs: {error}") from None
        except (OSError, ValueError) as error:
            raise ValueError(
                f"{found.parent}: transformers could not read the tokenizer in {found.name}: "
                f"{error}"
            ) from None
        self._vocab: dict[str, int] = self._tokenizer.get_vocab()

    def encode(self, text: str, add_special_tokens: bool = True) -> _Encoding:
        return _Encoding(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        # Not convert_tokens_to_ids: that gives the unknown token's id for a missing one.
        return self._vocab.get(token)

    def get_vocab_size(self) -> int:
        return len(self._vocab)

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return dict(self._vocab)


def _chat_template(directory: Path, settings: dict[str, Any]) -> str | None:
    """The checkpoint's chat template, found as transformers finds it: chat_template.jinja
    (the hub's newer layout) over tokenizer_config.json's `chat_template`, which is a template
    or a list of named ones (then the one named "default")."""
    path = directory / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


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

    def tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # As transformers renders it (what vLLM's prompts are made with): JSON as json.dumps
        # writes it, where Jinja's own filter escapes <, >, & and ' for HTML. Tool
        # definitions in Qwen's and Hermes' templates go through it.
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(format: str) -> str:  # Llama 3's templates date their system prompt
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    environment.filters["tojson"] = tojson
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
