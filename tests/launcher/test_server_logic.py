"""The server's pure parts, without a server: incremental detokenizing and stop strings, the
chat template against transformers, request validation, settings, step counters."""

from __future__ import annotations

import dataclasses
import random

import pytest

from dist_engine.engine.config import EngineConfig
from dist_engine.engine.engine import StepTrace
from dist_engine.engine.stats import StepCounters
from launcher.cli import build_parser
from launcher.server.config import ServerConfig
from launcher.server.protocol import ModelLimits, RequestError, parse_chat, parse_completion
from launcher.server.serve import load_configs
from launcher.server.tokenization import IncrementalDetokenizer, ModelTokenizer
from scheduler import AttemptPoint, GroupView, StepKind


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> ModelTokenizer:
    return ModelTokenizer(model_dir)


def random_tokens(seed: int, count: int, vocab: int) -> list[int]:
    # Random ids include lone bytes of multi-byte UTF-8 characters and special tokens: the
    # cases where decoding token by token can go wrong.
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(count)]


# -- detokenizing -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(20))
def test_token_by_token_text_is_the_whole_decode(tokenizer, seed):
    tokens = random_tokens(seed, 40, tokenizer.tokenizer.get_vocab_size())
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add([t]).text for t in tokens[:-1]]
    deltas.append(detokenizer.add(tokens[-1:], finished=True).text)
    # The whole decode, less a character whose bytes never completed at the very end.
    assert "".join(deltas) == tokenizer.decode(tokens).rstrip("\ufffd")


def test_a_character_split_over_tokens_is_sent_whole(tokenizer):
    byte_ids = [tokenizer.tokenizer.token_to_id(c) for c in "â\u0124¬"]  # "€" as 3 byte symbols
    assert None not in byte_ids and tokenizer.decode(byte_ids) == "€"
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.add([t]).text for t in byte_ids] == ["", "", "€"]


@pytest.mark.parametrize("seed", range(10))
def test_stop_strings_cut_the_text_exactly(tokenizer, seed):
    vocab = tokenizer.tokenizer.get_vocab_size()
    tokens = random_tokens(100 + seed, 60, vocab)
    full = tokenizer.decode(tokens)
    # A stop string a user could send: no U+FFFD (the stand-in for bytes that are not text).
    start = next(i for i in range(len(full) // 3, len(full)) if "\ufffd" not in full[i : i + 3])
    stop = full[start : start + 3]
    expected = full[: full.find(stop)]
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["never-in-this-text", stop])
    sent = []
    for token in tokens:
        delta = detokenizer.add([token])
        sent.append(delta.text)
        if delta.stopped:
            break
    assert delta.stopped and "".join(sent) == expected == detokenizer.text
    # The token that completed the stop string is the last one taken.
    assert expected + stop in tokenizer.decode(detokenizer.token_ids)
    assert expected + stop not in tokenizer.decode(detokenizer.token_ids[:-1])


def test_text_that_could_start_a_stop_string_waits(tokenizer):
    ids = tokenizer.encode("abcabd")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["abd"])
    texts = [detokenizer.add([t]).text for t in ids]
    assert "".join(texts) == "abc" and detokenizer.stopped
    # With nothing held back past the end, a finished request sends the rest.
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["xyz"])
    detokenizer.add(tokenizer.encode("hello x"))
    assert detokenizer.add([], finished=True).text.endswith("x")


# -- the chat template --------------------------------------------------------------------------
def test_the_chat_template_renders_as_transformers_does(model_dir, tokenizer):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "How are experts routed?"},
    ]
    text = tokenizer.render_chat(messages)
    assert text == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == reference(text, add_special_tokens=False)["input_ids"]
    # The turn markers are single special tokens, and the end of a turn ends a reply.
    end = tokenizer.tokenizer.token_to_id("<|im_end|>")
    assert ids.count(tokenizer.tokenizer.token_to_id("<|im_start|>")) == 5
    assert end in tokenizer.eos_token_ids and 0 in tokenizer.eos_token_ids


# -- validation ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limits(tokenizer) -> ModelLimits:
    return ModelLimits("tiny", max_model_len=64, vocab_size=384, num_ranks=2, tokenizer=tokenizer)


BASE = {"model": "tiny", "prompt": [1, 2, 3]}


