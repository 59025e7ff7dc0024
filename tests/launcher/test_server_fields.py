"""The request fields vLLM's clients send, through the official `openai` client, each against a
reference: transformers' own logits (logprobs, echo, penalties, logit_bias, min_tokens) and the
offline `LLM` (n, best_of, seeds, batched prompts).

One server (launcher local, DP=1, float64 so logprobs compare to 1e-6) serves the module.
"""

from __future__ import annotations

import json
import math
import re
import urllib.request

import openai
import pytest
import torch
from model_fixtures import hf_model
from server_harness import ServerThread

from dist_engine.engine.config import EngineConfig
from launcher import LLM, SamplingParams, StructuredOutputsParams
from launcher.server.config import ServerConfig

ENGINE = {
    "dtype": "float64",
    "parallel": {"dp_size": 1, "launcher": "local", "threads_per_rank": 1},
    "scheduler": {"max_num_seqs": 16, "max_model_len": 256, "num_blocks": 512, "block_size": 8},
}
PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def server(model_dir):
    instance = ServerThread(
        EngineConfig.from_dict({"model": model_dir, **ENGINE}),
        ServerConfig(port=0, served_model_name="tiny"),
    )
    yield instance
    instance.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    return hf_model(model_dir, torch.float64)


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position: [len(tokens), V]."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    return logits.double().log_softmax(-1)


def hf_penalised_greedy(model, prompt, steps, *, presence=0.0, frequency=0.0, repetition=1.0,
                        bias=None, min_tokens=0, eos=(), allowed=None, bad=()):  # fmt: skip
    """Greedy decoding by hand over transformers' logits, with vLLM's penalties (repetition
    over prompt and output, presence and frequency over the output), logit_bias, the EOS
    ids masked until min_tokens, only the `allowed` ids kept, and each `bad` id sequence's
    last id masked while the output ends with the rest of it."""
    tokens, out = list(prompt), []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].double().clone()
        if allowed is not None:
            kept = logits[allowed].clone()
            logits[:] = -math.inf
            logits[allowed] = kept
        for sequence in bad:
            if not sequence[:-1] or out[len(out) - len(sequence) + 1 :] == list(sequence[:-1]):
                logits[sequence[-1]] = -math.inf
        for token_id, value in (bias or {}).items():
            logits[token_id] += value
        if len(out) < min_tokens:
            for token_id in eos:
                logits[token_id] = -math.inf
        for token_id in set(tokens):
            if repetition != 1.0:
                value = logits[token_id]
                logits[token_id] = value / repetition if value > 0 else value * repetition
        for token_id in set(out):
            logits[token_id] -= presence + frequency * out.count(token_id)
        choice = int(logits.argmax())
        out.append(choice)
        tokens.append(choice)
    return out


def test_completion_logprobs_are_transformers_log_softmax(client, server, reference):
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    choice = reply.choices[0]
    tokens = choice.token_ids
    expected = hf_logprobs(reference, PROMPT + tokens)
    for step, token in enumerate(tokens):
        row = expected[len(PROMPT) - 1 + step]
        assert choice.logprobs.token_logprobs[step] == pytest.approx(float(row[token]), abs=1e-6)
        # Keyed by each token's text, as OpenAI's format is: two tokens whose text is the same
        # (pieces of one UTF-8 character) share a key, so there may be fewer than 3.
        top = choice.logprobs.top_logprobs[step]
        best = row.topk(3).values.tolist()
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(best[0], abs=1e-6)
        assert all(any(abs(v - b) < 1e-6 for b in best) for v in top.values())
    assert choice.logprobs.text_offset[0] == 0 and len(choice.logprobs.tokens) == len(tokens)


def test_echo_with_logprobs_scores_every_prompt_token_like_lm_eval_asks(server, reference):
    """lm-eval's loglikelihood request: batched token-list prompts, echo, logprobs 1,
    max_tokens 1 (sent raw, as lm-eval's local-completions does)."""
    prompts = [PROMPT, [9, 8, 7, 6, 5]]
    body = {"model": "tiny", "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0.0, "seed": 1234}  # fmt: skip
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        reply = json.loads(response.read())
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    for prompt, choice in zip(prompts, reply["choices"], strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(prompt) + 1  # the prompt, then 1 token
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected = hf_logprobs(reference, prompt)
        for position in range(1, len(prompt)):
            got = logprobs["token_logprobs"][position]
            assert got == pytest.approx(float(expected[position - 1, prompt[position]]), abs=1e-6)
            assert len(logprobs["top_logprobs"][position]) >= 1
    assert reply["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


def test_chat_logprobs_and_top_logprobs(client):
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-9)  # greedy


@pytest.mark.parametrize(
    "penalties",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.0},
        {"repetition_penalty": 1.8},
        {"presence_penalty": -1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
    ],
)
def test_penalties_match_a_greedy_loop_over_transformers_logits(client, reference, penalties):
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
        presence_penalty=penalties.get("presence_penalty", 0),
        frequency_penalty=penalties.get("frequency_penalty", 0),
        extra_body={"ignore_eos": True, "return_token_ids": True,
                    "repetition_penalty": penalties.get("repetition_penalty", 1.0)},
    )  # fmt: skip
    expected = hf_penalised_greedy(
        reference, PROMPT, 12,
        presence=penalties.get("presence_penalty", 0.0),
        frequency=penalties.get("frequency_penalty", 0.0),
        repetition=penalties.get("repetition_penalty", 1.0),
    )  # fmt: skip
    assert reply.choices[0].token_ids == expected


