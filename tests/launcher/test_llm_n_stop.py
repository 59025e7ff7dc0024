"""vLLM's `n` and stop strings in the offline `LLM` API, against independent references:
single requests with the per-sample seeds worked out here by hand, the whole text cut at the
stop string, and the HTTP server's answer to the same request.

One local rank (float64) for the `LLM` and one for a server over the same settings serve the
module; a few tests start a small group of their own.
"""

from __future__ import annotations

import hashlib
import shutil
import time

import openai
import pytest
from server_harness import ServerThread

from dist_engine.engine.config import EngineConfig
from dist_engine.engine.outputs import ErrorKind, Logprob, RequestOutput
from launcher import LLM, SamplingParams, StructuredOutputsParams
from launcher.clients import Submission
from launcher.llm import _kept
from launcher.routing import Router
from launcher.samples import SampleText
from launcher.server.config import ServerConfig

SETTINGS = {"launcher": "local", "dtype": "float64", "threads_per_rank": 1, "max_num_seqs": 16}
SETTINGS.update(max_model_len=256, num_blocks=512, block_size=8)
PROMPTS = [[5, 17, 42, 99, 7, 3], [4, 5]]
TEXT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, **SETTINGS) as instance:
        yield instance


@pytest.fixture(scope="module")
def client(model_dir):
    engine = EngineConfig(model=model_dir).with_overrides(**SETTINGS)
    server = ServerThread(engine, ServerConfig(port=0, served_model_name="tiny"))
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    server.stop()


@pytest.fixture(scope="module")
def full(llm):
    """TEXT's greedy continuation, 30 tokens, without stop strings."""
    (output,) = llm.generate([TEXT], SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
    return output


def derived_seed(seed: int, index: int) -> int:
    """Sample ``index``'s seed as the design states it (sample 0: the request's own)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def served(client, prompt, **body):
    """The server's choices for a completion request: (text, token ids, finish reason)."""
    extra = {"return_token_ids": True, **body.pop("extra_body", {})}
    reply = client.completions.create(model="tiny", prompt=prompt, extra_body=extra, **body)
    assert [choice.index for choice in reply.choices] == list(range(len(reply.choices)))
    return [(c.text, c.token_ids, c.finish_reason) for c in reply.choices]


def offline(outputs):
    """The same triples from `generate`'s results, every prompt's samples in order."""
    return [(c.text, c.token_ids, c.finish_reason) for o in outputs for c in o.outputs]


def first_stop(tokenizer, tokens: list[int], stop: str) -> int:
    """How many tokens it takes for ``stop`` to appear in the text: the first prefix whose
    decode holds it and does not end inside a character (text is only shown once whole)."""
    for count in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:count])
        if stop in text and not text.endswith("\ufffd"):
            return count
    raise AssertionError(f"{stop!r} never appears")


def a_stop_string(text: str) -> str:
    """Two whole characters from the second half of ``text``."""
    start = next(i for i in range(len(text) // 2, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    return text[start : start + 2]


# -- n ------------------------------------------------------------------------------------------
def test_n_seeded_samples_are_the_derived_seeds_single_requests_and_the_servers(llm, client):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=99, n=3, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for output in outputs:
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in output.outputs}) == 3  # the samples differ
        first = output.outputs[0]  # Lockstep's own fields describe sample 0
        assert (output.text, output.output_token_ids, output.finish_reason) == (
            first.text, first.token_ids, first.finish_reason,
        )  # fmt: skip
        assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for c in output.outputs)
    assert len({o.request_id for o in outputs}) == 2
    # Reproducible: the same call again draws the same samples.
    assert offline(llm.generate(PROMPTS, params, use_tqdm=False)) == offline(outputs)
    # Each sample is the single request with its derived seed.
    singles = llm.generate(
        [prompt for prompt in PROMPTS for _ in range(3)],
        [
            SamplingParams(max_tokens=8, temperature=1.0, seed=derived_seed(99, i), ignore_eos=True)
            for _ in PROMPTS
            for i in range(3)
        ],
        use_tqdm=False,
    )
    assert [c.token_ids for o in outputs for c in o.outputs] == [
        o.output_token_ids for o in singles
    ]
    # And the server's choices for the same request.
    body = dict(max_tokens=8, temperature=1.0, n=3, seed=99, extra_body={"ignore_eos": True})
    assert served(client, PROMPTS, **body) == offline(outputs)