@pytest.mark.parametrize(
    ("change", "param", "status", "words"),
    [
        ({"n": 0}, "n", 400, "n must be an int >= 1, got 0"),
        ({"n": True}, "n", 400, "n must be an int >= 1, got True"),
        ({"n": 2, "best_of": 1}, "best_of", 400, "best_of (1) must be >= n (2)"),
        ({"n": 200}, "n", 400, "more than this server takes in one request (128)"),
        ({"best_of": 3, "stream": True}, "best_of", 400, "best_of > n cannot stream"),
        ({"use_beam_search": True}, "use_beam_search", 400, "use_beam_search=True is not"),
        ({"suffix": "x"}, "suffix", 400, "suffix='x' is not supported"),
        ({"min_tokens": 20}, "min_tokens", 400, "min_tokens (20) must be <= max_tokens (16)"),
        ({"repetition_penalty": 0}, "repetition_penalty", 400, "[0.01, 100.0]"),
        ({"presence_penalty": 3}, "presence_penalty", 400, "[-2.0, 2.0]"),
        ({"min_p": 2}, "min_p", 400, "min_p must be a number in [0.0, 1.0]"),
        ({"logit_bias": {"x": 1}}, "logit_bias", 400, "logit_bias key 'x' is not a token id"),
        ({"logit_bias": {"500": 1}}, "logit_bias", 400, "not a token id in [0, 384)"),
        ({"logit_bias": {"5": 101}}, "logit_bias", 400, "logit_bias[5] must be a number in"),
        ({"logprobs": 21}, "logprobs", 400, "logprobs must be an int in [0, 20] or null"),
        ({"prompt_logprobs": -2}, "prompt_logprobs", 400, "prompt_logprobs must be an int in"),
        ({"max_tokens": 0}, "max_tokens", 400, "max_tokens must be an int >= 1, got 0"),
        ({"max_tokens": 62}, "max_tokens", 400, "leave 61 of max_model_len 64"),
        ({"temperature": -1}, "temperature", 400, "temperature must be a number in [0.0, 2.0]"),
        ({"temperature": "hot"}, "temperature", 400, "'hot'"),
        ({"top_p": 0}, "top_p", 400, "top_p must be in (0, 1]"),
        ({"top_k": -2}, "top_k", 400, "top_k must be an int >= 0"),
        ({"seed": -1}, "seed", 400, "seed must be an int in [0, 2**63)"),
        ({"stop": 5}, "stop", 400, "stop must be a string or a list of strings"),
        ({"stop_token_ids": [384]}, "stop_token_ids", 400, "[0, 384)"),
        ({"dp_rank": 2}, "dp_rank", 400, "dp_rank must be an int in [0, 2)"),
        ({"stream_options": {"include_usage": True}}, "stream_options", 400, "stream: true"),
        ({"stream": True, "stream_options": {"x": 1}}, "stream_options", 400, "continuous"),
        ({"model": "gpt-4"}, "model", 404, "'gpt-4' does not exist"),
        ({"prompt": []}, "prompt", 400, "prompt is empty"),
        ({"prompt": [1, 400]}, "prompt", 400, "token id 400 at position 1 is outside"),
        ({"prompt": [[1], []]}, "prompt[1]", 400, "prompt[1] is empty"),
        ({"prompt": [[1], [400]]}, "prompt[1]", 400, "prompt[1] token id 400 at position 0"),
        ({"prompt": [[1]] * 129}, "prompt", 400, "holds 129 prompts; this server takes at most"),
        ({"prompt": {"text": "a"}}, "prompt", 400, "prompt must be a string, a list of token"),
        ({"prompt": list(range(1, 65))}, "prompt", 400, "64 tokens; max_model_len is 64"),
    ],
)
def test_bad_completion_requests_name_the_field(limits, change, param, status, words):
    with pytest.raises(RequestError) as info:
        parse_completion({**BASE, **change}, limits)
    assert (info.value.param, info.value.status) == (param, status)
    assert words in info.value.message


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "robot", "content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
        ([{"role": "user"}], "messages[0].content"),
    ],
)
def test_bad_chat_messages_name_the_field(limits, messages, param):
    with pytest.raises(RequestError) as info:
        parse_chat({"model": "tiny", "messages": messages}, limits)
    assert info.value.param == param and param in info.value.message


def test_a_good_request_becomes_its_sampling_params(limits, tokenizer):
    request = parse_completion(
        {
            **BASE,
            "max_tokens": 5,
            "temperature": 0,
            "top_k": -1,
            "seed": 7,
            "stop": "ab",
            "stop_token_ids": [9],
            "stream": True,
            "stream_options": {"include_usage": True},
            "dp_rank": 1,
            "return_token_ids": True,
            "n": 1,
            "presence_penalty": 0,
        },
        limits,
    )
    params = request.params
    assert (params.max_tokens, params.temperature, params.top_k, params.seed) == (5, 0.0, 0, 7)
    assert params.stop_token_ids == {9} | tokenizer.eos_token_ids  # + the end-of-turn ids
    assert request.stop == ("ab",) and request.stream and request.include_usage
    assert (request.dp_rank, request.return_token_ids) == (1, True)
    assert not parse_completion({**BASE, "ignore_eos": True}, limits).params.stop_token_ids
    # Completions default to OpenAI's 16 tokens; chat to the rest of the context.
    assert parse_completion(BASE, limits).params.max_tokens == 16
    chat = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, limits)
    assert chat.params.max_tokens == 64 - len(chat.prompt_token_ids)
    assert parse_completion({**BASE, "prompt": "Hello"}, limits).prompt_token_ids == (
        tokenizer.encode("Hello")
    )