def test_logit_bias_and_min_tokens(client, server, reference):
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={"33": 100},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert reply.choices[0].token_ids == [33] * 5
    # min_tokens: the EOS ids the engine stops at are masked until that many tokens are out.
    eos = sorted(server.server.limits.tokenizer.eos_token_ids)
    biased = {str(eos[0]): 50.0}  # make EOS the greedy choice at once
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=biased,
        extra_body={"min_tokens": 4, "return_token_ids": True},
    )  # fmt: skip
    expected = hf_penalised_greedy(reference, PROMPT, 5, bias={eos[0]: 50.0}, min_tokens=4, eos=eos)
    assert reply.choices[0].token_ids == expected[:4] + [eos[0]]
    assert reply.choices[0].finish_reason == "stop"


def test_allowed_token_ids_and_bad_words_match_a_greedy_loop_over_transformers_logits(
    client, server, reference
):
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True,
                    "allowed_token_ids": [10, 33, 57, 200]},
    )  # fmt: skip
    expected = hf_penalised_greedy(reference, PROMPT, 8, allowed=[10, 33, 57, 200])
    assert reply.choices[0].token_ids == expected and set(expected) <= {10, 33, 57, 200}
    # bad_words are words: the server encodes each (bare and after a space, as vLLM does).
    from scheduler.sampling_params import resolve_bad_words

    tokenizer = server.server.limits.tokenizer
    free = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ).choices[0]  # fmt: skip

    def encoded(word):
        return resolve_bad_words((word,), lambda t: tokenizer.encode(t, add_special_tokens=False))

    # A word of the free output that encodes back to its own token (this tiny tokenizer has
    # byte pieces that do not).
    word, sequences = next(
        (word, encoded(word))
        for token in free.token_ids
        if (word := tokenizer.decode([token]).strip()) and (token,) in encoded(word)
    )
    banned = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, "bad_words": [word]},
    ).choices[0]  # fmt: skip
    prompt = tokenizer.encode("Once upon a time")
    expected = hf_penalised_greedy(reference, prompt, 12, bad=sequences)
    assert banned.token_ids == expected != free.token_ids
    assert word not in banned.text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list of token ids"),
        ({"allowed_token_ids": [1, 10**6]}, "allowed_token_ids holds 1000000, outside the vocab"),
        ({"bad_words": "word"}, "bad_words must be a list of strings"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an int >= 1, or -1"),
        ({"truncate_prompt_tokens": 257}, "truncate_prompt_tokens=257 cannot be greater than"),
        ({"truncate_prompt_tokens": 4, "truncation_side": "middle"}, "truncation_side must be"),
    ],
)
def test_token_filters_and_truncation_refuse_bad_values_naming_them(client, extra, message):
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body=extra)


def test_truncate_prompt_tokens_keeps_the_last_tokens_or_the_first(client):
    prompt = [(7 * i) % 300 + 1 for i in range(40)]

    def run(tokens, **extra):
        reply = client.completions.create(
            model="tiny", prompt=tokens, max_tokens=5, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
        )  # fmt: skip
        return reply.usage.prompt_tokens, reply.choices[0].token_ids

    last = run(prompt[-8:])
    assert run(prompt, truncate_prompt_tokens=8) == last
    assert run(prompt, truncate_prompt_tokens=8, truncation_side="left") == last
    assert run(prompt, truncate_prompt_tokens=8, truncation_side="right") == run(prompt[:8])
    assert run(prompt, truncate_prompt_tokens=-1) == run(prompt)  # it fits: nothing cut
    assert run(prompt, truncate_prompt_tokens=100) == run(prompt)
    # A text far beyond max_model_len (256) is served once truncated, on both endpoints.
    text = "Once upon a time " * 300
    assert run(text, truncate_prompt_tokens=16)[0] == 16
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=3,
        extra_body={"truncate_prompt_tokens": 20},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == 20
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="tiny", prompt=text, max_tokens=3)