def test_n_greedy_samples_are_identical(llm):
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    (single,) = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)
    (many,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, ignore_eos=True, n=3),
                           use_tqdm=False)  # fmt: skip
    assert [c.token_ids for c in many.outputs] == [single.output_token_ids] * 3
    assert [c.index for c in many.outputs] == [0, 1, 2]


LONG_PROMPT = [(7 * i + 3) % 100 for i in range(40)]  # 5 blocks of 8


def prefilled(llm, prompts, params):
    """`generate`'s outputs, and the prompt tokens the rank computed and those samples took
    from a sibling meanwhile (its stats)."""
    (before,) = llm.client.stats()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    (after,) = llm.client.stats()
    return outputs, (
        after.num_prefill_tokens - before.num_prefill_tokens,
        after.num_shared_prompt_tokens - before.num_shared_prompt_tokens,
    )


@pytest.mark.parametrize("seed", [None, 1234], ids=["greedy", "seeded"])
def test_n_samples_compute_their_prompt_once_with_the_separate_requests_tokens(llm, seed):
    """n=4 shares the prompt's 4 full blocks before its last token (32 tokens): the rank
    computes 40 + 3 * 8 prompt tokens instead of 4 * 40, and each sample has the tokens of a
    request of its own with that sample's seed (which nothing shares)."""
    temperature = 0.0 if seed is None else 1.0
    sampled = dict(max_tokens=8, temperature=temperature, ignore_eos=True)
    params = SamplingParams(n=4, seed=seed, **sampled)
    (many,), (computed, shared) = prefilled(llm, [LONG_PROMPT], params)
    assert (computed, shared) == (40 + 3 * 8, 3 * 32)
    seeds = [None] * 4 if seed is None else [derived_seed(seed, i) for i in range(4)]
    separate = [SamplingParams(seed=s, **sampled) for s in seeds]
    singles, (computed, shared) = prefilled(llm, [LONG_PROMPT] * 4, separate)
    assert (computed, shared) == (4 * 40, 0)
    assert [c.token_ids for c in many.outputs] == [o.output_token_ids for o in singles]
    assert all(len(c.token_ids) == 8 for c in many.outputs)
    if seed is not None:
        assert len({tuple(c.token_ids) for c in many.outputs}) == 4  # the samples differ
    (stats,) = llm.client.stats()
    assert stats.num_free_blocks == stats.num_usable_blocks  # nothing is left held


