"""Random request bodies: never a 500, never a rank failure.

Bodies are built from the fields both endpoints know and some they do not, each given a
random JSON value (NaN and infinities included: Python's JSON reader takes them). Thousands go
through the request validation directly (pure and fast); a few hundred through a real server,
which must answer each with a 2xx or a 4xx and stay healthy.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import ServerThread

from dist_engine.engine.config import EngineConfig
from launcher.server.config import ServerConfig
from launcher.server.http import parse_json
from launcher.server.protocol import ModelLimits, RequestError, parse_chat, parse_completion
from launcher.server.tokenization import ModelTokenizer

FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n", "best_of", "echo",
    "logprobs", "top_logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "logit_bias", "stream", "stream_options",
    "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "dp_rank",
    "return_token_ids", "add_special_tokens", "add_generation_prompt", "chat_template_kwargs",
    "response_format", "tools", "tool_choice", "suffix", "use_beam_search", "user", "frob",
]  # fmt: skip
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["tiny", "gpt", "", "\ud800"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
# Values a client would plausibly send, so many bodies get past the first check.
PLAUSIBLE = {
    "model": st.sampled_from(["tiny", "other"]),
    "prompt": st.one_of(
        st.text(max_size=20),
        st.lists(st.integers(-2, 400), max_size=6),
        st.lists(st.lists(st.integers(0, 383), min_size=1, max_size=4), max_size=3),
    ),
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "x"]),
                "content": st.one_of(st.text(max_size=10), st.none()),
            }
        ),
        max_size=3,
    ),
    "max_tokens": st.integers(-1, 3),
    "n": st.integers(0, 3),
    "logprobs": st.one_of(st.integers(-1, 22), st.booleans()),
    "temperature": st.one_of(st.floats(-1, 3), st.just(math.nan)),
}


@st.composite
def bodies(draw: st.DrawFn) -> dict:
    names = draw(st.lists(st.sampled_from(FIELDS), max_size=10, unique=True))
    body = {"model": "tiny"} if draw(st.booleans()) else {}
    for name in names:
        body[name] = (
            draw(PLAUSIBLE[name]) if name in PLAUSIBLE and draw(st.booleans()) else (draw(VALUES))
        )
    return body


@pytest.fixture(scope="module")
def limits(model_dir) -> ModelLimits:
    tokenizer = ModelTokenizer(model_dir)
    return ModelLimits("tiny", max_model_len=64, vocab_size=384, num_ranks=2, tokenizer=tokenizer)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies(), chat=st.booleans())
def test_validation_answers_any_body_with_a_request_or_a_request_error(limits, body, chat):
    # Through JSON and the server's own body checks (depth, valid Unicode), as it reads a body;
    # NaN and infinities survive the trip.
    raw = json.dumps(body).encode()
    try:
        (parse_chat if chat else parse_completion)(parse_json(raw), limits)
    except RequestError as error:
        assert 400 <= error.status < 500 and error.message


@pytest.fixture(scope="module")
def server(model_dir):
    engine = EngineConfig.from_dict(
        {
            "model": model_dir,
            "dtype": "float32",
            "parallel": {"dp_size": 1, "launcher": "local", "threads_per_rank": 1},
            "scheduler": {"max_num_seqs": 16, "max_model_len": 64, "num_blocks": 256,
                          "block_size": 8},
        }
    )  # fmt: skip
    instance = ServerThread(engine, ServerConfig(port=0, served_model_name="tiny"))
    yield instance
    instance.stop()


def post(url: str, body: object) -> int:
    data = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            reply.read()
            return reply.status
    except urllib.error.HTTPError as error:
        error.read()
        return error.code


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(body=bodies(), chat=st.booleans())
def test_the_server_answers_random_bodies_with_no_500(server, body, chat):
    for name in ("max_tokens", "max_completion_tokens"):  # keep the valid ones cheap
        if isinstance(body.get(name), int) and not isinstance(body.get(name), bool):
            body[name] = max(min(body[name], 2), -1)
    for name in ("n", "best_of"):
        if isinstance(body.get(name), int) and not isinstance(body.get(name), bool):
            body[name] = max(min(body[name], 2), 0)
    if isinstance(body.get("stream"), bool):
        body["stream"] = False  # streams answer 200 first; the status line is what is checked
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status = post(f"{server.url}{path}", body)
    assert status < 500, (status, body)


def test_the_server_is_healthy_after_the_fuzz(server):
    healthy, reason = server.server.frontend.health()
    assert healthy, reason
    (stats,) = server.stats()
    assert stats.error is None
    assert post(f"{server.url}/v1/completions", {"model": "tiny", "prompt": [1, 2],
                                                  "max_tokens": 2}) == 200  # fmt: skip
    assert not math.isnan(stats.kv_usage)
