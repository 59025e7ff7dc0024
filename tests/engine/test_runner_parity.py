"""Scheduler + runner on one rank against transformers, and scheduling never changing results.

A single-rank generate loop (the real Scheduler and ModelRunner) must produce transformers'
greedy tokens, and keep producing them with a tiny token budget (chunked prompts), a KV pool
small enough to force recompute preemption, and prefix caching on (DESIGN invariant 6).
"""

from __future__ import annotations

import random

import pytest
import torch
from model_fixtures import TINY_SIZES, hf_greedy, hf_model, random_prompts

from dist_engine.backends import Backends, RegimeChoice
from dist_engine.engine.request import Request
from dist_engine.engine.runner import ModelRunner
from dist_engine.layers.linear import Linear, packing_serves
from dist_engine.models.loader import load_model
from dist_engine.models.make_model import make_tiny_checkpoint
from scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence

ARCHS = {
    "qwen3_moe": {"num_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": False},
    "mixtral": {"num_layers": 2},
}
NUM_NEW_TOKENS = 24
BLOCK_SIZE = 4


def _prompt_sets(vocab: int) -> dict[str, list[list[int]]]:
    rng = random.Random(7)
    system = [rng.randrange(vocab) for _ in range(22)]
    shared = [system + [rng.randrange(vocab) for _ in range(n)] for n in range(1, 13)]
    return {"random": random_prompts(12, vocab, 1, 40, seed=5), "shared_prefix": shared}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def case(request, tmp_path_factory):
    arch = request.param
    model_dir = make_tiny_checkpoint(
        arch, tmp_path_factory.mktemp(arch), seed=11, **TINY_SIZES, **ARCHS[arch]
    )
    reference = hf_model(model_dir)
    prompts = _prompt_sets(TINY_SIZES["vocab_size"])
    threads = torch.get_num_threads()
    # A tiny model gains nothing from threads, and on a loaded machine OpenMP's spinning
    # workers made this reference ~20x slower.
    torch.set_num_threads(1)
    try:
        expected = {
            name: [hf_greedy(reference, p, NUM_NEW_TOKENS) for p in group]
            for name, group in prompts.items()
        }
    finally:
        torch.set_num_threads(threads)
    return model_dir, load_model(model_dir), prompts, expected