class TwoRanks:
    """The module's one local rank posing as a group of two: records the rank each
    submission is sent to, and serves it on the real rank."""

    num_ranks = 2

    def __init__(self, client) -> None:
        self.inner = client
        self.sent: list[tuple[int, str, str | None]] = []

    def submit(self, rank, batch, generation=None):
        self.sent += [(rank, item.request_id, item.sample_group) for item in batch]
        self.inner.submit(0, batch, generation=generation)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_prompts_samples_are_routed_to_one_rank_under_one_key(llm):
    client, router = llm.client, llm.router
    llm.client, llm.router = TwoRanks(client), Router(2, "round_robin")
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=2, n=3), use_tqdm=False)
        sent = llm.client.sent
    finally:
        llm.client, llm.router = client, router
    ids = [o.request_id for o in outputs]
    assert sent == [
        (rank, f"{request_id}-{j}", request_id) for rank, request_id in enumerate(ids)
        for j in range(3)
    ]  # fmt: skip
    (alone,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert alone.outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_unseeded_samples_draw_the_jobs_seeds_in_order(model_dir):
    """With the job's seed, an unseeded request's samples take the driver's seeds in order,
    as that many single requests do in a fresh group."""
    sampled = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    with LLM(model_dir, seed=7, **SETTINGS) as llm:
        (many,) = llm.generate([PROMPTS[0]], SamplingParams(n=3, **sampled), use_tqdm=False)
    with LLM(model_dir, seed=7, **SETTINGS) as llm:
        singles = llm.generate([PROMPTS[0]] * 3, SamplingParams(**sampled), use_tqdm=False)
    assert [c.token_ids for c in many.outputs] == [o.output_token_ids for o in singles]
    assert len({tuple(c.token_ids) for c in many.outputs}) == 3


def test_generate_stream_carries_each_samples_index(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=2, ignore_eos=True)
    (whole,) = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    ends, names = [], set()
    for item in llm.generate_stream([PROMPTS[1]], params):
        (sample,) = item.outputs  # one sample's state per item
        names.add(item.request_id)
        streamed[sample.index] += item.new_token_ids
        assert sample.token_ids == streamed[sample.index] == item.output_token_ids
        if item.finished:
            ends.append((sample.index, sample.text))
    assert len(names) == 1  # the prompt's request id, whichever sample
    assert streamed == {c.index: c.token_ids for c in whole.outputs}
    assert sorted(ends) == [(c.index, c.text) for c in whole.outputs]


# -- stop strings -------------------------------------------------------------------------------
def test_stop_strings_end_a_sample_as_the_server_ends_it(llm, client, full):
    tokenizer = llm.tokenizer
    greedy = dict(max_tokens=30, ignore_eos=True)
    stop = a_stop_string(full.text)
    at = full.text.index(stop)
    stops = ["never in this text", stop]
    cut, kept = llm.generate(
        [TEXT, TEXT],
        [SamplingParams(stop=stops, **greedy),
         SamplingParams(stop=stops, include_stop_str_in_output=True, **greedy)],
        use_tqdm=False,
    )  # fmt: skip
    # vLLM's cut: the text before the stop string (through it when kept), and the token ids
    # through the token that completed it.
    count = first_stop(tokenizer, full.output_token_ids, stop)
    assert cut.text == full.text[:at] and kept.text == full.text[: at + len(stop)]
    for output in (cut, kept):
        assert output.finish_reason == output.outputs[0].finish_reason == "stop"
        assert output.output_token_ids == full.output_token_ids[:count]
        assert output.new_token_ids == output.output_token_ids  # all new, for `generate`
        assert output.outputs[0].text == output.text
    # The server answers the same.
    body = dict(max_tokens=30, temperature=0, stop=stops, extra_body={"ignore_eos": True})
    assert served(client, TEXT, **body) == offline([cut])
    body["extra_body"]["include_stop_str_in_output"] = True
    assert served(client, TEXT, **body) == offline([kept])


def test_a_stopped_sample_is_aborted_on_its_rank(llm, full):
    """The rank request of a sample a stop string ended is aborted, not run to max_tokens."""
    params = SamplingParams(max_tokens=200, ignore_eos=True, stop=a_stop_string(full.text))
    (cut,) = llm.generate([TEXT], params, use_tqdm=False)
    assert cut.finish_reason == "stop" and len(cut.output_token_ids) <= 30
    # Its later outputs (deltas, then the abort's terminal one) are left unread by the LLM.
    deadline, ended = time.monotonic() + 10, None
    while ended is None and time.monotonic() < deadline:
        outputs = llm.client.poll(0.1)
        ended = next((o for o in outputs if o.request_id == cut.request_id and o.finished), None)
    assert ended is not None and ended.finish_reason == "abort"
    assert len(ended.output_token_ids) < 200


def test_an_output_past_the_stop_string_keeps_the_tokens_through_it(llm, full):
    """Several tokens in one output (as a resumed request's first can carry): the sample
    keeps those through the one that completed the stop string, and ends there."""
    tokens, stop = full.output_token_ids, a_stop_string(full.text)
    text = SampleText.of(SamplingParams(stop=stop), llm.tokenizer)
    output = RequestOutput("r", [1], tokens, tokens, False, None, 0, 0.0)
    kept = _kept(output, text, text.take(output))
    through = tokens[: first_stop(llm.tokenizer, tokens, stop)]
    assert kept.output_token_ids == kept.new_token_ids == text.token_ids == through
    assert (kept.finished, kept.finish_reason) == (True, "stop")
    assert text.text == full.text[: full.text.index(stop)]


def test_stop_strings_with_n_samples_match_the_server(llm, client):
    sampled = dict(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    (free,) = llm.generate([TEXT], SamplingParams(n=3, **sampled), use_tqdm=False)
    stop = a_stop_string(free.outputs[1].text)
    (stopped,) = llm.generate([TEXT], SamplingParams(n=3, stop=stop, **sampled), use_tqdm=False)
    for whole, sample in zip(free.outputs, stopped.outputs, strict=True):
        if stop in whole.text:
            assert sample.text == whole.text[: whole.text.index(stop)]
            assert sample.finish_reason == "stop"
        else:
            assert (sample.text, sample.token_ids) == (whole.text, whole.token_ids)
    assert stopped.outputs[1].finish_reason == "stop"
    body = dict(max_tokens=24, temperature=1.0, seed=3, n=3, stop=stop)
    assert served(client, TEXT, extra_body={"ignore_eos": True}, **body) == offline([stopped])
    # Streamed, the samples add up to the same tokens and end with the same text.
    params = SamplingParams(n=3, stop=stop, **sampled)
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for item in llm.generate_stream([TEXT], params):
        (sample,) = item.outputs
        streamed[sample.index] += item.new_token_ids
        if item.finished:
            assert (sample.text, sample.finish_reason) == (
                stopped.outputs[sample.index].text, stopped.outputs[sample.index].finish_reason,
            )  # fmt: skip
    assert streamed == {c.index: c.token_ids for c in stopped.outputs}


def test_logprobs_come_in_vllms_shape(llm, client):
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=11, ignore_eos=True, logprobs=2)
    (output,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    (sample,) = output.outputs
    reply = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=1.0, seed=11, logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ).choices[0]  # fmt: skip
    assert reply.token_ids == sample.token_ids and len(sample.logprobs) == 5

    def decoded(token_id: int) -> str:
        return llm.tokenizer.decode([token_id], skip_special_tokens=False)

    for token, position, entry, logprob in zip(
        sample.token_ids, sample.logprobs, output.new_logprobs, reply.logprobs.token_logprobs,
        strict=True,
    ):  # fmt: skip
        assert next(iter(position)) == token  # the sampled token first, as vLLM's
        assert position[token] == Logprob(entry.logprob, entry.rank, decoded(token))
        assert position[token].logprob == pytest.approx(logprob, abs=1e-9)  # the server's
        # Then the two most likely, ranked 1 and 2 (the sampled one once, if among them).
        top = {tid: Logprob(lp, rank, decoded(tid)) for rank, (tid, lp) in enumerate(entry.top, 1)}
        assert len(top) == 2 and sorted(t.rank for t in top.values()) == [1, 2]
        assert {**top, token: position[token]} == position
    assert sample.cumulative_logprob == pytest.approx(sum(reply.logprobs.token_logprobs))


# -- refusals -----------------------------------------------------------------------------------
def test_stop_strings_without_a_tokenizer_are_refused(model_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    with LLM(str(bare), **SETTINGS) as llm:
        with pytest.raises(ValueError, match=r"stop=\['x'\]: stop strings .* need a tokenizer"):
            llm.generate([[1, 2]], SamplingParams(stop="x"), use_tqdm=False)
        # n needs none: token ids only.
        (output,) = llm.generate([[1, 2]], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
        assert [(c.index, c.text, len(c.token_ids)) for c in output.outputs] == [
            (0, None, 3),
            (1, None, 3),
        ]


def test_a_rank_refuses_front_end_fields(llm):
    """n and stop strings reaching a rank end that request with a clear error, never ignored."""
    bad = {
        "rank-n": SamplingParams(n=2),
        "rank-stop": SamplingParams(stop=["x"]),
        "rank-json": SamplingParams(structured_outputs=StructuredOutputsParams(json={})),
        "rank-words": SamplingParams(bad_words=["x"]),
    }
    llm.client.submit(0, [Submission(rid, [1, 2, 3], params, False) for rid, params in bad.items()])
    ended: dict[str, object] = {}
    deadline = time.monotonic() + 10
    while len(ended) < len(bad) and time.monotonic() < deadline:
        ended.update({o.request_id: o for o in llm.client.poll(0.1) if o.request_id in bad})
    assert ended["rank-n"].error_kind is ErrorKind.INVALID_REQUEST
    assert ended["rank-n"].finish_reason.startswith(
        "error: sampling settings rejected: n=2 and stop=[] are applied by the front end"
    )
    assert ended["rank-stop"].error_kind is ErrorKind.INVALID_REQUEST
    assert "stop=['x']" in ended["rank-stop"].finish_reason
    for name in ("rank-json", "rank-words"):
        assert ended[name].error_kind is ErrorKind.INVALID_REQUEST
        assert "are turned into a grammar and token ids by the front end" in (
            ended[name].finish_reason
        )
    (after,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert after.finish_reason == "length"  # the rank serves on


def test_chat_gives_the_servers_chat_tokens(llm, client):
    """vLLM's `LLM.chat`: a conversation (or a list of them) through the chat template, as
    /v1/chat/completions renders it; greedy tokens equal the server's for the same messages."""
    conversations = [
        [{"role": "user", "content": "Once upon a time"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        ],
    ]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    (single,) = llm.chat(conversations[0], params, use_tqdm=False)
    assert single.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    for conversation, output in zip(conversations, outputs, strict=True):
        reply = client.chat.completions.create(
            model="tiny", messages=conversation, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        assert output.outputs[0].token_ids == reply.choices[0].token_ids
        assert len(output.prompt_token_ids) == reply.usage.prompt_tokens
    assert llm.get_tokenizer() is llm.tokenizer
    with pytest.raises(ValueError, match=r"messages\[0\]\.role must be one of"):
        llm.chat([{"role": "robot", "content": "hi"}], params, use_tqdm=False)


def test_prompts_as_vllm_takes_them(llm):
    """One prompt or a list; text, token ids, or vLLM's {"prompt"} / {"prompt_token_ids"}."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = llm.tokenizer.encode(TEXT)
    (expected,) = llm.generate([ids], params, use_tqdm=False)
    for given in (
        TEXT,
        ids,
        {"prompt": TEXT},
        {"prompt_token_ids": ids},
        [{"prompt": TEXT}],
        [{"prompt_token_ids": ids}, TEXT],
    ):
        outputs = llm.generate(given, params, use_tqdm=False)
        assert len(outputs) == (2 if isinstance(given, list) and len(given) == 2 else 1), given
        for output in outputs:
            assert output.outputs[0].token_ids == expected.outputs[0].token_ids, given
            assert output.prompt_token_ids == ids
    (text_output,) = llm.generate({"prompt": TEXT}, params, use_tqdm=False)
    assert text_output.prompt == TEXT  # vLLM's `prompt`: the text, when text was given
    with pytest.raises(ValueError, match="multi-modal"):
        llm.generate({"prompt": TEXT, "multi_modal_data": {}}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="prompts must be a prompt or a list"):
        llm.generate(42, params, use_tqdm=False)
