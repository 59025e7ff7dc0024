"""vLLM's shape of the offline API and its defaults: `RequestOutput`-like outputs, sampling
from the model's generation_config.json when a request sets none (`--generation-config`), and
the server's several served names, chat template and tokenizer directory.

The model is a copy of the tiny Qwen3-MoE whose generation_config.json recommends sampling
values, as a chat model's does. Every group is one local rank (float64).
"""

from __future__ import annotations

import json
import logging
import shutil

import openai
import pytest
from cli_harness import run_cli
from server_harness import ServerThread

from dist_engine.engine.config import EngineConfig
from dist_engine.engine.outputs import CompletionOutput
from launcher import LLM, SamplingParams
from launcher import cli as cli_module
from launcher.generation_config import GenerationDefaults, load_generation_defaults
from launcher.llm import check_gpu_memory_utilization
from launcher.server.config import ServerConfig
from launcher.server.protocol import ModelLimits, RequestError, parse_completion

LOCAL = {"launcher": "local", "dtype": "float64", "max_model_len": 128, "num_blocks": 128}
LOCAL.update(block_size=4, max_num_seqs=8)  # and dp_size 1, the default
RECOMMENDED = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "eos_token_id": [0, 2, 5]}
# What the recommended values make of a request that sets no sampling.
DEFAULTED = dict(temperature=0.7, top_p=0.9, top_k=20, stop_token_ids={0, 2, 5})
PROMPTS = ["experts route tokens", [5, 9, 13, 17], [100, 200, 300]]


@pytest.fixture(scope="module")
def chat_model(model_dir, tmp_path_factory) -> str:
    """The tiny model with sampling recommended in its generation_config.json."""
    target = tmp_path_factory.mktemp("recommended") / "model"
    shutil.copytree(model_dir, target)
    settings = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**settings, **RECOMMENDED}))
    return str(target)


# -- the defaults, as read ----------------------------------------------------------------------
def test_generation_config_modes(chat_model, model_dir, tmp_path):
    auto = load_generation_defaults("auto", chat_model)
    assert (auto.temperature, auto.top_p, auto.top_k) == (0.7, 0.9, 20)
    assert auto.eos_token_ids == {0, 2, 5}
    # vllm: vLLM's neutral sampling, but the file's EOS ids still end a reply (as in vLLM).
    vllm = load_generation_defaults("vllm", chat_model)
    assert (vllm.temperature, vllm.top_p, vllm.top_k) == (1.0, 1.0, 0)
    assert vllm.eos_token_ids == {0, 2, 5}
    # A directory: its file, whatever the model's says.
    elsewhere = tmp_path / "gen"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text('{"temperature": 0.2, "top_k": -1}')
    other = load_generation_defaults(str(elsewhere), chat_model)
    assert (other.temperature, other.top_p, other.top_k, other.eos_token_ids) == (0.2, 1, 0, set())
    # No sampling in the file (the plain tiny model): vLLM's defaults.
    plain = load_generation_defaults("auto", model_dir)
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)
    (elsewhere / "generation_config.json").write_text('{"top_p": 0}')
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be .* got 0"):
        load_generation_defaults(str(elsewhere), chat_model)


def test_a_request_keeps_what_it_sets_and_defaults_the_rest():
    defaults = GenerationDefaults(temperature=0.7, top_p=0.9, top_k=20, eos_token_ids={5})
    assert defaults.sampling_params() == SamplingParams(
        max_tokens=16, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids={5}
    )
    given = defaults.sampling_params(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert given == SamplingParams(max_tokens=3, top_p=0.9, top_k=20, ignore_eos=True)


def test_run_prompt_lines_take_the_defaults_per_field(chat_model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1]}\n{"prompt_token_ids": [2], "top_k": 4}\n')
    for setting, expected_temperature in (("auto", 0.7), ("vllm", 1.0)):
        defaults = load_generation_defaults(setting, chat_model)
        _, params, _ = cli_module._load_prompts(str(prompts), 9, 1, defaults)
        assert [p.temperature for p in params] == [expected_temperature] * 2
        assert [p.top_k for p in params] == [20 if setting == "auto" else 0, 4]
        assert all(p.max_tokens == 9 and p.stop_token_ids == {0, 2, 5} for p in params)


