"""The tokenizers checkpoints ship, on the offline path and the server alike: SentencePiece-only
ones through transformers, the chat template in chat_template.jinja, incremental decoding with
`tokenizers`' DecodeStream against the window decode, and EOS ids that end every request."""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path

import pytest

from launcher import LLM
from launcher.generation_config import with_eos_ids
from launcher.server import tokenization
from launcher.server.tokenization import IncrementalDetokenizer, ModelTokenizer
from scheduler import SamplingParams

LOCAL = {"launcher": "local", "dp_size": 1, "threads_per_rank": 1}
TEXTS = ["Experts route tokens.", "  leading spaces", "ünïcödé €100 日本語 and emoji 🙂", ""]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "How are experts routed?"},
]
CORPUS = [
    "Mixture-of-experts models route each token to a few experts.",
    "Data-parallel attention with wide expert parallelism: ünïcödé €100 日本語",
    "The quick brown fox jumps over the lazy dog, twice.",
] * 20


def _is_the_whole_decode(text: str, whole: str) -> bool:
    """Whether streamed `text` is the whole decode: all of it, or (as vLLM's text and the
    server's are) all but a character whose bytes never completed at the very end."""
    return text in (whole, whole.rstrip("\ufffd"))


def _weights_only(model_dir: str, out: Path) -> Path:
    """The checkpoint without its tokenizer files."""
    out.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(Path(model_dir) / name, out / name)
    return out


@pytest.fixture(scope="module")
def sentencepiece_dir(model_dir, tmp_path_factory) -> Path:
    """The tiny model with a SentencePiece tokenizer.model (byte fallback, as Llama's) and no
    tokenizer.json: the layout of checkpoints published before tokenizer.json."""
    import sentencepiece

    out = _weights_only(model_dir, tmp_path_factory.mktemp("sp") / "model")
    written = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=written, vocab_size=360, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2,
    )  # fmt: skip
    (out / "tokenizer.model").write_bytes(written.getvalue())
    settings = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "legacy": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    return out


# -- SentencePiece-only tokenizers ---------------------------------------------------------------
def test_a_sentencepiece_only_tokenizer_reads_as_transformers_does(sentencepiece_dir):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(sentencepiece_dir)
    tokenizer = ModelTokenizer.load(sentencepiece_dir)
    assert tokenizer is not None and not tokenizer.is_fast
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference(text)["input_ids"] and ids[:1] == [1]  # its BOS
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(
            text, add_special_tokens=False
        )
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert (tokenizer.token_to_id("</s>"), tokenizer.token_to_id("no such piece")) == (2, None)
    assert tokenizer.vocab_size == len(reference) and 2 in tokenizer.eos_token_ids
    assert tokenizer.decode_stream() is None  # decoded by windows
    rng = random.Random(0)
    for _ in range(5):  # byte-fallback pieces split characters: held back, then sent whole
        tokens = [rng.randrange(3, tokenizer.vocab_size) for _ in range(40)]
        detokenizer = IncrementalDetokenizer(tokenizer)
        deltas = [detokenizer.add([t]).text for t in tokens]
        deltas.append(detokenizer.add([], finished=True).text)
        assert _is_the_whole_decode("".join(deltas), tokenizer.decode(tokens))


def test_the_offline_path_encodes_and_decodes_with_it(sentencepiece_dir):
    prompt = "Experts route tokens"
    with LLM(str(sentencepiece_dir), **LOCAL) as llm:
        (output,) = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
        tokenizer = llm.tokenizer
    assert isinstance(tokenizer, ModelTokenizer) and not tokenizer.is_fast
    assert output.prompt_token_ids == tokenizer.encode(prompt)
    assert _is_the_whole_decode(output.text, tokenizer.decode(output.output_token_ids))


def test_without_its_packages_the_error_says_what_to_install(sentencepiece_dir, monkeypatch):
    monkeypatch.setattr(tokenization, "_installed", lambda module: module != "sentencepiece")
    message = r"SentencePiece tokenizer \(tokenizer.model\) .*\(pip install sentencepiece\)"
    with pytest.raises(ValueError, match=message):
        ModelTokenizer.load(sentencepiece_dir)
    with pytest.raises(ValueError, match=message):
        LLM(str(sentencepiece_dir), **LOCAL)  # before the group starts
    monkeypatch.setattr(tokenization, "_installed", lambda module: False)
    with pytest.raises(ValueError, match=r"needs transformers and sentencepiece \(pip install"):
        tokenization.check_tokenizer_dir(sentencepiece_dir, "tokenizer")


