"""Sampler milliseconds per step: the batched counter-based sampler against the one it replaced.

Batch 1/16/64/256 x vocabulary 32k/152k, for greedy, temperature 1.0, temperature 1.0 + top_p
0.9 + top_k 50, top_p 0.9 alone, and temperature 1.0 with presence, frequency and repetition
penalties (the baseline has no penalties: "-"). The baseline is dist_engine/engine/sampler.py as
of --baseline-rev (the per-request-generator sampler), loaded from git history, with its states
made once as its runner kept them; the new sampler's time includes building its rows, as the
runner does every step, on PyTorch's path (`new`) and with `sampler_backend: native` (`native`:
the unfiltered rows drawn by the compiled kernel; the filtered ones stay on PyTorch's path).
Rounds interleave the three; each cell is the median and range over rounds.
Host malloc is set as a CPU engine sets it (`--allocator retain`,
dist_engine/engine/host_memory.py): without it each step's large tensors fault their pages in
again. Prints a table and writes JSON with the processor's flags and the load average.

    .venv/bin/python scripts/bench_sampler.py [--rounds 5] [--threads N] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from machine import describe, processor

from dist_engine.engine.host_memory import retain_freed_memory
from dist_engine.engine.sampler import Sampler, SamplingRow
from dist_engine.kernels.compute import sample_rows
from scheduler import SamplingParams

REPO = Path(__file__).resolve().parent.parent
BASELINE_REV = "b044a9e"  # the last commit with the per-request-generator sampler
MODES: dict[str, dict[str, Any]] = {
    "greedy": {},
    "temperature 1.0": {"temperature": 1.0},
    "t=1 top_p 0.9 top_k 50": {"temperature": 1.0, "top_p": 0.9, "top_k": 50},
    "t=1 top_p 0.9": {"temperature": 1.0, "top_p": 0.9},
    "t=1 penalties": {
        "temperature": 1.0,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
    },
}
PROMPT_LEN, OUTPUT_LEN = 256, 64  # the token history each penalised row carries


def load_baseline(rev: str) -> types.ModuleType:
    """The sampler module as of `rev`, from git history (it imports only torch and scheduler)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:dist_engine/engine/sampler.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    module = types.ModuleType("baseline_sampler")
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    exec(compile(source, f"{rev}:dist_engine/engine/sampler.py", "exec"), module.__dict__)
    return module


def contenders(
    baseline: types.ModuleType, batch: int, vocab: int, settings: dict[str, Any]
) -> dict[str, Callable[[], torch.Tensor] | None]:
    """One step of each sampler over the same logits: callables returning token ids [batch]."""
    generator = torch.Generator().manual_seed(batch * 7 + vocab)
    logits = torch.randn(batch, vocab, generator=generator) * 2.0
    params = SamplingParams(max_tokens=OUTPUT_LEN + 1_000_000, **settings)
    history = torch.randint(vocab, (batch, PROMPT_LEN + OUTPUT_LEN), generator=generator)
    prompts = [h[:PROMPT_LEN].tolist() for h in history] if params.uses_penalties else [()] * batch
    outputs = [h[PROMPT_LEN:].tolist() for h in history] if params.uses_penalties else [()] * batch
    step = [OUTPUT_LEN]

    def run(sampler: Sampler) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            step[0] += 1
            rows = [
                SamplingRow(params, seed, step[0], prompts[seed], outputs[seed])
                for seed in range(batch)
            ]
            return sampler(logits, rows).token_ids

        return call

    result: dict[str, Callable[[], torch.Tensor] | None] = {
        "baseline": None,
        "new": run(Sampler()),
        "native": run(Sampler(native=True)) if sample_rows() is not None else None,
    }
    if not params.uses_penalties:
        old_sampler = baseline.Sampler()
        states = [
            baseline.SamplingState(
                temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed
            )
            for seed in range(batch)
        ]
        result["baseline"] = lambda: old_sampler(logits, states)
    return result


def time_once(call: Callable[[], torch.Tensor], repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e3


def bench(
    baseline: types.ModuleType, batch: int, vocab: int, mode: str, rounds: int
) -> dict[str, Any]:
    calls = contenders(baseline, batch, vocab, MODES[mode])
    live = {name: call for name, call in calls.items() if call is not None}
    # One warm-up call each sets how many calls make a timed sample (at least ~50 ms).
    repeats = {name: max(1, min(50, int(50 / time_once(call, 1)))) for name, call in live.items()}
    samples: dict[str, list[float]] = {name: [] for name in live}
    order = list(live)
    for _ in range(rounds):
        for name in order:
            samples[name].append(time_once(live[name], repeats[name]))
        order = order[1:] + order[:1]
    cell: dict[str, Any] = {"batch": batch, "vocab": vocab, "mode": mode}
    for name in calls:
        values = samples.get(name)
        cell[name] = values and {
            "median_ms": statistics.median(values),
            "min_ms": min(values),
            "max_ms": max(values),
            "samples_ms": values,
        }
    return cell


def _cell(timing: dict[str, float] | None) -> str:
    if timing is None:
        return "-"
    return f"{timing['median_ms']:.2f} [{timing['min_ms']:.2f}-{timing['max_ms']:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed samples per contender")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 152064])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--baseline-rev", default=BASELINE_REV)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument(
        "--allocator",
        default="retain",
        choices=["retain", "system"],
        help="host malloc: 'retain' as every CPU engine sets it (dist_engine/engine/"
        "host_memory.py), 'system' as glibc starts",
    )
    parser.add_argument("--out", default="bench_results/sampler.json")
    args = parser.parse_args()
    if args.allocator == "retain" and not retain_freed_memory():
        raise SystemExit("glibc refused the host allocator setting")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    baseline = load_baseline(args.baseline_rev)
    load_before = os.getloadavg()
    cells = []
    threads = torch.get_num_threads()
    print(f"processor: {describe(processor())}; torch {torch.__version__}, {threads} threads")
    print("| vocab | batch | mode | baseline ms (median [range]) | new ms (median [range]) "
          "| speed-up | native ms (median [range]) |")  # fmt: skip
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for vocab in args.vocabs:
        for batch in args.batches:
            for mode in args.modes:
                cell = bench(baseline, batch, vocab, mode, args.rounds)
                cells.append(cell)
                old, new, native = cell["baseline"], cell["new"], cell["native"]
                ratio = f"{old['median_ms'] / new['median_ms']:.1f}x" if old else "-"
                print(f"| {vocab} | {batch} | {mode} | {_cell(old)} | {_cell(new)} | {ratio} "
                      f"| {_cell(native)} |", flush=True)  # fmt: skip
    meta = {
        "machine": platform.platform(),
        "processor": processor(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "allocator": args.allocator,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "baseline_rev": args.baseline_rev,
        "args": vars(args),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "cells": cells}, indent=2))
    print(f"load average {load_before[0]:.2f} before, {meta['load_average_after'][0]:.2f} after")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
