"""A DeepSeek-V2-Lite-shaped decode step: its time, its host share and its roofline.

    python scripts/bench_gpu_step.py [--shape v2-lite] [--device cuda] [--batches 1 32 128]
        [--context 1024] [--graphs off on] [--hbm-tbps 4.8] [--out bench_results/gpu_step.json]

(from the repository root; run by scripts/gpu_check.sh where a GPU is lent; not in the suite)

The model is DeepSeek-V2-Lite's shape (27 layers, hidden 2048, MLA with a 512-wide latent, 64
routed experts top-6 plus 2 shared, the first layer dense, vocabulary 102,400: ~15.7B
parameters) in bfloat16, its weights random (drawn on the device, no checkpoint on disk). Its
config.json is the hub's (`dist_engine.models.hub_configs`), read by the engine's own loader.
`--shape tiny` is the same structure at toy sizes, to run this script on a CPU.

Per batch size B, B sequences of `--context` cached tokens decode: the real ModelRunner's decode
path (`DecodeInputs` in persistent buffers, the forward, greedy picks read back by the host), with
decode steps run eagerly and, where asked and the device is CUDA, replayed from CUDA graphs
(`ReplayedDecode`, the engine's `cuda_graphs: on`). Timed over `--steps` steps after warm-up:

  step ms      wall time of a whole step (inputs, forward, the host reading the picks)
  issue ms     host time until the forward was queued (the step's host work; on a GPU the
               kernels run after it, asynchronously)
  device ms    the device's time for the forward (CUDA events), CUDA only
  host share   1 - device / step: the part of a step the device waits for the host
  roofline ms  the bytes a step must read from device memory (every dense weight, the
               shared experts, the routed experts B tokens touch in expectation under uniform
               routing, B context rows of the latent cache per layer, the LM head) at
               `--hbm-tbps` (H200 4.8, H100 3.35 TB/s by the device's name; else required)
  of roofline  roofline / step

Prints a table and writes JSON with the device and the settings.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import processor  # noqa: E402

from dist_engine.engine.decode_graphs import ReplayedDecode, capture_sizes  # noqa: E402
from dist_engine.engine.runner import ModelRunner  # noqa: E402
from dist_engine.models.hub_configs import DEEPSEEK_V2_LITE_HUB  # noqa: E402
from dist_engine.models.loader import build_model  # noqa: E402
from dist_engine.models.registry import load_config  # noqa: E402

# DeepSeek-V2-Lite's config.json as the hub publishes it, and the same structure at toy sizes.
TINY = {
    **DEEPSEEK_V2_LITE_HUB,
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
}
SHAPES = {"v2-lite": DEEPSEEK_V2_LITE_HUB, "tiny": TINY}
HBM_TBPS = {"H200": 4.8, "H100": 3.35}  # by the device's name: its memory's peak bandwidth
BLOCK_SIZE = 16


def random_model(hf_config: dict, dtype: torch.dtype, device: torch.device, max_decode: int):
    """The model `hf_config` describes, its weights drawn on `device` (norms 1 + noise)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(hf_config))
        config = load_config(tmp)
    model = build_model(config, dtype, device, max_decode_tokens=max_decode)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point():
                continue
            noise = torch.randn(param.shape, generator=generator, device=device, dtype=dtype)
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1 + 0.1 * noise)
            else:
                param.copy_(0.02 * noise)
    model.pack_linears()
    return model, config


def step_bytes(model, config, batch: int, context: int) -> int:
    """Bytes one decode step of `batch` sequences of `context` tokens must read: every weight
    but the routed experts and the embedding table, the routed experts the batch touches in
    expectation (uniform routing), the embedding rows, and the latent cache rows."""
    routed = 0
    other = 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if ".experts." in name and "shared" not in name:
            routed += size
        elif "embed_tokens" in name:
            other += batch * param.shape[1] * param.element_size()
        else:
            other += size
    experts, top_k = config.num_experts, config.top_k
    touched = experts * (1 - (1 - top_k / experts) ** batch)  # per MoE layer, in expectation
    kv = 0
    for layer in range(config.num_layers):
        cache = model.kv_cache.layer(layer)
        for tensor in cache if isinstance(cache, tuple) else (cache,):
            per_token = tensor[0].numel() // BLOCK_SIZE * tensor.element_size()
            kv += batch * context * per_token
    return int(other + routed * touched / experts + kv)