def test_the_server_defaults_a_request_field_by_field(model_dir):
    from launcher.server.tokenization import ModelTokenizer

    limits = ModelLimits(
        "a", 64, 384, 1, ModelTokenizer(model_dir), other_model_names=("b",),
        defaults=GenerationDefaults(temperature=0.7, top_p=0.9, top_k=20, eos_token_ids={5}),
    )  # fmt: skip
    request = parse_completion({"model": "b", "prompt": [1, 2]}, limits)
    assert request.model == "b"
    params = request.params
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.9, 20)
    assert {0, 2, 5} <= params.stop_token_ids
    given = parse_completion(
        {"model": "a", "prompt": [1], "temperature": 0, "top_k": -1, "ignore_eos": True}, limits
    ).params
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 0.9, 0)
    assert 5 not in given.stop_token_ids  # ignore_eos: no EOS ids from anywhere
    with pytest.raises(RequestError, match=r"serves 'a' or 'b'") as caught:
        parse_completion({"model": "c", "prompt": [1]}, limits)
    assert caught.value.status == 404


# -- the offline API ----------------------------------------------------------------------------
def test_generate_without_params_samples_with_the_model_defaults(chat_model, capsys, tmp_path):
    """Three fresh groups draw the same per-request seeds in the same order: `generate` with
    no params, `generate` with the defaults spelled out, and `lockstep run` on lines that set
    no sampling give the same tokens."""
    with LLM(chat_model, data_parallel_size=1, **LOCAL) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(max_tokens=16, **DEFAULTED)
        defaulted = llm.generate(PROMPTS, use_tqdm=False)
    with LLM(chat_model, **LOCAL) as llm:
        spelled = llm.generate(PROMPTS, SamplingParams(max_tokens=16, **DEFAULTED), use_tqdm=False)
        greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=16), use_tqdm=False)
    tokens = [o.output_token_ids for o in defaulted]
    assert tokens == [o.output_token_ids for o in spelled]
    assert [o.output_token_ids for o in greedy] != tokens  # SamplingParams() is still greedy
    lines = tmp_path / "prompts.jsonl"
    lines.write_text(
        "".join(
            json.dumps({"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}) + "\n"
            for p in PROMPTS
        )
    )
    out = tmp_path / "out.jsonl"
    argv = ["run", chat_model, "--prompts", str(lines), "--output", str(out), "--max-tokens"]
    argv += ["16", "--launcher", "local", "-dp", "1", "--dtype", "float64", "--max-model-len"]
    argv += ["128", "--num-blocks", "128", "--block-size", "4", "--max-num-seqs", "8", "--quiet"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["output_token_ids"] for r in records] == tokens


def test_outputs_have_vllms_shape_and_keep_lockstep_names(chat_model):
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with LLM(chat_model, dp_size=1, kv_cache_memory_bytes=1 << 20, **LOCAL) as llm:
        assert llm.config.kv_cache_bytes == 1 << 20  # vLLM's keyword, Lockstep's key
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        tokenizer = llm.tokenizer
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.prompt == (prompt if isinstance(prompt, str) else None)
        expected_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert output.prompt_token_ids == expected_ids
        assert output.finished and output.request_id
        (completion,) = output.outputs
        assert completion == CompletionOutput(
            index=0,
            text=output.text,
            token_ids=output.output_token_ids,
            finish_reason=output.finish_reason,
        )
        assert completion.finish_reason == "length" and completion.finished()
        assert len(completion.token_ids) == 5 and isinstance(completion.text, str)
        assert completion.text == tokenizer.decode(completion.token_ids)
        assert completion.cumulative_logprob is None and completion.logprobs is None
        assert output.dp_rank == 0 and output.detail is None  # Lockstep's own names stay


def test_vllms_text_and_token_filter_fields_offline(model_dir):
    """skip_special_tokens, detokenize, allowed_token_ids and bad_words through `LLM`, each
    against what the same request gives without it (or through the server)."""
    special = [1, 2]  # <|im_start|>, <|im_end|>: special tokens of the tiny tokenizer
    forced = dict(max_tokens=4, ignore_eos=True, allowed_token_ids=special)
    with LLM(model_dir, **LOCAL) as llm:
        skipped, kept, silent = llm.generate(
            ["a prompt"] * 3,
            [
                SamplingParams(**forced),
                SamplingParams(**forced, skip_special_tokens=False),
                SamplingParams(**forced, skip_special_tokens=False, detokenize=False),
            ],
            use_tqdm=False,
        )
        tokenizer = llm.tokenizer
        free, banned = llm.generate(
            ["Once upon a time"] * 2,
            [
                SamplingParams(max_tokens=12, ignore_eos=True),
                SamplingParams(max_tokens=12, ignore_eos=True, bad_words=["placeholder"]),
            ],
            use_tqdm=False,
        )
        word = next(
            word
            for token in free.output_token_ids
            if (word := tokenizer.decode([token]).strip())
            and tokenizer.encode(word, add_special_tokens=False) == [token]
        )
        (offline,) = llm.generate(
            ["Once upon a time"],
            SamplingParams(max_tokens=12, ignore_eos=True, bad_words=[word]),
            use_tqdm=False,
        )
        with pytest.raises(ValueError, match=r"stop=\['x'\] needs detokenize=True"):
            llm.generate(["a"], SamplingParams(stop="x", detokenize=False), use_tqdm=False)
    assert set(skipped.output_token_ids) <= set(special) and len(skipped.output_token_ids) == 4
    assert kept.output_token_ids == silent.output_token_ids == skipped.output_token_ids
    assert skipped.text == ""
    assert kept.text == tokenizer.decode(kept.output_token_ids, skip_special_tokens=False)
    assert "<|im" in kept.text and silent.text == ""
    assert banned.output_token_ids == free.output_token_ids  # a word the output never holds
    assert offline.output_token_ids != free.output_token_ids and word not in offline.text
    # The server encodes bad words the same way: the same tokens.
    server = ServerThread(
        EngineConfig(model=model_dir).with_overrides(**LOCAL),
        ServerConfig(port=0, served_model_name="tiny"),
    )
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        reply = client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True, "bad_words": [word]},
        )  # fmt: skip
    finally:
        server.stop()
    assert reply.choices[0].token_ids == offline.output_token_ids


