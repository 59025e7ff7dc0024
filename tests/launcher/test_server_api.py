"""`lockstep serve` over real HTTP, driven by the official `openai` client.

One server (launcher local, DP=1) serves the module; it runs in this process on a loopback
port of its own (server_harness.py), with an API key. Every result is compared with the
offline `LLM` on the same settings.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerThread

from dist_engine.engine.config import EngineConfig
from launcher import LLM, SamplingParams
from launcher.server.config import ServerConfig

API_KEY = "test-key"
MAX_PENDING = 64
ENGINE = {
    "dtype": "float64",
    # One torch thread: on a shared 2-core machine two threads spend most of a step waiting.
    "parallel": {"dp_size": 1, "launcher": "local", "threads_per_rank": 1},
    "scheduler": {"max_num_seqs": 64, "max_model_len": 1024, "num_blocks": 1024, "block_size": 8},
}
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
PROMPTS = [[(5 * i + 7 * j) % 383 + 1 for j in range(2 + i % 5)] for i in range(64)]


def engine_config(model_dir: str) -> EngineConfig:
    return EngineConfig.from_dict({"model": model_dir, **ENGINE})


@pytest.fixture(scope="module")
def offline(model_dir):
    """The offline LLM on the server's settings, for reference results."""
    with LLM(config=engine_config(model_dir)) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(model_dir):
    config = ServerConfig(port=0, api_key=API_KEY, max_pending_requests=MAX_PENDING)
    instance = ServerThread(engine_config(model_dir), config)
    yield instance
    instance.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def reference(offline, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return offline.generate(prompts, params, use_tqdm=False)


def stream_pieces(stream) -> tuple[str, list[int], list[str | None], object]:
    text, tokens, reasons, usage = "", [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            text += piece
            tokens += choice.token_ids
            reasons.append(choice.finish_reason)
    return text, tokens, reasons, usage


def get(server, path: str, key: str | None = API_KEY) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(server.url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- generation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [PROMPTS[3], "Mixture-of-experts models route"])
def test_completion_streamed_equals_whole_equals_offline(server, client, offline, prompt):
    (expected,) = reference(offline, [prompt], 12)
    whole = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, **GREEDY)
    stream = client.completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    text, tokens, reasons, usage = stream_pieces(stream)
    choice = whole.choices[0]
    assert choice.token_ids == tokens == expected.output_token_ids
    assert choice.text == text == expected.text
    assert choice.finish_reason == "length" and reasons[-1] == "length"
    assert [r for r in reasons if r is not None] == ["length"]  # one ending per request
    prompt_tokens = len(expected.prompt_token_ids)
    assert whole.usage.prompt_tokens == usage.prompt_tokens == prompt_tokens
    assert whole.usage.completion_tokens == usage.completion_tokens == 12


def test_chat_streamed_equals_whole_equals_offline(server, client, offline):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name an expert."}]},
    ]
    rendered = server.server.limits.tokenizer.render_chat(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name an expert."},
        ]
    )
    prompt_ids = server.server.limits.tokenizer.encode(rendered, add_special_tokens=False)
    (expected,) = reference(offline, [prompt_ids], 10)
    whole = client.chat.completions.create(
        model=server.model, messages=messages, max_completion_tokens=10, **GREEDY
    )
    stream = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=10, stream=True, **GREEDY
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text, tokens, reasons, _ = stream_pieces(chunks)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content == text == expected.text
    assert whole.choices[0].token_ids == tokens == expected.output_token_ids
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert reasons[-1] == whole.choices[0].finish_reason == "length"
    # As vLLM streams: a chunk per token, its text empty while held back (a split character),
    # between the role and the end.
    plain = list(
        client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=10, stream=True, temperature=0,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    middle = [chunk.choices[0].delta.content for chunk in plain[1:-1]]
    assert len(middle) == 10 and "".join(text or "" for text in middle) == expected.text


def test_stop_strings_and_stop_tokens_end_the_reply(server, client, offline):
    (full,) = reference(offline, [PROMPTS[5]], 24)
    text = full.text
    start = next(i for i in range(4, len(text)) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    for stream in (False, True):
        response = client.completions.create(
            model=server.model, prompt=PROMPTS[5], max_tokens=24, stop=[stop], stream=stream,
            **GREEDY,
        )  # fmt: skip
        if stream:
            got, _, reasons, _ = stream_pieces(response)
            reason = reasons[-1]
        else:
            got, reason = response.choices[0].text, response.choices[0].finish_reason
        assert (got, reason) == (text[: text.find(stop)], "stop")
    # A stop token id ends the reply with it; its text is not part of the reply.
    tokens = full.output_token_ids
    stop_id = tokens[6]
    response = client.completions.create(
        model=server.model, prompt=PROMPTS[5], max_tokens=24,
        extra_body={**GREEDY["extra_body"], "stop_token_ids": [stop_id]}, temperature=0,
    )  # fmt: skip
    first = tokens.index(stop_id)
    choice = response.choices[0]
    assert choice.token_ids == tokens[: first + 1] and choice.finish_reason == "stop"
    assert choice.text == server.server.limits.tokenizer.decode(tokens[:first])


def test_64_concurrent_streams_are_each_answered_once(server, offline):
    expected = [o.output_token_ids for o in reference(offline, PROMPTS, 8)]

    async def one(client: openai.AsyncOpenAI, prompt: list[int]) -> tuple[list[int], list]:
        stream = await client.completions.create(
            model=server.model, prompt=prompt, max_tokens=8, stream=True, **GREEDY
        )
        tokens, reasons, ids = [], [], set()
        async for chunk in stream:
            ids.add(chunk.id)
            tokens += chunk.choices[0].token_ids
            reasons.append(chunk.choices[0].finish_reason)
        assert len(ids) == 1
        return tokens, reasons

    async def run_all():
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    results = asyncio.run(run_all())
    assert [tokens for tokens, _ in results] == expected
    assert all([r for r in reasons if r] == ["length"] for _, reasons in results)
    wait_for(lambda: server.server.frontend.num_open == 0)


def test_a_client_that_hangs_up_frees_its_blocks(server, client):
    (idle,) = server.stats()
    assert idle.num_free_blocks == idle.num_usable_blocks
    stream = client.completions.create(
        model=server.model, prompt=PROMPTS[9], max_tokens=1000, stream=True, **GREEDY
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    (busy,) = server.stats()
    assert busy.num_running == 1 and busy.num_free_blocks < busy.num_usable_blocks
    stream.close()  # hang up mid-stream
    wait_for(lambda: server.stats()[0].num_free_blocks == idle.num_usable_blocks)
    (after,) = server.stats()
    assert after.num_running == after.num_waiting == 0
    # Well short of the 1000 tokens it asked for: it was aborted, not run to its end.
    assert after.num_steps["decode"] - busy.num_steps["decode"] < 900
    _, text = get(server, "/metrics")
    assert metric_values(text)[
        ("lockstep:request_success_total", labels(server.model, finished_reason="abort"))
    ]
    # A client that gives up on a whole (not streamed) reply is noticed too: the runner
    # cancels the handler of a closed connection.
    impatient = client.with_options(timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(
            model=server.model, prompt=PROMPTS[10], max_tokens=1000, **GREEDY
        )
    wait_for(lambda: server.stats()[0].num_free_blocks == idle.num_usable_blocks)
    assert server.stats()[0].num_steps["decode"] - after.num_steps["decode"] < 900


def test_the_pending_limit_answers_503_with_retry_after(server):
    async def scenario():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"model": server.model, "max_tokens": 300, "stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession(headers=headers) as session:
            responses = []
            for prompt in PROMPTS[:MAX_PENDING]:
                response = await session.post(
                    f"{server.url}/v1/completions", json={**body, "prompt": prompt}
                )
                assert response.status == 200
                responses.append(response)
            over = await session.post(
                f"{server.url}/v1/completions", json={**body, "prompt": [1, 2]}
            )
            refused = (over.status, over.headers.get("Retry-After"), await over.json())
            for response in responses:
                response.close()  # hang up: each request is aborted on its rank
            return refused

    status, retry_after, body = asyncio.run(scenario())
    assert (status, retry_after) == (503, "1")
    assert "server.max_pending_requests = 64" in body["error"]["message"]
    wait_for(lambda: server.server.frontend.num_open == 0)
    (after,) = server.stats()
    assert after.num_free_blocks == after.num_usable_blocks


# -- errors, security, endpoints ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 0}, "n"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"extra_body": {"top_k": "many"}}, "top_k"),
        ({"extra_body": {"dp_rank": 1}}, "dp_rank"),
        ({"prompt": [5, 100000]}, "prompt"),
    ],
)
def test_bad_requests_get_400_naming_the_field(server, client, kwargs, param):
    kwargs = {"prompt": [1, 2, 3], **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, **kwargs)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == param
    assert param in error["message"] and error["type"] == "invalid_request_error"


def test_bad_chat_and_an_unknown_model(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=server.model, messages=[{"role": "wizard", "content": "hi"}]
        )
    assert info.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi")
    assert "'gpt-4' does not exist" in info.value.body["message"]


def test_the_api_key_guards_the_api_but_not_health_or_metrics(server):
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model=server.model, prompt="hi", max_tokens=2)
    assert info.value.status_code == 401 and info.value.body["message"] == "incorrect API key"
    body = json.dumps({"model": server.model, "prompt": "hi"}).encode()
    request = urllib.request.Request(f"{server.url}/v1/completions", data=body)  # no key
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(request, timeout=30)
    assert missing.value.code == 401 and "missing API key" in missing.value.read().decode()
    for key in (None, "wrong-key"):
        status, text = get(server, "/v1/models", key)
        assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
        # As in vLLM: probes and Prometheus scrape without the key.
        assert get(server, "/health", key) == (200, '{"status": "ok", "reason": "ok"}')
        status, text = get(server, "/metrics", key)
        assert status == 200 and "lockstep:num_requests_running" in text


def test_sagemakers_ping_and_invocations_as_vllm_serves_them(server, client):
    """/ping is /health; /invocations answers a chat body as /v1/chat/completions and any
    other as /v1/completions, and wants the API key as the API does."""
    assert get(server, "/ping", None) == (200, '{"status": "ok", "reason": "ok"}')

    def invoke(body: dict, key: str | None = API_KEY) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(
            f"{server.url}/invocations", data=json.dumps(body).encode(), headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    common = {"model": server.model, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, chat = invoke({**common, "messages": [{"role": "user", "content": "hi"}]})
    direct = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert status == 200 and chat["object"] == "chat.completion"
    assert chat["id"].startswith("chatcmpl-")
    assert chat["choices"][0]["message"]["content"] == direct.choices[0].message.content
    status, completion = invoke({**common, "prompt": [5, 6, 7]})
    same = client.completions.create(model=server.model, prompt=[5, 6, 7], max_tokens=4,
                                     temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert status == 200 and completion["object"] == "text_completion"
    assert completion["choices"][0]["text"] == same.choices[0].text
    status, refused = invoke({**common, "prompt": [5]}, key=None)
    assert status == 401 and refused["error"]["code"] == "invalid_api_key"


def test_models_lists_the_served_model(server, client):
    (model,) = client.models.list().data
    assert model.id == server.model and model.owned_by == "lockstep"


def test_a_server_without_max_model_len_takes_the_groups(model_dir):
    """`lockstep serve MODEL` with max_model_len unset: the ranks resolve it (the model's
    4,096 positions, capped by a pool of 63 usable blocks of 8 = 504 tokens) and the server
    checks requests against that (it once read the unset value and failed at start-up)."""
    engine = {**ENGINE, "scheduler": {"max_num_seqs": 8, "num_blocks": 64, "block_size": 8}}
    config = EngineConfig.from_dict({"model": model_dir, **engine})
    assert config.scheduler.max_model_len is None
    instance = ServerThread(config, ServerConfig(port=0))
    try:
        client = openai.OpenAI(base_url=f"{instance.url}/v1", api_key="none", max_retries=0)
        assert instance.server.limits.max_model_len == 504
        (model,) = client.models.list().data
        assert model.max_model_len == 504
        reply = client.completions.create(model=model.id, prompt=[5, 6, 7], max_tokens=4, **GREEDY)
        assert len(reply.choices[0].token_ids) == 4
        with pytest.raises(openai.BadRequestError, match="max_model_len is 504"):
            client.completions.create(model=model.id, prompt=[7] * 504, max_tokens=1)
    finally:
        instance.stop()


def metric_values(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def labels(model: str, **extra: str) -> tuple:
    """The sorted label pairs of a series of ``model`` on rank 0."""
    return tuple(sorted({"model_name": model, "engine": "0", **extra}.items()))


# vLLM's boundaries (vllm/v1/metrics/loggers.py), which the series must keep.
VLLM_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
VLLM_ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]  # fmt: skip
VLLM_REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip


def bucket_bounds(text: str, name: str) -> list[float]:
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
    return [b for b in bounds if b != float("inf")]


def test_metrics_use_vllms_names_types_and_buckets_and_move(server, client):
    status, text = get(server, "/metrics")
    assert status == 200
    before = metric_values(text)
    client.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=6, **GREEDY)
    text = get(server, "/metrics")[1]
    after = metric_values(text)

    def moved(name, series=None):
        series = series or labels(server.model)
        return after[(name, series)] - before.get((name, series), 0.0)

    types = {family.name: family.type for family in text_string_to_metric_families(text)}
    for name, kind in {
        "num_requests_running": "gauge",
        "num_requests_waiting": "gauge",
        "kv_cache_usage_perc": "gauge",
        "prompt_tokens": "counter",
        "generation_tokens": "counter",
        "request_success": "counter",
        "num_preemptions": "counter",
        "prefix_cache_queries": "counter",
        "prefix_cache_hits": "counter",
        "time_to_first_token_seconds": "histogram",
        "inter_token_latency_seconds": "histogram",
        "e2e_request_latency_seconds": "histogram",
        "request_decode_time_seconds": "histogram",
        "request_time_per_output_token_seconds": "histogram",
        "request_prompt_tokens": "histogram",
        "request_generation_tokens": "histogram",
        "request_params_max_tokens": "histogram",
        "steps": "counter",
        "votes": "counter",
        "healthy": "gauge",
    }.items():
        assert types.get(f"lockstep:{name}") == kind, name

    assert moved("lockstep:generation_tokens_total") == 6
    assert moved("lockstep:prompt_tokens_total") == len(PROMPTS[1])
    assert moved("lockstep:time_to_first_token_seconds_count") == 1
    assert moved("lockstep:inter_token_latency_seconds_count") == 5
    for name in (
        "e2e_request_latency_seconds", "request_decode_time_seconds",
        "request_time_per_output_token_seconds", "request_params_n",
    ):  # fmt: skip
        assert moved(f"lockstep:{name}_count") == 1, name
    assert moved("lockstep:request_prompt_tokens_sum") == len(PROMPTS[1])
    assert moved("lockstep:request_generation_tokens_sum") == 6
    assert moved("lockstep:request_max_num_generation_tokens_sum") == 6
    assert moved("lockstep:request_params_max_tokens_sum") == 6
    assert (
        moved("lockstep:request_success_total", labels(server.model, finished_reason="length")) == 1
    )
    assert (
        moved("lockstep:request_success_total", labels(server.model, finished_reason="stop")) == 0
    )
    # The parts add up: first token, then the decode, within the request's whole time.
    ttft = moved("lockstep:time_to_first_token_seconds_sum")
    decode = moved("lockstep:request_decode_time_seconds_sum")
    assert (
        ttft > 0
        and decode > 0
        and ttft + decode <= moved("lockstep:e2e_request_latency_seconds_sum")
    )
    per_token = moved("lockstep:request_time_per_output_token_seconds_sum")
    assert per_token == pytest.approx(decode / 5)

    assert bucket_bounds(text, "lockstep:time_to_first_token_seconds") == VLLM_TTFT_BUCKETS
    assert bucket_bounds(text, "lockstep:inter_token_latency_seconds") == VLLM_ITL_BUCKETS
    for name in ("e2e_request_latency_seconds", "request_decode_time_seconds"):
        assert bucket_bounds(text, f"lockstep:{name}") == VLLM_REQUEST_LATENCY_BUCKETS
    # Token counts: 1-2-5 up to max_model_len (1024).
    assert bucket_bounds(text, "lockstep:request_prompt_tokens") == [
        1, 2, 5, 10, 20, 50, 100, 200, 500, 1000,
    ]  # fmt: skip

    assert moved("lockstep:steps_total", labels(server.model, kind="decode")) >= 5
    assert moved("lockstep:steps_total", labels(server.model, kind="prefill")) >= 1
    assert sum(v for (n, _), v in after.items() if n == "lockstep:votes_total") > 0
    rank0 = labels(server.model)
    for name in ("num_preemptions", "second_votes", "prefix_cache_hits"):
        assert (f"lockstep:{name}_total", rank0) in after
    # Prefix caching is off here: nothing is looked up, as vLLM counts.
    assert after[("lockstep:prefix_cache_queries_total", rank0)] == 0
    model = (("model_name", server.model),)
    assert after[("lockstep:healthy", model)] == 1
    assert after[("lockstep:requests_open", model)] == 0
    completions = (*model, ("path", "/v1/completions"), ("status", "200"))
    assert moved("lockstep:http_responses_total", tuple(sorted(completions))) == 1

    # The rank's gauges settle back to idle (a scrape may serve stats up to a second old).
    (idle,) = server.stats()
    settled = {
        "lockstep:num_requests_running": 0,
        "lockstep:num_requests_waiting": 0,
        "lockstep:kv_cache_usage_perc": 0.0,
        "lockstep:kv_cache_free_blocks": idle.num_usable_blocks,
    }
    wait_for(
        lambda: (
            {name: metric_values(get(server, "/metrics")[1])[(name, rank0)] for name in settled}
            == settled
        )
    )


# -- shutting down ------------------------------------------------------------------------------
def test_a_drain_that_times_out_ends_open_requests_with_an_error(model_dir):
    config = ServerConfig(port=0, drain_timeout_s=0.5)
    instance = ServerThread(engine_config(model_dir), config)
    try:
        client = openai.OpenAI(base_url=f"{instance.url}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(
            model=instance.model, prompt=[1, 2, 3], max_tokens=1000, stream=True, **GREEDY
        )
        chunks = iter(stream)
        next(chunks)
        stopping = asyncio.run_coroutine_threadsafe(instance.server.stop(), instance.loop)
        with pytest.raises(openai.APIError, match=r"drain timeout 0.5 s"):
            for _ in chunks:
                pass
        stopping.result(60)
        instance.server_stopped = True
        assert instance.server.frontend.num_open == 0
    finally:
        instance.stop()