# -- chat templates ------------------------------------------------------------------------------
def _tokenizer_copy(model_dir: str, out: Path, chat_template) -> Path:
    """The tiny model's tokenizer files, tokenizer_config.json's chat_template replaced (or
    removed, for None)."""
    out.mkdir()
    shutil.copy(Path(model_dir) / "tokenizer.json", out)
    settings = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    settings.pop("chat_template")
    if chat_template is not None:
        settings["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    return out


def test_the_chat_template_is_found_where_transformers_finds_it(model_dir, tmp_path):
    from transformers import AutoTokenizer

    turns = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    beside = _tokenizer_copy(model_dir, tmp_path / "jinja", None)
    (beside / "chat_template.jinja").write_text(
        turns + "{% if add_generation_prompt %}>{% endif %}"
    )
    named = _tokenizer_copy(
        model_dir,
        tmp_path / "named",
        [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": turns}],
    )
    for directory in (beside, named):
        text = ModelTokenizer(directory).render_chat(MESSAGES)
        reference = AutoTokenizer.from_pretrained(directory)
        assert text == reference.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=True
        )
        assert text.startswith("[system] Be brief.\n[user] How are experts routed?\n")
    assert ModelTokenizer(beside).render_chat(MESSAGES).endswith(">")
    # The file wins over tokenizer_config.json's entry, as in transformers.
    (named / "chat_template.jinja").write_text("from the file")
    assert ModelTokenizer(named).render_chat(MESSAGES) == "from the file"
    bare = _tokenizer_copy(model_dir, tmp_path / "bare", None)
    with pytest.raises(ValueError, match=r"no chat template \(no chat_template.jinja"):
        ModelTokenizer(bare).render_chat(MESSAGES)


# -- incremental decoding ------------------------------------------------------------------------
def _deltas(tokenizer, tokens, *, stream: bool, **options) -> tuple[list[str], str, int]:
    detokenizer = IncrementalDetokenizer(tokenizer, **options)
    assert (detokenizer._stream is not None) == tokenizer.is_fast
    if not stream:
        detokenizer._stream = None
    deltas = []
    for token in tokens:
        delta = detokenizer.add([token])
        deltas.append(delta.text)
        if delta.stopped:
            break
    deltas.append(detokenizer.add([], finished=True).text)
    return deltas, detokenizer.text, len(detokenizer.token_ids)


@pytest.mark.parametrize("seed", range(8))
def test_decode_stream_and_window_decoding_send_the_same_text(model_dir, seed):
    tokenizer = ModelTokenizer(model_dir)
    rng = random.Random(seed)
    tokens = [rng.randrange(tokenizer.vocab_size) for _ in range(200)]
    skip = seed % 2 == 0  # special tokens' text left out, or kept
    full = tokenizer.decode(tokens, skip_special_tokens=skip)
    deltas, text, _ = _deltas(tokenizer, tokens, stream=True, skip_special_tokens=skip)
    assert (deltas, text) == _deltas(tokenizer, tokens, stream=False, skip_special_tokens=skip)[:2]
    assert "".join(deltas) == text and _is_the_whole_decode(text, full)
    start = next(i for i in range(len(full) // 2, len(full)) if "\ufffd" not in full[i : i + 2])
    options = {"stop": [full[start : start + 2]], "skip_special_tokens": skip}
    stopped = _deltas(tokenizer, tokens, stream=True, **options)
    assert stopped == _deltas(tokenizer, tokens, stream=False, **options)
    assert "".join(stopped[0]) == stopped[1] == full[: full.find(full[start : start + 2])]


class _RefusingStream:
    """A real DecodeStream that fails its `refuse_at`-th step as tokenizers fails a window
    whose text does not extend the previous one."""

    def __init__(self, stream, refuse_at: int) -> None:
        self.stream, self.left = stream, refuse_at

    def step(self, tokenizer, token):
        self.left -= 1
        if self.left == 0:
            raise Exception("Invalid prefix encountered")
        return self.stream.step(tokenizer, token)


def test_a_refusing_stream_hands_the_request_over_to_window_decoding(model_dir):
    tokenizer = ModelTokenizer(model_dir)
    rng = random.Random(3)
    tokens = [rng.randrange(tokenizer.vocab_size) for _ in range(120)]
    detokenizer = IncrementalDetokenizer(tokenizer)
    detokenizer._stream = _RefusingStream(detokenizer._stream, refuse_at=50)
    deltas = [detokenizer.add([t]).text for t in tokens]
    assert detokenizer._stream is None
    deltas.append(detokenizer.add([], finished=True).text)
    assert _is_the_whole_decode("".join(deltas), tokenizer.decode(tokens))


# -- EOS ids --------------------------------------------------------------------------------------
def test_with_eos_ids_adds_them_unless_the_request_ignores_eos():
    params = SamplingParams(max_tokens=3, stop_token_ids={7})
    assert with_eos_ids(params, frozenset({5, 7})).stop_token_ids == {5, 7}
    ignoring = SamplingParams(ignore_eos=True)
    assert with_eos_ids(ignoring, frozenset({5})) is ignoring


def test_every_offline_request_stops_at_the_generation_configs_eos_ids(model_dir, tmp_path):
    """vLLM's rule: generation_config.json's EOS ids end given SamplingParams too. A copy of
    the model whose file names a token the greedy run emits stops right after it."""
    prompt = [5, 9, 13, 17]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(model_dir, **LOCAL) as llm:
        (free,) = llm.generate([prompt], params, use_tqdm=False)
        known = set(llm.eos_token_ids)
    tokens = free.output_token_ids
    at = next(i for i, t in enumerate(tokens) if t not in known and t not in tokens[:i])
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokens[at]]}))
    with LLM(str(copy), **LOCAL) as llm:
        stopped, ignoring = llm.generate(
            [prompt, prompt], [SamplingParams(max_tokens=8), params], use_tqdm=False
        )
    assert (stopped.output_token_ids, stopped.finish_reason) == (tokens[: at + 1], "stop")
    assert (ignoring.output_token_ids, ignoring.finish_reason) == (tokens, "length")
