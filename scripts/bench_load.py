"""Load time and peak resident memory per rank: a block-FP8 checkpoint against its bf16 twin.

    .venv/bin/python scripts/bench_load.py [--cache-dir DIR] [--dp 1 2]
        [--dtypes bfloat16 float32] [--threads-per-rank 1] [--out bench_results/load.json]

The checkpoint (`SIZES`, about 2 GB as FP8): DeepSeek-V3's shape scaled down — hidden 2048,
16 heads with V3's head dims (nope/rope/v 128/64/128, q_lora 1536, kv_lora 512, so the
kv_a projection has V3's 576 rows and a partial last block), 6 layers (one dense, MLP 6144;
five MoE of 64 experts of 768 with one shared expert), vocab 32000 — written once under
`--cache-dir` as a block-FP8 release (`make_tiny_checkpoint(..., fp8=True)`, 4 shards) and as
its bf16 conversion (every FP8 weight dequantized to bf16, scales dropped, the rest as is).

Each (checkpoint, run dtype, DP size) starts DP fresh processes together (`run_multirank`),
each building its share of the model (the engine's even expert placement) and filling it with
`load_weights`, reading onto the CPU with `--threads-per-rank` torch threads. Per rank: the
load's seconds; the rank's weights in the run dtype; the RSS before the load (interpreter,
torch, the process group) and its peak (VmHWM), and the peaks of its anonymous and
file-backed parts (sampled every 5 ms); and peak / weights. The checkpoint files are read once
before each load, so every load reads from the page cache. Figures from this host, not
properties of the code.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from machine import processor
from safetensors.torch import save_file

from dist_engine.distributed.spawn import run_multirank
from dist_engine.engine.host_memory import retain_freed_memory
from dist_engine.layers.moe import ExpertParallelContext
from dist_engine.models import block_fp8
from dist_engine.models.loader import INDEX_FILE, CheckpointReader, build_model, load_weights
from dist_engine.models.make_model import make_tiny_checkpoint
from dist_engine.models.registry import load_config
from moe import ExpertPlacement

SIZES = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "num_layers": 6,
    "num_heads": 16,
    "num_experts": 64,
    "top_k": 8,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}
NUM_SHARDS = 4
SAMPLE_S = 0.005


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir", type=Path, default=Path.home() / ".cache" / "lockstep" / "bench_load"
    )
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument(
        "--threads-per-rank",
        type=int,
        default=1,
        help="torch threads per rank (on a busy host, more threads than free cores spin)",
    )
    parser.add_argument(
        "--allocators",
        nargs="+",
        default=["retain"],
        choices=["retain", "system"],
        help="host malloc: 'retain' as every CPU engine sets it before loading "
        "(dist_engine/engine/host_memory.py), 'system' as glibc starts",
    )
    parser.add_argument("--out", default="bench_results/load.json")
    return parser.parse_args()


def write_checkpoints(cache_dir: Path) -> dict[str, Path]:
    """The FP8 release and its bf16 conversion, written once (a `done` file marks each)."""
    fp8_dir, bf16_dir = cache_dir / "fp8", cache_dir / "bf16"
    if not (fp8_dir / "done").exists():
        print(f"writing the FP8 checkpoint to {fp8_dir} ...", flush=True)
        make_tiny_checkpoint(
            "deepseek_v3",
            fp8_dir,
            seed=0,
            dtype="bfloat16",
            fp8=True,
            num_shards=NUM_SHARDS,
            initializer_range=0.02,
            write_tokenizer=False,
            **SIZES,
        )
        (fp8_dir / "done").write_text("")
    if not (bf16_dir / "done").exists():
        print(f"writing its bf16 conversion to {bf16_dir} ...", flush=True)
        convert_to_bf16(fp8_dir, bf16_dir)
        (bf16_dir / "done").write_text("")
    return {"fp8": fp8_dir, "bf16": bf16_dir}


def convert_to_bf16(fp8_dir: Path, out_dir: Path) -> None:
    """Shard by shard: every FP8 weight times its scales in bf16, scales dropped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    index = json.loads((fp8_dir / INDEX_FILE).read_text())
    weight_map = {n: f for n, f in index["weight_map"].items() if not n.endswith("_scale_inv")}
    block = tuple(block_fp8.SUPPORTED_BLOCK_SIZE)
    with CheckpointReader(fp8_dir) as reader:
        for file_name in sorted(set(weight_map.values())):
            tensors = {}
            for name in sorted(n for n, f in weight_map.items() if f == file_name):
                shape = reader.shape(name)
                tensor = reader.read(name, shape)
                if tensor.dtype == block_fp8.FP8_DTYPE:
                    scale_name = name + block_fp8.SCALE_SUFFIX
                    scale = reader.read(scale_name, reader.shape(scale_name))
                    tensor = block_fp8.dequantize(tensor, scale, block, torch.bfloat16)
                tensors[name] = tensor
            save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
    total = sum((out_dir / f).stat().st_size for f in set(weight_map.values()))
    (out_dir / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def warm_page_cache(model_dir: Path) -> int:
    """Read every file once so the timed loads all read from memory; returns the bytes."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            while chunk := f.read(64 * 2**20):
                total += len(chunk)
    return total


class RssSampler:
    """The peaks of RssAnon, RssFile and their sum, sampled from /proc/self/status."""

    def __init__(self) -> None:
        self.peak = {"anon": 0, "file": 0, "total": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def _sample(self) -> None:
        status = proc_status()
        now = {"anon": status["RssAnon"], "file": status["RssFile"]}
        now["total"] = now["anon"] + now["file"]
        for key, value in now.items():
            self.peak[key] = max(self.peak[key], value)


def proc_status() -> dict[str, int]:
    """The kB fields of /proc/self/status, in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def load_rank(
    rank: int, world: int, model_dir: str, dtype_name: str, allocator: str
) -> dict[str, Any]:
    """One rank (inside `run_multirank`, the group joined): build and load its share."""
    dtype = getattr(torch, dtype_name)
    if allocator == "retain" and not retain_freed_memory():
        raise RuntimeError("glibc refused the host allocator setting")
    before = proc_status()["VmRSS"]
    with RssSampler() as sampler:
        start = time.perf_counter()
        config = load_config(model_dir)
        placement = ExpertPlacement.even(config.num_experts, world)
        group = dist.group.WORLD if world > 1 else None
        context = ExpertParallelContext(placement=placement, rank=rank, group=group)
        model = build_model(config, dtype, ep_context=context)
        with CheckpointReader(model_dir) as reader:
            load_weights(model, reader, context)
            num_tensors_read = len(reader.tensors_read)
        seconds = time.perf_counter() - start
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "rank": rank,
        "load_s": seconds,
        "weights_bytes": weights,
        "rss_before_bytes": before,
        "peak_rss_bytes": proc_status()["VmHWM"],
        "peak_anon_bytes": sampler.peak["anon"],
        "peak_file_bytes": sampler.peak["file"],
        "tensors_read": num_tensors_read,
    }


