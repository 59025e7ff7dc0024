"""Our model against transformers on tiny random checkpoints written by `make_tiny_checkpoint`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import (
    TINY_SIZES,
    PagedGreedyRunner,
    hf_greedy,
    hf_model,
    random_prompts,
)

from dist_engine.attention.metadata import AttentionMetadata
from dist_engine.models.loader import load_model
from dist_engine.models.make_model import make_tiny_checkpoint
from moe import DispatchMode

# Qwen3-MoE with a dense layer in the middle (mlp_only_layers) and no top-k renormalisation;
# Mixtral (always renormalises, no q/k norm, block_sparse_moe names); the DeepSeek MLA models
# are in test_deepseek.py.
ARCHS = {
    "qwen3_moe": {"num_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": False},
    "mixtral": {"num_layers": 2},
    # q/k/v biases, a shared expert behind a sigmoid gate
    "qwen2_moe": {"num_layers": 3, "mlp_only_layers": [1]},
    # partial rotary, q/k norms, sigmoid grouped routing with a selection bias, shared experts
    "glm4_moe": {"num_layers": 3},
}
NUM_PROMPTS = 12
NUM_NEW_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and on a loaded machine OpenMP's
    spinning workers made the greedy tests up to 20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = request.param
    out = tmp_path_factory.mktemp(arch)
    return make_tiny_checkpoint(arch, out, seed=3, **TINY_SIZES, **ARCHS[arch])


def _full_prompt_logits(model, prompt: list[int]) -> torch.Tensor:
    model.attach_kv_cache(model.new_kv_cache(32, 8))
    table = list(range(1, 1 + -(-len(prompt) // 8)))
    attn = AttentionMetadata.build([table], [0], [len(prompt)], 8, is_prefill=True)
    hidden = model(torch.tensor(prompt), attn.positions, attn, DispatchMode.NORMAL)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_prompt_logits_match_transformers(checkpoint: Path, dtype: torch.dtype) -> None:
    ours = load_model(checkpoint, dtype=dtype)
    reference = hf_model(checkpoint, dtype=dtype)
    prompt = random_prompts(1, TINY_SIZES["vocab_size"], 37, 37, seed=1)[0]
    logits = _full_prompt_logits(ours, prompt)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    # HF runs its RMSNorm in float32 even for float64 models, hence the same bound for both.
    torch.testing.assert_close(logits, expected.to(logits.dtype), atol=2e-5, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_greedy_generation_matches_transformers(checkpoint: Path) -> None:
    ours = load_model(checkpoint)
    reference = hf_model(checkpoint)
    prompts = random_prompts(NUM_PROMPTS, TINY_SIZES["vocab_size"], 2, 29, seed=7)
    prompts[0] = prompts[0][:1]  # a one-token prompt
    chunked = [b % 3 == 1 for b in range(NUM_PROMPTS)]  # a third prefill in two chunks
    runner = PagedGreedyRunner(ours, block_size=4)
    outputs = runner.generate(prompts, NUM_NEW_TOKENS, chunked=chunked)
    for b, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        expected = hf_greedy(reference, prompt, NUM_NEW_TOKENS)
        assert output == expected, f"prompt {b} (len {len(prompt)}, chunked={chunked[b]})"


def test_bfloat16_model_runs_and_mostly_agrees(checkpoint: Path) -> None:
    """bf16 is not bit-comparable with the reference; check it runs and tracks float32."""
    ours = load_model(checkpoint, dtype=torch.bfloat16)
    reference = load_model(checkpoint, dtype=torch.float32)
    prompt = random_prompts(1, TINY_SIZES["vocab_size"], 30, 30, seed=2)[0]
    low = _full_prompt_logits(ours, prompt)
    high = _full_prompt_logits(reference, prompt)
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    agreement = (low.argmax(-1) == high.argmax(-1)).float().mean().item()
    assert agreement >= 0.8, agreement


def test_bfloat16_matches_transformers_bfloat16_but_for_near_ties(checkpoint: Path) -> None:
    """Both in bf16, teacher-forced over a prompt: every position's argmax agrees with
    transformers' bf16 run, except where transformers' own two best logits are within the
    margin bf16's rounding can move (a near-tie either side may win)."""
    ours = load_model(checkpoint, dtype=torch.bfloat16)
    reference = hf_model(checkpoint, torch.bfloat16)
    margin = 0.05  # logits; bf16 keeps ~3 significant digits of values of order 1-10
    for seed in (3, 4):
        prompt = random_prompts(1, TINY_SIZES["vocab_size"], 40, 40, seed=seed)[0]
        low = _full_prompt_logits(ours, prompt)
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0].float()
        top2 = expected.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > margin
        assert decided.float().mean() > 0.5, "the margin leaves too little to compare"
        assert torch.equal(low.argmax(-1)[decided], expected.argmax(-1)[decided]), seed


def test_placeholder_forward_with_zero_tokens(checkpoint: Path) -> None:
    model = load_model(checkpoint)
    model.attach_kv_cache(model.new_kv_cache(4, 4))
    for mode in DispatchMode:
        attn = AttentionMetadata.build([], [], [], 4, is_prefill=mode is DispatchMode.NORMAL)
        empty = torch.empty(0, dtype=torch.int64)
        hidden = model(empty, empty, attn, mode)
        assert hidden.shape == (0, TINY_SIZES["hidden_size"])
        assert model.compute_logits(hidden).shape == (0, TINY_SIZES["vocab_size"])