def test_unknown_fields_are_ignored_and_named_or_refused_when_strict(limits):
    body = {**BASE, "frobnicate": 1, "ttl": 2, "user": "u", "metadata": {"a": 1}}
    request = parse_completion(body, limits)
    assert request.ignored_fields == ("frobnicate", "ttl")  # user/metadata change nothing
    strict = dataclasses.replace(limits, strict_requests=True)
    with pytest.raises(RequestError, match=r"unrecognized request argument\(s\): \['frobnic"):
        parse_completion(body, strict)
    # vLLM's neutral values always pass: vllm bench serve sends repetition_penalty 1.0.
    neutral = {"repetition_penalty": 1.0, "use_beam_search": False, "suffix": None, "n": 1}
    assert parse_completion({**BASE, **neutral}, strict).params.repetition_penalty == 1.0


def test_vllms_fields_become_the_sampling_params(limits):
    request = parse_completion(
        {
            **BASE,
            "prompt": [[1, 2], [3, 4, 5]],
            "n": 2,
            "best_of": 3,
            "seed": 11,
            "min_p": 0.1,
            "min_tokens": 2,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "logit_bias": {"7": -5, "9": 2.5},
            "logprobs": 3,
            "echo": True,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
        },
        limits,
    )
    params = request.params
    assert request.prompts == [[1, 2], [3, 4, 5]] and (request.n, request.best_of) == (2, 3)
    assert (params.min_p, params.min_tokens, params.presence_penalty) == (0.1, 2, 0.5)
    assert (params.frequency_penalty, params.repetition_penalty) == (-0.5, 1.2)
    assert params.logit_bias == {7: -5.0, 9: 2.5} and params.logprobs == 3
    assert params.prompt_logprobs == 3 and request.echo  # echo with logprobs scores the prompt
    assert request.include_stop_str_in_output and not request.skip_special_tokens
    # Six samples (2 prompts x best_of 3); each sample of a prompt has its own stream.
    seeds = [request.sample_params(s).seed for s in range(request.num_samples)]
    assert seeds[0] == seeds[3] == 11 and len(set(seeds[:3])) == 3
    assert seeds[:3] == seeds[3:]  # the same per-sample seeds for each prompt
    chat = parse_chat(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": True,
            "top_logprobs": 4,
            "stream": True,
            "stream_options": {"continuous_usage_stats": True},
        },
        limits,
    )
    assert chat.logprobs == 4 and chat.continuous_usage and not chat.include_usage
    with pytest.raises(RequestError, match="top_logprobs needs logprobs: true"):
        parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                    "top_logprobs": 2}, limits)  # fmt: skip


# -- settings -----------------------------------------------------------------------------------
def test_server_settings_are_checked():
    with pytest.raises(ValueError, match=r"server.max_pending_requests must be an int >= 1"):
        ServerConfig(max_pending_requests=0)
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['server.prot'\]"):
        ServerConfig.from_dict({"prot": 1})
    with pytest.raises(ValueError, match=r"server.routing must be one of"):
        ServerConfig(routing="random")
    assert ServerConfig().host == "127.0.0.1"  # loopback unless told otherwise


def test_serve_splits_the_yaml_and_the_overrides(model_dir, tmp_path, monkeypatch):
    path = tmp_path / "job.yaml"
    path.write_text(
        f"model: {model_dir}\nparallel: {{dp_size: 1, launcher: local}}\n"
        "server: {port: 9000, max_pending_requests: 8}\n"
    )
    monkeypatch.setenv("LOCKSTEP_API_KEY", "from-env")
    parser, _ = build_parser()
    sets = ["server.drain_timeout_s=2", "routing=round_robin", "max_num_seqs=4"]
    argv = ["serve", "--config", str(path), "--port", "0"]
    args = parser.parse_args(argv + [f"--set={item}" for item in sets])
    engine, server = load_configs(args, lambda: pytest.fail("not the built-in"))
    assert engine.scheduler.max_num_seqs == 4 and engine.parallel.launcher == "local"
    assert (server.port, server.max_pending_requests, server.drain_timeout_s) == (0, 8, 2)
    assert (server.routing, server.api_key) == ("round_robin", "from-env")
    engine, _ = load_configs(parser.parse_args(["serve"]), lambda: {"model": model_dir})
    assert engine == EngineConfig(model=model_dir)