def test_vllms_generate_keywords_truncate_or_are_refused_at_non_neutral_values(model_dir):
    prompt = [(7 * i) % 300 + 1 for i in range(40)]
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM(model_dir, **LOCAL) as llm:

        def tokens(prompts, **keywords):
            done = llm.generate(prompts, greedy, use_tqdm=False, **keywords)
            return [(o.prompt_token_ids, o.output_token_ids) for o in done]

        last, first = tokens([prompt[-8:], prompt[:8]])
        assert tokens([prompt], tokenization_kwargs={"truncate_prompt_tokens": 8}) == [last]
        cut = {"truncate_prompt_tokens": 8, "truncation_side": "right"}
        assert tokens([prompt], tokenization_kwargs=cut) == [first]
        # -1: max_model_len (128) - 1 tokens at most; this prompt fits, nothing is cut.
        assert tokens([prompt], tokenization_kwargs={"truncate_prompt_tokens": -1}) == tokens(
            [prompt]
        )
        text = "experts route tokens"
        bare = llm.tokenizer.encode(text, add_special_tokens=False)
        (ids, _), *_ = tokens(text, tokenization_kwargs={"add_special_tokens": False})
        assert ids == bare
        assert tokens([prompt], priority=[0], lora_request=None) == tokens([prompt])
        # vLLM's prompt dicts may carry a cache_salt: the same tokens, the salt sent along.
        salted = {"prompt_token_ids": prompt, "cache_salt": "tenant-1"}
        assert tokens([salted]) == tokens([prompt])
        (prepared,) = llm._prepare([salted], greedy, None)
        assert prepared.samples[0].params.cache_salt == "tenant-1"
        for keywords, message in (
            ({"tokenization_kwargs": {"padding": True}}, r"tokenization_kwargs \['padding'\]"),
            ({"tokenization_kwargs": {"truncate_prompt_tokens": 0}}, "must be an int >= 1"),
            ({"tokenization_kwargs": {"truncate_prompt_tokens": 200}}, "max_model_len"),
            ({"lora_request": object()}, "LoRA adapters are not supported"),
            ({"priority": [1]}, "no priority policy"),
            ({"mm_processor_kwargs": {"size": 1}}, "no multi-modal inputs"),
        ):
            with pytest.raises(ValueError, match=message):
                llm.generate([prompt], greedy, use_tqdm=False, **keywords)
        # chat: tools reach the template; continue_final_message ends the prompt inside the
        # last message, right after its content (transformers' cut), with no new turn opened.
        template = (
            "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}"
        )
        llm.tokenizer.chat_template, llm.tokenizer._template = template, None
        turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
        tool = {"type": "function", "function": {"name": "f", "parameters": {"a": "<b>"}}}
        (called,) = llm.chat(turn[:1], greedy, tools=[tool], use_tqdm=False)
        rendered = (
            'TOOLS [{"type": "function", "function": {"name": "f", "parameters": {"a": "<b>"}}}]\n'
        )
        expected = llm.tokenizer.encode(
            rendered + "<user>hi</user>\n<assistant>", add_special_tokens=False
        )
        assert called.prompt_token_ids == expected  # JSON as json.dumps writes it, '<' as is
        (continued,) = llm.chat(turn, greedy, continue_final_message=True, use_tqdm=False)
        cut = "<user>hi</user>\n<assistant>Hel"
        assert continued.prompt_token_ids == llm.tokenizer.encode(cut, add_special_tokens=False)
        with pytest.raises(ValueError, match="cannot also open a new one"):
            llm.tokenizer.render_chat(turn, True, continue_final_message=True)


