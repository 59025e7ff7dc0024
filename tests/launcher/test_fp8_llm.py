"""A tiny block-FP8 DeepSeek-V3 release through the offline LLM API at DP = 1 (local), 2 and 4
(Ray actors, EP over every rank): the greedy tokens transformers gives on the weights the test
dequantized itself; and a bad FP8 checkpoint stops `LLM(...)` before any rank starts."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import ray
import torch
from model_fixtures import (
    FP8_SIZES,
    hf_greedy,
    hf_model,
    random_prompts,
    write_dequantized_reference,
)
from safetensors.torch import load_file, save_file

from dist_engine.models.make_model import make_tiny_checkpoint
from launcher import LLM, SamplingParams

pytestmark = pytest.mark.multirank

NUM_NEW_TOKENS = 8
PARAMS = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
SETTINGS = dict(
    dtype="float32",
    max_num_seqs=4,
    max_model_len=64,
    block_size=4,
    num_blocks=64,
    threads_per_rank=1,
)
SIZES = FP8_SIZES["deepseek_v3"]


def _prompts(dp_size: int) -> list[list[int]]:
    return random_prompts(2 * dp_size, SIZES["vocab_size"], 2, 30, seed=dp_size)


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("v3-fp8")
    return make_tiny_checkpoint("deepseek_v3", out, seed=5, dtype="bfloat16", fp8=True, **SIZES)


@pytest.fixture(scope="module")
def expected(
    release: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[int, ...], list[int]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model; spinning OpenMP workers only slow it down
    try:
        reference = hf_model(write_dequantized_reference(release, tmp_path_factory.mktemp("ref")))
        prompts = {tuple(p) for dp in (1, 2, 4) for p in _prompts(dp)}
        return {p: hf_greedy(reference, list(p), NUM_NEW_TOKENS) for p in prompts}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=200 * 1024 * 1024,
    )
    yield
    ray.shutdown()


def _check(outputs, prompts, expected, dp_size: int) -> None:
    for index, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        assert output.finish_reason == "length", (index, output.finish_reason)
        assert output.output_token_ids == expected[tuple(prompt)], f"prompt {index}"
    assert {o.dp_rank for o in outputs} == set(range(dp_size))


def test_bad_fp8_checkpoint_fails_before_any_rank_starts(release, tmp_path):
    """Without Ray running: the driver's check raises first, naming the tensor."""
    assert not ray.is_initialized()
    bad = shutil.copytree(release, tmp_path / "bad")
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.2.mlp.experts.7.gate_proj.weight_scale_inv"
    del tensors[name]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=f"no '{name}' \\(its block scales, shape \\[1, 1\\]\\)"):
        LLM(model=bad, dp_size=2, launcher="ray", **SETTINGS)
    assert not ray.is_initialized()
    config = json.loads((release / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [1, 128]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'quantization_config.weight_block_size' is \[1, 128\]"):
        LLM(model=bad, dp_size=2, launcher="ray", **SETTINGS)


def test_dp1_local_equals_transformers(release, expected):
    prompts = _prompts(1)
    with LLM(model=release, dp_size=1, launcher="local", **SETTINGS) as llm:
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    _check(outputs, prompts, expected, 1)


@pytest.mark.parametrize("dp_size", [2, 4])
def test_ray_dp_with_ep_equals_transformers(release, expected, ray_cluster, dp_size):
    prompts = _prompts(dp_size)
    with LLM(model=release, dp_size=dp_size, launcher="ray", **SETTINGS) as llm:
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    _check(outputs, prompts, expected, dp_size)
