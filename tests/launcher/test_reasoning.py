"""`server.reasoning_parser`: a chat reply's <think> block as `reasoning`, the rest as
`content`, whole and streamed (launcher/server/reasoning.py).

The splitter is checked against its own whole-text rule under every way of cutting the text
into pieces (a tag split over tokens must never leak into a field); the server is checked
end to end on the tiny model, its reply forced by a regex into a think block and an answer,
against the same request to a server without a parser.
"""

from __future__ import annotations

import json
import random
import urllib.request

import pytest
from server_harness import ServerThread

from dist_engine.engine.config import EngineConfig
from launcher.server.config import ServerConfig
from launcher.server.reasoning import ReasoningSplitter, prompt_opens_thinking, split_whole

TEXTS = [
    "",
    "plain answer",
    "abc</think>\n\nanswer",
    "<think>abc</think>x",
    "<think>\nstill thinking",
    "</think>only content",
    "a < b </thi nk> c </think> d </think> e",
    "<thin",
    "<think></think>",
    "x<think>y</think>z",
]


@pytest.mark.parametrize(
    ("parser", "prompt", "text", "expected"),
    [
        ("deepseek_r1", "", "abc</think>\n\nanswer", ("abc", "\n\nanswer")),
        ("deepseek_r1", "", "<think>abc</think>x", ("abc", "x")),
        ("deepseek_r1", "", "never closed", ("never closed", None)),
        ("deepseek_r1", "", "</think>x", (None, "x")),
        ("deepseek_r1", "", "a</think>b</think>c", ("a", "b</think>c")),
        ("qwen3", "", "hello", (None, "hello")),
        ("qwen3", "", "<think>r</think>c", ("r", "c")),
        ("qwen3", "", "<think>r", ("r", None)),
        ("qwen3", "<|im_start|>assistant\n<think>\n", "r</think>c", ("r", "c")),
        ("qwen3", "<think>\n\n</think>\n\n", "answer", (None, "answer")),
    ],
)
def test_a_whole_reply_splits_at_the_first_closing_tag(parser, prompt, text, expected):
    assert split_whole(parser, prompt, text) == expected


def test_the_prompt_decides_whether_a_reply_opens_inside_a_think_block():
    assert prompt_opens_thinking("user: hi\nassistant: <think>\n")
    assert not prompt_opens_thinking("assistant: <think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("assistant:")


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_add_up_to_the_whole_split_however_the_text_is_cut(parser, text):
    whole = ReasoningSplitter(parser).feed(text, final=True)
    rng = random.Random(hash(text) & 0xFFFF)
    cuts = [[1] * len(text), *([rng.randint(1, 4) for _ in text] for _ in range(20))]
    for sizes in cuts:
        splitter, reasoning, content, start = ReasoningSplitter(parser), [], [], 0
        for size in sizes:
            piece = splitter.feed(text[start : start + size])
            reasoning.append(piece.reasoning)
            content.append(piece.content)
            start += size
        last = splitter.feed("", final=True)
        assert "".join(reasoning) + last.reasoning == whole.reasoning, sizes
        assert "".join(content) + last.content == whole.content, sizes


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ReasoningSplitter("r2")
    with pytest.raises(ValueError, match=r"server\.reasoning_parser must be one of"):
        ServerConfig(reasoning_parser="r2")


# -- the server --------------------------------------------------------------------------------
ENGINE = {
    "dtype": "float32",
    "parallel": {"dp_size": 1, "launcher": "local", "threads_per_rank": 1},
    "scheduler": {"max_num_seqs": 8, "max_model_len": 256, "num_blocks": 256, "block_size": 8},
}
# The reply the regex forces: a think block, then an answer.
FORCED = "<think>[a-z]{6}</think>[a-z]{4}"
# A template that, as Qwen3's with enable_thinking false, closes an empty think block in the
# prompt: the reply's grammar then applies from its first token (with the block open, it would
# apply only after the reply's own </think>), so the regex above can force a think block.
NO_THINKING = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] <think>\n\n</think>\n\n{% endif %}"
)


def _post(url: str, body: dict) -> bytes:
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return reply.read()


