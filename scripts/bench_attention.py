"""Decode attention kernel time per layer, over a cache out of the CPU's caches and in them.

`paged_decode_attention` (dist_engine/kernels/csrc) for B sequences of up to L cached tokens
(lengths uniform in [L/2, L]) whose blocks lie at random places in a pool of `--layers` layers'
K/V caches, as an engine's pool holds them. `cold`: the call after 256 MB were written, so its
K/V come from memory (the pools hold more than 200 MB); `warm`: the same call again at once
(its K/V where the first call left them: in cache when they fit). Each contender is this
checkout's kernel build or another checkout's (`--tree NAME=PATH`, e.g. a `git worktree` of
an older commit): every build is loaded into this one process, so rounds interleave them on
the same pools, and their outputs must be equal bit for bit. Each cell: median [p10-p90] over
`--rounds` calls. Prints a table and writes JSON with the processor's flags and the load
average.

    .venv/bin/python scripts/bench_attention.py [--tree base=../base] [--rounds 24]
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from machine import describe, processor

from dist_engine.kernels import compute

FLUSH_BYTES = 256 * 2**20
SHAPES = ["8,4,32", "32,8,128"]  # query heads, kv heads, head dim: the built-in model, Mixtral
BATCHES = ["74x200", "128x300", "16x1000", "256x100"]  # sequences x longest context


def load_build(checkout: Path) -> Callable[..., torch.Tensor]:
    """The decode attention kernel of the compute kernels built from ``checkout`` (built there
    now if its cache has none), loaded under the build's own module name."""
    found = subprocess.run(
        [sys.executable, "-c",
         "from dist_engine.kernels import compute; print(compute._module().__file__)"],
        cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)},
        capture_output=True, text=True, check=True,
    ).stdout.strip().splitlines()[-1]  # fmt: skip
    path = Path(found)
    loader = importlib.machinery.ExtensionFileLoader(path.stem, str(path))
    spec = importlib.util.spec_from_loader(path.stem, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module.paged_decode_attention


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_cell(
    kernels: dict[str, Callable[..., torch.Tensor]],
    shape: tuple[int, int, int],
    batch: tuple[int, int],
    dtype: torch.dtype,
    args: argparse.Namespace,
    flush: torch.Tensor,
) -> dict[str, Any]:
    heads, kv_heads, head_dim = shape
    seqs, longest = batch
    per_seq = -(-longest // args.block_size)
    row_bytes = kv_heads * head_dim * dtype.itemsize
    # Pools of at least 200 MB of K/V over the layers, and room for every sequence's blocks
    # (block 0 is the engine's reserved one).
    num_blocks = max(
        200 * 2**20 // (2 * args.layers * args.block_size * row_bytes), seqs * per_seq + 1
    )
    generator = torch.Generator().manual_seed(seqs * 1000 + longest)
    pools = [
        tuple(
            torch.randn(num_blocks, args.block_size, kv_heads, head_dim, generator=generator).to(
                dtype
            )
            for _ in range(2)
        )
        for _ in range(args.layers)
    ]
    tables = (torch.randperm(num_blocks - 1, generator=generator)[: seqs * per_seq] + 1).view(
        seqs, per_seq
    )
    lens = torch.randint(max(1, longest // 2), longest + 1, (seqs,), generator=generator)
    query = torch.randn(seqs, heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5
    outputs = {
        name: kernel(query, *pools[0], tables, lens, scale) for name, kernel in kernels.items()
    }
    first = next(iter(outputs.values()))
    equal = all(torch.equal(out, first) for out in outputs.values())
    samples: dict[str, dict[str, list[float]]] = {n: {"cold": [], "warm": []} for n in kernels}
    order = list(kernels)
    for index in range(args.rounds):
        key_cache, value_cache = pools[index % args.layers]
        for name in order:
            flush.add_(1.0)
            for kind in ("cold", "warm"):
                start = time.perf_counter()
                kernels[name](query, key_cache, value_cache, tables, lens, scale)
                samples[name][kind].append((time.perf_counter() - start) * 1e3)
        order = order[1:] + order[:1]
    return {
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "seqs": seqs,
        "longest": longest,
        "kv_mb": round(int(lens.sum()) * row_bytes * 2 / 2**20, 1),
        "equal": equal,
        "ms": {
            name: {
                kind: {
                    "median": statistics.median(values),
                    "p10": percentile(values, 0.1),
                    "p90": percentile(values, 0.9),
                    "samples": values,
                }
                for kind, values in kinds.items()
            }
            for name, kinds in samples.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                        help="another checkout whose kernel build is a contender")  # fmt: skip
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="heads,kv_heads,head_dim")
    parser.add_argument("--batches", nargs="+", default=BATCHES, help="SEQSxLONGEST")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench_results/attention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    this = compute.decode_attention()
    if this is None:
        raise SystemExit("the compute kernels did not build here")
    kernels = {"this": this}
    for tree in args.tree:
        name, _, path = tree.partition("=")
        if not (Path(path) / "dist_engine").is_dir():
            parser.error(f"--tree {tree}: {path} holds no dist_engine/")
        kernels[name] = load_build(Path(path).resolve())
    load_before = os.getloadavg()
    flush = torch.zeros(FLUSH_BYTES // 4)
    names = list(kernels)
    print(f"processor: {describe(processor())}; torch {torch.__version__}, {args.threads} threads")
    print("| heads | dtype | B x L | K/V MB | "
          + " | ".join(f"{n} cold ms | {n} warm ms" for n in names)
          + (" | cold / " + names[1] if len(names) > 1 else "") + " | equal |")  # fmt: skip
    print("| --- | --- | --- | ---: | " + " | ".join("---: | ---:" for _ in names)
          + (" | ---:" if len(names) > 1 else "") + " | --- |")  # fmt: skip
    cells = []
    for shape_text in args.shapes:
        shape = tuple(int(x) for x in shape_text.split(","))
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for batch_text in args.batches:
                batch = tuple(int(x) for x in batch_text.split("x"))
                cell = bench_cell(kernels, shape, batch, dtype, args, flush)  # type: ignore[arg-type]
                cells.append(cell)
                ms = cell["ms"]

                def fmt(t: dict[str, float]) -> str:
                    return f"{t['median']:.3f} [{t['p10']:.3f}-{t['p90']:.3f}]"

                row = " | ".join(f"{fmt(ms[n]['cold'])} | {fmt(ms[n]['warm'])}" for n in names)
                ratio = (
                    f" | {ms['this']['cold']['median'] / ms[names[1]]['cold']['median']:.2f}"
                    if len(names) > 1
                    else ""
                )
                print(f"| {shape_text} | {dtype_name} | {batch_text} | {cell['kv_mb']} | {row}"
                      f"{ratio} | {cell['equal']} |", flush=True)  # fmt: skip
    meta = {
        "machine": platform.platform(),
        "processor": processor(),
        "torch": torch.__version__,
        "threads": args.threads,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "contenders": {"this": str(Path(__file__).resolve().parent.parent), **dict(
            t.partition("=")[::2] for t in args.tree)},
        "args": vars(args),
    }  # fmt: skip
    print(f"load average {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))
    print(f"wrote {out}")
    if not all(cell["equal"] for cell in cells):
        raise SystemExit("the contenders' outputs differ")


if __name__ == "__main__":
    main()