def test_llm_keywords_in_vllms_spelling_are_checked_before_starting(chat_model):
    with pytest.raises(ValueError, match=r"data_parallel_size=2 and dp_size=1 .* give one"):
        LLM(chat_model, data_parallel_size=2, dp_size=1, launcher="local")
    with pytest.raises(ValueError, match=r"enable_expert_parallel=False: Lockstep always"):
        LLM(chat_model, enable_expert_parallel=False, launcher="local")


def test_gpu_memory_utilization_is_refused_on_gpus_and_noted_on_cpus(chat_model, caplog):
    on_gpus = EngineConfig.from_dict(
        {"model": chat_model, "gpu_memory_utilization": 0.9, "parallel": {"backend": "nccl"}}
    )
    with pytest.raises(ValueError, match=r"cannot size the KV pool .* \(--kv-cache-memory-bytes\)"):
        check_gpu_memory_utilization(on_gpus)
    on_cpus = on_gpus.with_overrides(backend="gloo")
    caplog.set_level(logging.WARNING, logger="lockstep")
    logging.getLogger("lockstep").propagate = True
    try:
        check_gpu_memory_utilization(on_cpus)
    finally:
        logging.getLogger("lockstep").propagate = False
    assert "gpu_memory_utilization 0.9 does not apply: the group runs on CPUs" in caplog.text
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        on_cpus.with_overrides(gpu_memory_utilization=1.5)


# -- the server ---------------------------------------------------------------------------------
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def no_tokenizer_model(chat_model, tmp_path_factory) -> str:
    """The model without its tokenizer files: text needs `tokenizer` to point at them."""
    target = tmp_path_factory.mktemp("bare") / "model"
    shutil.copytree(chat_model, target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).unlink()
    return str(target)


def test_the_server_answers_to_every_name_with_the_tokenizer_and_template_given(
    chat_model, no_tokenizer_model
):
    engine = EngineConfig(model=no_tokenizer_model, tokenizer=chat_model).with_overrides(**LOCAL)
    config = ServerConfig(port=0, served_model_name=["first", "second"], chat_template=TEMPLATE)
    server = ServerThread(engine, config)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["first", "second"]
        body = {"max_tokens": 6, "seed": 7}
        body["extra_body"] = {"ignore_eos": True, "return_token_ids": True}
        replies = {
            name: client.completions.create(model=name, prompt="experts route", **body)
            for name in ("first", "second")
        }
        assert {name: reply.model for name, reply in replies.items()} == {
            "first": "first",
            "second": "second",
        }
        # Text prompts need the tokenizer of `tokenizer`: the model directory has none.
        tokenizer = server.server.limits.tokenizer
        prompt_ids = tokenizer.encode("experts route")
        assert replies["first"].usage.prompt_tokens == len(prompt_ids)
        with pytest.raises(openai.NotFoundError, match=r"serves 'first' or 'second'"):
            client.completions.create(model="third", prompt=[1, 2], max_tokens=2)
        messages = [{"role": "user", "content": "hi"}]
        chat = client.chat.completions.create(
            model="second", messages=messages, max_tokens=3, temperature=0
        )
        rendered = "[user] hi\n[assistant]"  # the given template, not the tokenizer's
        assert chat.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    finally:
        server.stop()
    # No temperature, top_p or top_k in the request: the model's recommended values, as the
    # offline API samples with them (a request seed makes both draw alike).
    with LLM(chat_model, **LOCAL) as llm:
        seeded = SamplingParams(
            max_tokens=6, seed=7, ignore_eos=True, temperature=0.7, top_p=0.9, top_k=20
        )
        (expected,) = llm.generate([prompt_ids], seeded, use_tqdm=False)
    for reply in replies.values():
        assert reply.choices[0].token_ids == expected.output_token_ids
        assert reply.choices[0].text == expected.text