def _ask(url: str, **extra) -> dict:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "think, then answer"}],
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 11,
        "structured_outputs": {"regex": FORCED},
        **extra,
    }
    if not body.get("stream"):
        return json.loads(_post(url, body))
    events = _post(url, body).decode().split("\n\n")
    deltas = [
        json.loads(e.removeprefix("data: "))["choices"][0]["delta"]
        for e in events
        if e.startswith("data: {") and json.loads(e.removeprefix("data: "))["choices"]
    ]
    return {
        "reasoning": "".join(d.get("reasoning", "") for d in deltas),
        "reasoning_content": "".join(d.get("reasoning_content", "") for d in deltas),
        "content": "".join(d.get("content") or "" for d in deltas),
    }


@pytest.fixture(scope="module")
def servers(model_dir):
    engine = EngineConfig.from_dict({"model": model_dir, **ENGINE})
    plain = ServerThread(
        engine, ServerConfig(port=0, served_model_name="tiny", chat_template=NO_THINKING)
    )
    parsing = ServerThread(
        engine,
        ServerConfig(
            port=0, served_model_name="tiny", reasoning_parser="qwen3", chat_template=NO_THINKING
        ),
    )
    yield plain, parsing
    plain.stop()
    parsing.stop()


def test_chat_replies_carry_the_think_block_as_reasoning_whole_and_streamed(servers):
    plain, parsing = servers
    full = _ask(plain.url)["choices"][0]["message"]
    assert "reasoning" not in full
    text = full["content"]
    assert text.startswith("<think>") and "</think>" in text
    thought, answer = text.removeprefix("<think>").split("</think>")
    message = _ask(parsing.url)["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (thought, answer)
    assert message["reasoning_content"] == thought
    streamed = _ask(parsing.url, stream=True)
    assert streamed == {"reasoning": thought, "reasoning_content": thought, "content": answer}
    hidden = _ask(parsing.url, include_reasoning=False)["choices"][0]["message"]
    assert hidden["content"] == answer and "reasoning" not in hidden
    quiet = _ask(parsing.url, include_reasoning=False, stream=True)
    assert quiet == {"reasoning": "", "reasoning_content": "", "content": answer}
    # Completions are left alone, as vLLM leaves them.
    body = {"model": "tiny", "prompt": "x", "max_tokens": 20, "seed": 3, "temperature": 1.0}
    body["structured_outputs"] = {"regex": FORCED}
    request = urllib.request.Request(
        f"{parsing.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        completion = json.loads(reply.read())["choices"][0]
    assert completion["text"].startswith("<think>") and "reasoning" not in completion


def test_structured_output_constrains_the_answer_after_the_thinking(servers, model_dir):
    """vLLM's rule: with a reasoning parser, the grammar applies after the reply's </think>
    (deepseek_r1 always; qwen3 unless the prompt closed the block), not to the reasoning."""
    from dataclasses import replace

    from launcher.server.protocol import parse_chat

    _, parsing = servers
    limits = parsing.server.limits
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
            "response_format": {"type": "json_object"}}  # fmt: skip
    marker = tuple(limits.tokenizer.encode("</think>", add_special_tokens=False))
    r1 = replace(limits, reasoning_parser="deepseek_r1")
    assert parse_chat(body, r1).params.grammar_after == marker
    assert parse_chat(body, limits).params.grammar_after == ()  # qwen3, the block closed
    thinking = replace(limits, tokenizer=_OpenTemplate(limits.tokenizer))
    assert parse_chat(body, thinking).params.grammar_after == marker  # qwen3, block open
    assert parse_chat(body, replace(limits, reasoning_parser=None)).params.grammar_after == ()
    plain = {key: value for key, value in body.items() if key != "response_format"}
    assert parse_chat(plain, r1).params.grammar is None  # no grammar, no marker


class _OpenTemplate:
    """The server's tokenizer with a template that leaves the think block open (Qwen3 with
    thinking on, R1)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def render_chat(self, messages, add_generation_prompt=True, **kwargs):
        return "[user] x\n[assistant] <think>\n"

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)