def main() -> None:
    args = parse_args()
    checkpoints = write_checkpoints(args.cache_dir)
    sizes = {kind: warm_page_cache(path) for kind, path in checkpoints.items()}
    load = os.getloadavg()
    rows = []
    for dtype_name in args.dtypes:
        for dp in args.dp:
            for allocator in args.allocators:
                for kind, path in checkpoints.items():
                    warm_page_cache(path)
                    results = run_multirank(
                        dp,
                        load_rank,
                        (str(path), dtype_name, allocator),
                        timeout_s=1800,
                        group_timeout_s=1800,
                        num_threads=args.threads_per_rank,
                    )
                    for result in results:
                        rows.append(
                            {
                                "checkpoint": kind,
                                "dtype": dtype_name,
                                "dp": dp,
                                "allocator": allocator,
                                **result,
                            }
                        )
                        print_row(rows[-1])
    print(f"checkpoint bytes: fp8 {sizes['fp8'] / 1e9:.2f} GB, bf16 {sizes['bf16'] / 1e9:.2f} GB")
    print(f"load average before: {load[0]:.2f}; after: {os.getloadavg()[0]:.2f}")
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.platform(),
        "processor": processor(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "load_avg_before": load,
        "load_avg_after": os.getloadavg(),
        "checkpoint_bytes": sizes,
        "model": SIZES,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


def print_row(row: dict[str, Any]) -> None:
    print(
        f"  {row['checkpoint']} -> {row['dtype']} DP={row['dp']} {row['allocator']} "
        f"rank {row['rank']}: "
        f"{row['load_s']:.1f} s, peak {row['peak_rss_bytes'] / 2**30:.2f} GiB",
        flush=True,
    )


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| checkpoint | run dtype | DP | malloc | rank | load s | weights GiB | RSS before GiB "
        "| peak RSS GiB (anon + file) | peak / weights | (peak - before) / weights |"
    )
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    gib = 2**30
    for row in rows:
        weights = row["weights_bytes"]
        print(
            f"| {row['checkpoint']} | {row['dtype']} | {row['dp']} | {row['allocator']} "
            f"| {row['rank']} "
            f"| {row['load_s']:.1f} | {weights / gib:.2f} | {row['rss_before_bytes'] / gib:.2f} "
            f"| {row['peak_rss_bytes'] / gib:.2f} ({row['peak_anon_bytes'] / gib:.2f} + "
            f"{row['peak_file_bytes'] / gib:.2f}) | {row['peak_rss_bytes'] / weights:.2f} "
            f"| {(row['peak_rss_bytes'] - row['rss_before_bytes']) / weights:.2f} |"
        )


if __name__ == "__main__":
    main()