# -- step counters ------------------------------------------------------------------------------
def test_step_counters_sort_steps_and_votes():
    view = GroupView(False, True, False, False, 0, False, 3)

    def trace(kind, num_seqs, point=AttemptPoint.NONE, group=None, second=None, decoding=0):
        return StepTrace(
            0, kind, point, group, second, num_seqs, num_seqs, 0.0, 0.0, 0.0, 0.0, decoding
        )

    counters = StepCounters()
    for item in [
        trace(StepKind.PREFILL, 2, AttemptPoint.ANY, view, True),
        trace(StepKind.DECODE, 2),
        trace(StepKind.DECODE, 0),  # the group decodes, this rank has nothing: a placeholder
        trace(StepKind.PREFILL, 0, AttemptPoint.ALL, view, True),
        trace(StepKind.EMPTY, 0, AttemptPoint.IDLE, view),
        trace(StepKind.PREFILL, 3, AttemptPoint.FOLLOW, view, True, decoding=2),  # mixed
    ]:
        counters.record(item)
    assert counters.steps == {
        "prefill": 1,
        "mixed": 1,
        "decode": 1,
        "placeholder": 2,
        "known_empty": 1,
    }
    assert counters.votes == {
        "all": 1,
        "any": 1,
        "idle": 1,
        "drain": 0,
        "every": 0,
        "follow": 1,
        "due": 0,
    }
    assert counters.num_second_votes == 3


def test_serve_refuses_bad_settings_before_starting_anything(model_dir, tmp_path, capsys):
    from launcher.cli import main

    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such file" in capsys.readouterr().err
    path = tmp_path / "job.yaml"
    path.write_text(f"model: {model_dir}\nparallel: {{dp_size: 1, launcher: torchrun}}\n")
    assert main(["serve", "--config", str(path), "--set", "server.port=-1"]) == 2
    assert "server.port must be an int in [0, 65535]" in capsys.readouterr().err
    assert main(["serve", "--config", str(path), "--set", "server.colour=red"]) == 2
    assert "unknown setting(s) ['server.colour']" in capsys.readouterr().err
    assert main(["serve", "--config", str(path)]) == 2
    assert "parallel.launcher ray or local, got 'torchrun'" in capsys.readouterr().err


# -- samples --------------------------------------------------------------------------------
class _RecordingFrontend:
    """Stands in for `EngineFrontend.open_request`: records each sample and round-robins the
    ranks it picks itself, as a router spreading requests would."""

    def __init__(self) -> None:
        self.opened: list[tuple[str, int | None, str | None, int]] = []

    def open_request(self, request_id, prompt, params, dp_rank, sample_group=None):
        rank = dp_rank if dp_rank is not None else len(self.opened) % 2
        self.opened.append((request_id, dp_rank, sample_group, rank))
        return dataclasses.make_dataclass("Stream", ["rank"])(rank)


def test_a_prompts_samples_open_on_one_rank_under_one_group_key():
    """Each prompt's samples share a key and the rank of its first sample, so the rank
    computes the prompt once (scheduler/samples.py); a single sample has no key."""
    from launcher.server.app import LockstepServer
    from launcher.server.protocol import GenerationRequest
    from scheduler import SamplingParams

    def generation(best_of: int, prompts: list[list[int]]) -> GenerationRequest:
        return GenerationRequest(
            "completion", prompts, best_of, best_of, SamplingParams(max_tokens=4), (), False,
            True, False, False, False, None, False, False, None, None,
        )  # fmt: skip

    server = LockstepServer.__new__(LockstepServer)
    server.frontend = _RecordingFrontend()
    streams = server._open_samples("cmpl-1", generation(3, [[1, 2], [3, 4]]))
    assert server.frontend.opened == [
        ("cmpl-1-0", None, "cmpl-1/0", 0), ("cmpl-1-1", 0, "cmpl-1/0", 0),
        ("cmpl-1-2", 0, "cmpl-1/0", 0), ("cmpl-1-3", None, "cmpl-1/1", 1),
        ("cmpl-1-4", 1, "cmpl-1/1", 1), ("cmpl-1-5", 1, "cmpl-1/1", 1),
    ]  # fmt: skip
    assert [stream.rank for stream in streams] == [0, 0, 0, 1, 1, 1]
    server.frontend = _RecordingFrontend()
    server._open_samples("cmpl-2", generation(1, [[1, 2]]))
    assert server.frontend.opened == [("cmpl-2", None, None, 0)]
