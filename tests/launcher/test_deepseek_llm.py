"""A tiny DeepSeek-V3 through the offline LLM API at DP = 1 (local), 2 and 4 (Ray actors, EP
over every rank): greedy tokens equal transformers' with a chunked-prefill budget, a KV pool
small enough to force recompute preemption, and prefix caching on."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import ray
import torch
from model_fixtures import TINY_SIZES, hf_greedy, hf_model, random_prompts

from dist_engine.models.make_model import make_tiny_checkpoint
from launcher import LLM, SamplingParams

pytestmark = pytest.mark.multirank

NUM_NEW_TOKENS = 12
PARAMS = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
# A 16-token budget chunks every longer prompt; 19 usable blocks of 4 tokens per rank cannot
# hold a rank's sequences at once (each needs up to 13), so ranks preempt and recompute; and
# prompts sharing a 24-token prefix are pinned to one rank so its prefix cache serves them.
SETTINGS = dict(
    dtype="float32",
    max_num_seqs=8,
    max_model_len=96,
    block_size=4,
    num_blocks=20,
    max_num_batched_tokens=16,
    prefill_watermark=1.0,
    enable_prefix_caching=True,
)


def _workload(dp_size: int) -> tuple[list[list[int]], list[int | None]]:
    vocab = TINY_SIZES["vocab_size"]
    prompts = random_prompts(4 * dp_size, vocab, 2, 40, seed=dp_size)
    rng = random.Random(dp_size)
    prefix = [rng.randrange(1, vocab) for _ in range(24)]
    shared = [prefix + [rng.randrange(1, vocab) for _ in range(n)] for n in range(1, 5)]
    return prompts + shared, [None] * len(prompts) + [dp_size - 1] * len(shared)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("deepseek-v3")
    return make_tiny_checkpoint("deepseek_v3", out, seed=5, num_layers=3, **TINY_SIZES)


@pytest.fixture(scope="module")
def expected(deepseek_dir: Path) -> dict[tuple[int, ...], list[int]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model; spinning OpenMP workers only slow it down
    try:
        reference = hf_model(deepseek_dir)
        prompts = {tuple(p) for dp in (1, 2, 4) for p in _workload(dp)[0]}
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


def _check(outputs, prompts, expected, dp_size: int, counts: list[dict[str, int]]) -> None:
    for index, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        assert output.finish_reason == "length", (index, output.finish_reason)
        assert output.output_token_ids == expected[tuple(prompt)], f"prompt {index}"
    assert {o.dp_rank for o in outputs} == set(range(dp_size))
    assert sum(c["num_preemptions"] for c in counts) > 0, "no rank preempted"
    assert counts[dp_size - 1]["prefix_hits"] > 0, "the shared prefix was never reused"


def test_dp1_local_equals_transformers(deepseek_dir, expected):
    prompts, pins = _workload(1)
    with LLM(model=deepseek_dir, dp_size=1, launcher="local", **SETTINGS) as llm:
        assert llm.backends.startswith("attention torch (no native mla kernels)")
        outputs = llm.generate(prompts, PARAMS, dp_rank=pins, use_tqdm=False)
        scheduler = llm.client.host.engine.scheduler
        counts = [
            {
                "num_preemptions": scheduler.num_preemptions,
                "prefix_hits": scheduler.kv.prefix_cache.num_hit_tokens,
            }
        ]
    _check(outputs, prompts, expected, 1, counts)


@pytest.mark.parametrize("dp_size", [2, 4])
def test_ray_dp_with_ep_equals_transformers(deepseek_dir, expected, ray_cluster, dp_size):
    prompts, pins = _workload(dp_size)
    with LLM(model=deepseek_dir, dp_size=dp_size, launcher="ray", **SETTINGS) as llm:
        outputs = llm.generate(prompts, PARAMS, dp_rank=pins, use_tqdm=False)
        counts = ray.get([actor.scheduler_counts.remote() for actor in llm.client.actors])
    _check(outputs, prompts, expected, dp_size, counts)
