"""vLLM v1's own Scheduler timed on the cases `scripts/bench_scheduler.py` times Lockstep's on.

Runs in vLLM's virtual environment (`.venv-vllm`, made by `scripts/bench_vs_vllm.py` on first
use); `bench_scheduler.py --peer vllm` starts it once per round and reads one JSON line:

    .venv-vllm/bin/python scripts/vllm_scheduler_worker.py \
        '{"sizes": [64, 256, 1024], "steps": 300, "repeats": 1, "every": 4}'

The scheduler is `vllm.v1.core.sched.scheduler.Scheduler`, built as vLLM's engine core builds
it (a `VllmConfig`, a one-group full-attention `KVCacheConfig`, the structured-output manager,
the request block hasher when prefix caching is on), with synchronous scheduling and
`log_stats=False` (the cheaper of its two settings; `vllm serve` logs stats by default). A step
is `schedule()` then `update_from_output()` with one sampled token for every scheduled request,
the pair vLLM's engine core runs around each forward; no model runs. The model config is a tiny
Llama `config.json` written to a temporary directory (the scheduler reads only its limits), with
no tokenizer.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 16
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "torch_dtype": "float32",
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


class Peer:
    """One vLLM Scheduler with the limits Lockstep's benchmark gives its own."""

    def __init__(
        self,
        model_dir: str,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_blocks: int,
        prefix_caching: bool,
    ) -> None:
        model = ModelConfig(
            model=model_dir, skip_tokenizer_init=True, max_model_len=max_model_len, dtype="float32"
        )
        scheduler = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            async_scheduling=False,
        )
        cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching)
        cache.num_gpu_blocks = num_blocks
        config = VllmConfig(
            model_config=model,
            scheduler_config=scheduler,
            cache_config=cache,
            device_config=DeviceConfig("cpu"),
        )
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32
        )
        kv_cache = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)],
        )
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
            log_stats=False,
        )
        self.hasher = None
        if prefix_caching:
            hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self.hasher = get_request_block_hasher(BLOCK, hash_fn)

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.scheduler.add_request(
            Request(request_id, prompt, params, None, block_hasher=self.hasher)
        )

    def step(self):
        """schedule() and update_from_output() with one token for each scheduled request."""
        output = self.scheduler.schedule()
        ids = list(output.num_scheduled_tokens)
        result = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: index for index, rid in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
        )
        self.scheduler.update_from_output(output, result)
        return output


def time_decode(
    model_dir: str, num_seqs: int, steps: int, repeats: int, prefix_caching: bool
) -> dict:
    prompt_len = 32
    samples = []
    for _ in range(repeats):
        peer = Peer(
            model_dir,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(2048, num_seqs * prompt_len),
            max_model_len=4096,
            num_blocks=num_seqs * 64 + 1,
            prefix_caching=prefix_caching,
        )
        params = SamplingParams(max_tokens=100_000, ignore_eos=True)
        for index in range(num_seqs):
            peer.add(f"r{index}", [index % 97 + 1] * prompt_len, params)
        first = peer.step()
        assert len(first.scheduled_new_reqs) == num_seqs, "the first step did not admit all"
        for _ in range(20):  # warm-up
            peer.step()
        start = time.perf_counter()
        for _ in range(steps):
            output = peer.step()
        samples.append((time.perf_counter() - start) / steps * 1e6)
        assert output.total_num_scheduled_tokens == num_seqs, "a step was not pure decode"
    return {"us_per_step": statistics.median(samples), "samples_us": samples}


def time_arrivals(model_dir: str, num_seqs: int, steps: int, repeats: int, every: int) -> dict:
    """bench_scheduler's `decode + arrivals`: a 64-token prompt (4 output tokens) arriving every
    `every` steps among `num_seqs` decoding; vLLM takes it into the next step with the decodes."""
    samples = []
    short = SamplingParams(max_tokens=4, ignore_eos=True)
    for _ in range(repeats):
        peer = Peer(
            model_dir,
            max_num_seqs=num_seqs + 64,
            max_num_batched_tokens=max(2048, num_seqs * 32),
            max_model_len=4096,
            num_blocks=num_seqs * 64 + 1,
            prefix_caching=False,
        )
        params = SamplingParams(max_tokens=100_000, ignore_eos=True)
        for index in range(num_seqs):
            peer.add(f"r{index}", [index % 97 + 1] * 32, params)
        arrivals = 0

        def step(index: int, peer: Peer = peer) -> int:
            nonlocal arrivals
            if index % every == 0:
                arrivals += 1
                peer.add(f"a{arrivals}", [arrivals % 89 + 3] * 64, short)
            return len(peer.step().num_scheduled_tokens)

        for index in range(40):
            step(index)
        start = time.perf_counter()
        scheduled = [step(index) for index in range(40, 40 + steps)]
        samples.append((time.perf_counter() - start) / steps * 1e6)
        assert min(scheduled) >= num_seqs, "a step left a running request out"
    return {"us_per_step": statistics.median(samples), "samples_us": samples}


def time_prefill(model_dir: str, num_prompts: int, prompt_len: int, repeats: int) -> dict:
    samples = []
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for _ in range(repeats):
        peer = Peer(
            model_dir,
            max_num_seqs=num_prompts,
            max_num_batched_tokens=num_prompts * prompt_len,
            max_model_len=prompt_len + 8,
            num_blocks=num_prompts * (prompt_len // BLOCK + 2) * 2 + 1,
            prefix_caching=True,
        )
        rounds = 50
        start = time.perf_counter()
        for round_index in range(rounds):
            for index in range(num_prompts):
                prompt = [round_index * 7 + index % 13 + 1] * prompt_len
                peer.add(f"p{round_index}-{index}", prompt, params)
            output = peer.step()
            assert len(output.scheduled_new_reqs) == num_prompts, "a prompt was not admitted"
        samples.append((time.perf_counter() - start) / rounds * 1e6)
        assert not peer.scheduler.running and not peer.scheduler.waiting, "a request is left"
    return {"us_per_step": statistics.median(samples), "samples_us": samples}


def main() -> None:
    args = json.loads(sys.argv[1])
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(MODEL_CONFIG))
        rows = []
        for prefix_caching in (False, True):
            for size in args["sizes"]:
                result = time_decode(
                    model_dir, size, args["steps"], args["repeats"], prefix_caching
                )
                rows.append(
                    {
                        "kind": "decode",
                        "running_seqs": size,
                        "prefix_caching": prefix_caching,
                        **result,
                    }
                )
        arrivals = time_arrivals(model_dir, 256, args["steps"], args["repeats"], args["every"])
        rows.append(
            {"kind": "decode + arrivals", "running_seqs": 256, "prefix_caching": False, **arrivals}
        )
        prefill = time_prefill(model_dir, 64, 256, args["repeats"])
        rows.append({"kind": "prefill", "running_seqs": 64, "prefix_caching": True, **prefill})
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