def measure(runner: ModelRunner, batch: int, context: int, steps: int, warmup: int, cuda: bool):
    blocks = -(-(context + steps + warmup + 1) // BLOCK_SIZE)
    tables = [[1 + b * blocks + i for i in range(blocks)] for b in range(batch)]
    cached = [context] * batch
    tokens = [(7 * b + 3) % 1000 + 1 for b in range(batch)]
    wall, issue, device = [], [], []
    for index in range(warmup + steps):
        start = time.perf_counter()
        ids, attn = runner.decode_inputs.fill(tokens, tables, cached)
        if cuda:
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            began.record()
        logits = runner.decode_step(ids, attn)[:batch]
        if cuda:
            ended.record()
        queued = time.perf_counter()
        tokens = logits.argmax(dim=-1).tolist()  # the host reads the picks: the step's sync
        done = time.perf_counter()
        cached = [c + 1 for c in cached]
        if index >= warmup:
            wall.append(done - start)
            issue.append(queued - start)
            if cuda:
                device.append(began.elapsed_time(ended) / 1e3)
    result = {
        "step_ms": 1e3 * statistics.median(wall),
        "issue_ms": 1e3 * statistics.median(issue),
        "tok_s": batch / statistics.median(wall),
    }
    if device:
        result["device_ms"] = 1e3 * statistics.median(device)
        result["host_share"] = 1 - result["device_ms"] / result["step_ms"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="v2-lite", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    parser.add_argument("--graphs", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hbm-tbps", type=float, help="device memory bandwidth, TB/s")
    parser.add_argument("--out", default="bench_results/gpu_step.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else processor()["model"]
    tbps = args.hbm_tbps or next((v for k, v in HBM_TBPS.items() if k in name), None)
    if cuda and tbps is None:
        parser.error(f"no known memory bandwidth for {name!r}: pass --hbm-tbps")
    modes = [m for m in args.graphs if m == "off" or cuda]
    max_seqs = max(args.batches)
    dtype = getattr(torch, args.dtype)
    model, config = random_model(SHAPES[args.shape], dtype, device, max_seqs)
    params = sum(p.numel() for p in model.parameters())
    max_len = args.context + args.steps + args.warmup + 2
    blocks = max_seqs * -(-max_len // BLOCK_SIZE) + 2
    model.attach_kv_cache(model.new_kv_cache(blocks, BLOCK_SIZE, device))
    log = logging.getLogger("lockstep.bench_gpu_step")
    rows = []
    for mode in modes:
        runner = ModelRunner(
            model,
            BLOCK_SIZE,
            device,
            max_model_len=max_len,
            max_num_seqs=max_seqs,
            decode_batch_sizes=capture_sizes(max_seqs) if mode == "on" else None,
        )
        if mode == "on":
            runner.decode_step = ReplayedDecode(runner.decode_logits, "on", log)
        for batch in args.batches:
            with torch.no_grad():
                result = measure(runner, batch, args.context, args.steps, args.warmup, cuda)
            if mode == "on" and runner.decode_step.enabled is False:
                raise SystemExit(f"CUDA graphs fell back: {runner.decode_step.decision}")
            result.update(graphs=mode, batch=batch)
            if tbps:
                moved = step_bytes(model, config, batch, args.context)
                result["roofline_ms"] = 1e3 * moved / (tbps * 1e12)
                result["of_roofline"] = result["roofline_ms"] / result["step_ms"]
                result["bytes"] = moved
            rows.append(result)
        del runner
    columns = ["graphs", "batch", "step_ms", "issue_ms", "device_ms", "host_share", "tok_s"]
    columns += ["roofline_ms", "of_roofline"]
    print(f"{args.shape}, {params / 1e9:.2f}B parameters, {args.dtype}, {name}, "
          f"context {args.context}")  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for row in rows:
        cells = [row.get(c) for c in columns]
        print("| " + " | ".join(_cell(c) for c in cells) + " |")
    report = {
        "device": name,
        "processor": processor(),
        "shape": args.shape,
        "parameters": params,
        "dtype": args.dtype,
        "context": args.context,
        "hbm_tbps": tbps,
        "torch": torch.__version__,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


if __name__ == "__main__":
    main()