def generate(
    model, prompts, riders=None, decode_batch_sizes=None, **overrides
) -> tuple[list[list[int]], Scheduler]:
    """Greedy tokens of every prompt; ``riders``, when a list, gets each prefill step's count of
    decode tokens that rode in it (mixed steps). The runner is built as the engine builds it,
    decode steps padded to ``decode_batch_sizes`` when given."""
    settings = dict(
        max_num_seqs=16,
        max_num_batched_tokens=512,
        max_model_len=128,
        block_size=BLOCK_SIZE,
        num_blocks=512,
    )
    settings.update(overrides)
    config = SchedulerConfig(**settings)
    model.attach_kv_cache(model.new_kv_cache(config.num_blocks, BLOCK_SIZE))
    runner = ModelRunner(
        model,
        BLOCK_SIZE,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        decode_batch_sizes=decode_batch_sizes,
    )
    sched = Scheduler(config)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    seqs = [Sequence(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]
    for seq in seqs:
        sched.add_sequence(seq)
    requests = {seq.request_id: Request.admit(seq, stream=False) for seq in seqs}
    for _ in range(5000):
        if sched.num_unfinished == 0:
            break
        outputs = sched.schedule()
        if riders is not None and outputs.is_prefill:
            riders.append(outputs.num_decode_seqs)
        sched.process_outputs(outputs, runner.execute(outputs, requests)[0])
        sched.check_integrity()
    assert all(seq.finish_reason == "length" for seq in seqs), [s.finish_reason for s in seqs]
    return [seq.output_token_ids for seq in seqs], sched


def test_single_rank_generation_equals_transformers(case):
    _, model, prompts, expected = case
    tokens, _ = generate(model, prompts["random"])
    assert tokens == expected["random"]


@pytest.mark.parametrize(
    "backends",
    [
        Backends.all("torch"),
        Backends(RegimeChoice("torch", "torch"), RegimeChoice("grouped_mm", "grouped_mm"),
                 RegimeChoice("torch", "torch")),
        Backends(RegimeChoice("native", "torch"), RegimeChoice("grouped_mm", "native"),
                 RegimeChoice("native", "torch")),
        Backends(RegimeChoice("torch", "torch"), RegimeChoice("torch", "torch"),
                 RegimeChoice("torch", "torch"), RegimeChoice("onednn", "onednn")),
        Backends(RegimeChoice("native", "native"), RegimeChoice("native", "native"),
                 RegimeChoice("native", "native"), RegimeChoice("onednn", "torch")),
        Backends(RegimeChoice("native", "native"), RegimeChoice("native", "native"),
                 RegimeChoice("native", "native"), RegimeChoice("onednn_t", "torch")),
        Backends(RegimeChoice("torch", "torch"), RegimeChoice("torch", "torch"),
                 RegimeChoice("torch", "torch"), RegimeChoice("torch", "onednn_t")),
        Backends(RegimeChoice("native", "native"), RegimeChoice("native", "native"),
                 RegimeChoice("native", "native"), RegimeChoice("onednn_packed", "onednn_t")),
    ],
    ids=["torch", "grouped_mm", "per_regime_mix", "onednn", "onednn_decode", "onednn_t_decode",
         "onednn_t_prefill", "onednn_packed_decode"],
)  # fmt: skip
def test_every_backend_gives_transformers_tokens(case, backends):
    """The implementations `auto` chooses between are interchangeable: each, and a mix per
    regime, gives transformers' greedy tokens, chunked prompts included."""
    model_dir, _, prompts, expected = case
    model = load_model(model_dir, backends=backends, max_decode_tokens=16)
    regimes = (backends.linear.decode, backends.linear.prefill)
    if regimes != ("torch", "torch"):  # every linear, LM head too
        kernel = model.linear_kernel
        assert kernel is not None
        assert (kernel.decode, kernel.prefill, kernel.max_decode_tokens) == (*regimes, 16)
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert all(m.kernel is kernel for m in linears)
        # onednn_t: every weight stored [in, out] (the torch regime reads that layout too)
        in_out = [m.weight.stride() == (1, m.weight.shape[0]) for m in linears]
        assert in_out == [("onednn_t" in regimes)] * len(linears)
        # onednn_packed (float32 here: packing serves it, though `auto` offers it for bf16
        # only): every linear, the LM head included, keeps a packed copy beside its weight
        packed = [m.packed is not None and m.packed.is_mkldnn for m in linears]
        assert packed == [("onednn_packed" in regimes)] * len(linears)
    tokens, _ = generate(model, prompts["random"], max_num_batched_tokens=24)
    assert tokens == expected["random"]


def test_padded_decode_batches_give_the_same_tokens(case):
    """Decode steps padded to fixed batch sizes (pad rows on block 0) sample the unpadded
    steps' tokens: the pad rows change no real row."""
    _, model, prompts, expected = case
    tokens, _ = generate(model, prompts["random"], decode_batch_sizes=(4, 16))
    assert tokens == expected["random"]


def test_chunked_prompts_give_the_same_tokens(case):
    _, model, prompts, expected = case
    tokens, _ = generate(model, prompts["random"], max_num_batched_tokens=12)
    assert tokens == expected["random"]


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "separate"])
def test_mixed_and_separate_prompt_steps_give_the_same_tokens(case, mixed):
    """Few sequence slots and small budgets: prompts are admitted (in chunks) while others
    decode. Mixed steps run the decode tokens through the prompt path, beside chunks."""
    _, model, prompts, expected = case
    counts: list[int] = []
    tokens, _ = generate(
        model,
        prompts["random"],
        counts,
        max_num_seqs=5,
        max_num_batched_tokens=24,
        mixed_prompt_tokens=8,
        mixed_steps=mixed,
    )
    assert tokens == expected["random"]
    assert (max(counts) > 0) is mixed, counts


def test_recompute_preemption_gives_the_same_tokens(case):
    _, model, prompts, expected = case
    # 40 usable blocks of 4 tokens for 12 sequences of up to 64 tokens.
    tokens, sched = generate(model, prompts["random"], num_blocks=41, prefill_watermark=1.0)
    assert sched.num_preemptions > 0, "the pool was not small enough to preempt"
    assert tokens == expected["random"]


def test_prefix_caching_gives_the_same_tokens(case):
    _, model, prompts, expected = case
    tokens, sched = generate(
        model, prompts["shared_prefix"], enable_prefix_caching=True, max_num_seqs=4
    )
    assert sched.kv.prefix_cache.num_hit_tokens > 0, "no prefix was reused"
    assert tokens == expected["shared_prefix"]