def test_n_samples_are_the_offline_paths_seeded_samples(client, model_dir):
    reply = client.completions.create(
        model="tiny", prompt=[[1, 2, 3], [4, 5]], max_tokens=8, temperature=1.0, n=3, seed=99,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert [c.index for c in reply.choices] == list(range(6))
    got = [c.token_ids for c in reply.choices]
    assert len({tuple(t) for t in got[:3]}) == 3  # three different samples of prompt 0
    from launcher.server.protocol import GenerationRequest

    generation = GenerationRequest(
        "completion", [[1, 2, 3], [4, 5]], 3, 3,
        SamplingParams(max_tokens=8, temperature=1.0, seed=99, ignore_eos=True),
        (), False, True, False, False, False, None, False, False, None, None,
    )  # fmt: skip
    settings = {"dtype": "float64", "threads_per_rank": 1, **ENGINE["scheduler"]}
    with LLM(model=model_dir, launcher="local", **settings) as llm:
        offline = llm.generate(
            [generation.prompts[s // 3] for s in range(6)],
            [generation.sample_params(s) for s in range(6)],
            use_tqdm=False,
        )
    assert got == [o.output_token_ids for o in offline]


def test_best_of_keeps_the_most_likely_samples(client):
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, n=2, best_of=5, seed=3,
        logprobs=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    every = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, n=5, seed=3, logprobs=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    totals = sorted((sum(c.logprobs.token_logprobs) for c in every.choices), reverse=True)
    kept = sorted((sum(c.logprobs.token_logprobs) for c in reply.choices), reverse=True)
    assert kept == pytest.approx(totals[:2])


def test_streaming_carries_choice_indices_and_continuous_usage(client):
    stream = client.completions.create(
        model="tiny", prompt=[[1, 2], [3, 4]], max_tokens=5, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    seen, finished, usage, last_completion_tokens = set(), set(), None, 0
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens >= last_completion_tokens
            last_completion_tokens = chunk.usage.completion_tokens
            usage = chunk.usage
        for choice in chunk.choices:
            seen.add(choice.index)
            if choice.finish_reason:
                finished.add(choice.index)
    assert seen == finished == {0, 1, 2, 3}
    assert usage.completion_tokens == 20 and usage.prompt_tokens == 4


def test_a_chat_choice_opens_with_its_first_token_as_vllms_does(client):
    """The role chunk goes out with the choice's first output, not at admission: `vllm bench
    serve` times the first token by the first chunk with a choice (an early role chunk made
    TTFT look 10x shorter and put the real wait into the first inter-token gap)."""
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        n=2, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    opened = {}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role is not None:
                opened[choice.index] = chunk.usage.completion_tokens
    assert sorted(opened) == [0, 1] and all(tokens >= 1 for tokens in opened.values()), opened


def test_stop_strings_can_stay_in_the_output(client, server):
    tokenizer = server.server.limits.tokenizer
    full = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=30, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    stop = full[5:8]
    assert stop and tokenizer is not None
    cut = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=30, temperature=0, stop=stop,
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    kept = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=30, temperature=0, stop=stop,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    ).choices[0]  # fmt: skip
    start = full.index(stop)
    assert cut.text == full[:start] and kept.text == full[: start + len(stop)]
    assert cut.finish_reason == kept.finish_reason == "stop"


def test_tokenize_detokenize_and_version(server):
    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(
            f"{server.url}{path}", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    tokenizer = server.server.limits.tokenizer
    tokens = post("/tokenize", {"prompt": "Hello there"})
    assert tokens["tokens"] == tokenizer.encode("Hello there") and tokens["count"] > 0
    assert post("/detokenize", {"tokens": tokens["tokens"]})["prompt"] == "Hello there"
    chat = post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["tokens"] == tokenizer.encode(
        tokenizer.render_chat([{"role": "user", "content": "hi"}]), add_special_tokens=False
    )
    with urllib.request.urlopen(f"{server.url}/version", timeout=30) as response:
        assert json.loads(response.read())["version"]


# -- structured output (llguidance) -------------------------------------------------------------
def test_json_schema_output_parses_and_matches_the_schema(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    for extra in (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "t", "schema": schema},
            }
        },
        {"extra_body": {"guided_json": schema}},
        {"extra_body": {"structured_outputs": {"json": schema}}},
    ):
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "give json"}], max_tokens=60,
            temperature=1.0, seed=5, **extra,
        )  # fmt: skip
        value = json.loads(reply.choices[0].message.content)
        assert set(value) == {"name", "n"} and isinstance(value["n"], int)
        assert isinstance(value["name"], str) and len(value["name"]) <= 8