def test_placeholder_and_known_empty_steps(case):
    _, model, _, _ = case
    model.attach_kv_cache(model.new_kv_cache(16, BLOCK_SIZE))
    runner = ModelRunner(model, BLOCK_SIZE)
    sched = Scheduler(SchedulerConfig(max_model_len=64, block_size=BLOCK_SIZE, num_blocks=16))
    outputs = sched.schedule()
    assert outputs.known_empty and runner.execute(outputs, {}) == ([], [])
    # A rank with nothing scheduled in a group step still runs a zero-token forward.
    from scheduler import SchedulerOutputs

    for is_prefill in (True, False):
        placeholder = SchedulerOutputs(is_prefill, [], [], 0)
        assert placeholder.is_placeholder and runner.execute(placeholder, {}) == ([], [])


def test_decode_tokens_of_a_mixed_step_are_attended_in_the_decode_regime(case):
    """A rank whose part of a mixed step holds decode tokens only (its prompts are elsewhere in
    the group) attends them as a decode step would, and samples the decode step's tokens."""
    from dataclasses import replace

    _, model, prompts, _ = case
    model.attach_kv_cache(model.new_kv_cache(64, BLOCK_SIZE))
    runner = ModelRunner(model, BLOCK_SIZE)
    sched = Scheduler(SchedulerConfig(max_model_len=128, block_size=BLOCK_SIZE, num_blocks=64))
    requests = {}
    for index, prompt in enumerate(prompts["random"][:3]):
        seq = Sequence(f"r{index}", prompt, SamplingParams(max_tokens=8))
        sched.add_sequence(seq)
        requests[seq.request_id] = Request.admit(seq, stream=False)
    first = sched.schedule()
    sched.process_outputs(first, runner.execute(first, requests)[0])
    decode = sched.schedule()
    assert not decode.is_prefill and decode.num_seqs == 3
    riding = replace(decode, is_prefill=True, num_decode_seqs=decode.num_seqs)
    seqs = decode.scheduled_seqs
    cached = [seq.previous_num_tokens for seq in seqs]
    attn = runner._metadata(seqs, cached, riding.seqlens_q, riding)
    assert not attn.is_prefill and attn.max_query_len == 1
    # the same slots, rewritten alike
    assert runner.execute(riding, requests) == runner.execute(decode, requests)


def test_mla_mixed_steps_give_transformers_tokens(tmp_path):
    """DeepSeek-V3 (MLA over the latent cache): decode tokens riding in prefill steps keep the
    absorbed decode form beside chunks taking the expanded one; greedy tokens stay
    transformers'."""
    model_dir = make_tiny_checkpoint(
        "deepseek_v3", tmp_path, seed=3, **TINY_SIZES, num_layers=2, n_shared_experts=1
    )
    prompts = random_prompts(6, TINY_SIZES["vocab_size"], 2, 30, seed=9)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = hf_model(model_dir)
        expected = [hf_greedy(reference, prompt, NUM_NEW_TOKENS) for prompt in prompts]
        counts: list[int] = []
        tokens, _ = generate(
            load_model(model_dir),
            prompts,
            counts,
            max_num_seqs=3,
            max_num_batched_tokens=16,
            mixed_prompt_tokens=8,
        )
    finally:
        torch.set_num_threads(threads)
    assert max(counts) > 0, counts
    assert tokens == expected


@pytest.mark.skipif(not packing_serves(torch.bfloat16), reason="oneDNN has no bf16 GEMM here")
def test_packed_bf16_linears_give_the_unpacked_oneDNN_tokens(case):
    """`onednn_packed` (the bf16 decode linears over weights packed once) computes what
    oneDNN computes over the plain weights, which it re-lays out into the same blocked
    format at each call: bf16 greedy tokens equal, prefill steps (over 16 rows) on F.linear."""
    model_dir, _, prompts, _ = case
    native = RegimeChoice("native", "native")
    tokens = {}
    for name in ("onednn", "onednn_packed"):
        backends = Backends(native, native, native, RegimeChoice(name, "torch"))
        model = load_model(model_dir, torch.bfloat16, backends=backends, max_decode_tokens=16)
        head = model.lm_head
        assert (head.packed is not None) == (name == "onednn_packed")
        tokens[name], _ = generate(model, prompts["random"], max_num_batched_tokens=24)
    assert tokens["onednn_packed"] == tokens["onednn"]