def test_regex_choice_and_json_object_constrain_the_text(client):
    choice = client.completions.create(
        model="tiny", prompt="pick", max_tokens=10, temperature=1.0, seed=1,
        extra_body={"guided_choice": ["yes", "no", "maybe"]},
    ).choices[0].text  # fmt: skip
    assert choice in ("yes", "no", "maybe")
    digits = client.completions.create(
        model="tiny", prompt="number", max_tokens=10, temperature=1.0, seed=2,
        extra_body={"guided_regex": "[0-9]{3}-[a-c]"},
    ).choices[0].text  # fmt: skip
    assert len(digits) == 5 and digits[:3].isdigit() and digits[3] == "-" and digits[4] in "abc"
    whole = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=40, seed=3,
        response_format={"type": "json_object"},
    ).choices[0]  # fmt: skip
    if whole.finish_reason == "stop":  # a complete object within the token budget
        assert isinstance(json.loads(whole.message.content), dict)
    else:
        assert whole.message.content.startswith("{")


def test_offline_structured_outputs_draw_what_the_server_draws(client, model_dir):
    """vLLM's `StructuredOutputsParams` through `LLM.generate`: the same grammar as the
    server's `structured_outputs`, so a seeded request draws the same tokens either way."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    options = ["yes", "no", "maybe"]
    asks = [
        ("give json", 60, 5, {"json": schema}),
        ("pick", 10, 1, {"choice": options}),
        ("number", 10, 2, {"regex": "[0-9]{3}-[a-c]"}),
        ("compact json", 60, 6, {"json": schema, "disable_any_whitespace": True}),
    ]
    served = [
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": spec, "return_token_ids": True},
        ).choices[0]
        for prompt, max_tokens, seed, spec in asks
    ]  # fmt: skip
    settings = {"dtype": "float64", "threads_per_rank": 1, **ENGINE["scheduler"]}
    with LLM(model=model_dir, launcher="local", **settings) as llm:
        offline = llm.generate(
            [prompt for prompt, *_ in asks],
            [
                SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                               structured_outputs=StructuredOutputsParams(**spec))
                for _, max_tokens, seed, spec in asks
            ],
            use_tqdm=False,
        )  # fmt: skip
        with pytest.raises(ValueError, match="regex"):
            llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(
                regex="(unclosed")), use_tqdm=False)  # fmt: skip
    assert [o.output_token_ids for o in offline] == [c.token_ids for c in served]
    assert [o.text for o in offline] == [c.text for c in served]
    value = json.loads(offline[0].text)
    assert set(value) == {"name", "n"} and isinstance(value["n"], int)
    assert offline[1].text in options and len(offline[2].text) == 5
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', offline[3].text)
    assert not re.search(r"\s", outside_strings), offline[3].text  # disable_any_whitespace
    with pytest.raises(ValueError, match="give structured_outputs or grammar, not both"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"), grammar="g")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json=schema, choice=options)
    with pytest.raises(ValueError, match="disable_additional_properties=True is not supported"):
        StructuredOutputsParams(json=schema, disable_additional_properties=True)
    with pytest.raises(ValueError, match="apply to json and json_object constraints only"):
        StructuredOutputsParams(regex="a", disable_any_whitespace=True)


def test_a_grammar_that_does_not_compile_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="tiny", prompt="x", max_tokens=4,
            extra_body={"guided_grammar": "start: this is not lark {"},
        )  # fmt: skip
    assert info.value.body["param"] == "guided_grammar"
    with pytest.raises(openai.BadRequestError, match="give one structured output"):
        client.completions.create(
            model="tiny", prompt="x", max_tokens=4,
            extra_body={"guided_regex": "a+", "guided_choice": ["b"]},
        )  # fmt: skip


def test_grammar_requests_leave_their_neighbours_tokens_unchanged(client):
    plain = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
             "extra_body": {"ignore_eos": True, "return_token_ids": True}}  # fmt: skip
    alone = client.completions.create(**plain).choices[0].token_ids
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        masked = [
            pool.submit(
                client.completions.create,
                model="tiny",
                prompt="x",
                max_tokens=8,
                extra_body={"guided_regex": "[a-z]+"},
            )
            for _ in range(3)
        ]
        beside = pool.submit(client.completions.create, **plain)
        assert beside.result().choices[0].token_ids == alone
        assert all(m.result().choices[0].text.isalpha() for m in masked)
