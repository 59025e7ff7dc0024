"""Benchmark weak scaling over DP ranks: one node (DP=1, 2, 4) and two simulated Ray nodes.

    .venv/bin/python scripts/bench_scaling.py [--quick] [--out bench_results/scaling.json]
        [--plot bench_results/scaling.png]

(from the repository root, with the package installed editable)

The built-in tiny Qwen3-MoE (`launcher.builtin.BUILTIN_MODEL`), float32, written by
`make_tiny_checkpoint` into a temp dir. Fixed work per rank: a seeded set of R requests
(default 32; prompts 16–256, outputs 16–128 tokens, greedy, EOS ignored). DP=N runs N copies
of that set — the same lengths, fresh random token ids per copy — and pins copy k to rank k,
so every rank gets exactly the same amount of work and ideal weak scaling keeps the wall time
constant.

Everything runs on one `ray.cluster_utils.Cluster` with two simulated nodes (two raylets on
this machine, 8 logical CPUs each); the contenders stay up together and run interleaved (one
pass each per round):
  dp1            — one rank.
  dp2 1 node     — two ranks, `placement_strategy="STRICT_PACK"` (same raylet).
  dp4 1 node     — four ranks, STRICT_PACK: OVERSUBSCRIBED, 4 processes on 2 physical cores.
  dp2 2 nodes    — two ranks, `placement_strategy="STRICT_SPREAD"` (one per raylet), with
                   `moe_exchange: process_group`: the raylets share this host's /dev/shm, so
                   `auto` would pick the shared-memory exchange that two real hosts cannot use.
The simulated nodes share the same 2 cores, memory and loopback network, so "2 nodes" measures
that placement across raylets works and what the Ray-level path costs; it does NOT measure a
real network or extra hardware. Every rank gets one torch thread (`--threads-per-rank`), so
DP=N uses N cores: the work and the cores per rank stay fixed, as they would with one GPU per
rank.
Reported per contender (median over rounds; latencies pooled): requested output tokens/s from
job start to end (start-up excluded, reported separately), tokens/s per rank, scaling
efficiency = (tok/s at DP=N / N) / (tok/s at DP=1), TTFT p50 and ITL p50 (engine timestamps).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import (
    DEFAULT_INTERVALS,
    Ours,
    Request,
    RunResult,
    engine_settings,
    make_workload,
    percentiles,
)

from launcher.builtin import BUILTIN_MODEL

# name -> (dp_size, placement strategy, nodes used, parallel.moe_exchange)
CONTENDERS = {
    "dp1": (1, "PACK", 1, "auto"),
    "dp2 1 node": (2, "STRICT_PACK", 1, "auto"),
    "dp4 1 node (oversubscribed)": (4, "STRICT_PACK", 1, "auto"),
    "dp2 2 nodes": (2, "STRICT_SPREAD", 2, "process_group"),
}


def replicate(base: list[Request], copies: int, seed: int) -> tuple[list[Request], list[int]]:
    """`copies` copies of `base` (same lengths, new token ids) and each request's rank pin."""
    rng = random.Random(seed)
    vocab = BUILTIN_MODEL["vocab_size"]
    workload: list[Request] = []
    pins: list[int] = []
    for rank in range(copies):
        for request in base:
            prompt = [rng.randrange(1, vocab) for _ in request.prompt]
            workload.append(Request(prompt, request.max_tokens))
            pins.append(rank)
    return workload, pins


def start_cluster(cpus_per_node: int) -> Any:
    """Two simulated Ray nodes on this machine; connect the driver to them."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    node_args = {"num_cpus": cpus_per_node, "object_store_memory": 128 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args=node_args)
    cluster.add_node(**node_args)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def run_rounds(
    contenders: dict[str, Ours], base: list[Request], rounds: int, seed: int
) -> dict[str, list[RunResult]]:
    results: dict[str, list[RunResult]] = {name: [] for name in contenders}
    for round_index in range(rounds):
        for name, ours in contenders.items():
            workload, pins = replicate(base, CONTENDERS[name][0], seed + round_index)
            result = ours.run(workload, pins)
            results[name].append(result)
            print(f"round {round_index + 1}/{rounds} {name}: {result.tok_s:.0f} tok/s", flush=True)
    return results


def summarize(contenders: dict[str, Ours], results: dict[str, list[RunResult]]) -> dict:
    rows: dict[str, dict[str, Any]] = {}
    for name, runs in results.items():
        dp, strategy, nodes, exchange = CONTENDERS[name]
        tok_s = statistics.median(r.tok_s for r in runs)
        rows[name] = {
            "dp_size": dp,
            "placement_strategy": strategy,
            "nodes": nodes,
            "moe_exchange": exchange,
            "startup_s": contenders[name].startup_s,
            "tok_s": tok_s,
            "tok_s_runs": [r.tok_s for r in runs],
            "tok_s_per_rank": tok_s / dp,
            "wall_s": statistics.median(r.wall_s for r in runs),
            "ttft_p50_ms": 1e3 * percentiles([t for r in runs for t in r.ttft_s])["p50"],
            "itl_p50_ms": 1e3 * percentiles([t for r in runs for t in r.itl_s])["p50"],
        }
    base = rows["dp1"]["tok_s"]
    for row in rows.values():
        row["efficiency"] = row["tok_s_per_rank"] / base
    return rows


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    header = ("tok/s", "tok/s/rank", "efficiency", "TTFT p50", "ITL p50", "wall s", "start s")
    print(f"{'contender':<28}" + "".join(f" {h:>10}" for h in header))
    for name, row in rows.items():
        print(
            f"{name:<28} {row['tok_s']:>10.0f} {row['tok_s_per_rank']:>10.0f}"
            f" {100 * row['efficiency']:>9.0f}% {row['ttft_p50_ms']:>8.0f}ms"
            f" {row['itl_p50_ms']:>8.1f}ms {row['wall_s']:>10.2f} {row['startup_s']:>10.1f}"
        )


def plot(rows: dict[str, dict[str, Any]], path: Path, per_rank: int, threads: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    labels = [n.replace(" (oversubscribed)", "\n(oversubscribed)") for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    base = rows["dp1"]["tok_s"]
    left.bar(labels, [rows[n]["tok_s"] for n in names], color="#4c72b0", label="measured")
    left.scatter(labels, [base * rows[n]["dp_size"] for n in names], color="k", marker="_",
                 s=600, label="ideal (DP × dp1)", zorder=3)  # fmt: skip
    left.set_ylabel("requested output tokens/s")
    left.set_title(f"Weak scaling, {per_rank} requests per rank")
    left.legend(loc="upper left")
    right.bar(labels, [100 * rows[n]["efficiency"] for n in names], color="#dd8452")
    right.axhline(100, color="k", linewidth=0.8)
    right.set_ylabel("scaling efficiency vs dp1 (%)")
    right.set_title(f"{threads} thread(s) per rank, 2 physical cores; '2 nodes' = 2 raylets")
    for axis in (left, right):
        axis.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests per rank, 1 round")
    parser.add_argument("--per-rank", type=int, default=32, help="requests per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    parser.add_argument("--max-num-seqs", type=int, default=64, help="per rank")
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--out", default="bench_results/scaling.json")
    parser.add_argument("--plot", default="bench_results/scaling.png")
    args = parser.parse_args()
    if args.quick:
        args.per_rank, args.rounds = 8, 1
    return args


def main() -> None:
    args = parse_args()
    import ray

    from dist_engine.models.make_model import make_tiny_checkpoint

    base = make_workload(args.per_rank, args.seed, args.prompt_len, args.output_len)
    settings = engine_settings(
        args.max_num_seqs, args.prompt_len[1] + args.output_len[1], DEFAULT_INTERVALS
    )
    settings["threads_per_rank"] = args.threads_per_rank
    cluster = start_cluster(cpus_per_node=8)
    contenders: dict[str, Ours] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            spec = dict(BUILTIN_MODEL)
            model_dir = make_tiny_checkpoint(spec.pop("arch"), tmp, **spec)
            for name, (dp, strategy, _, exchange) in CONTENDERS.items():
                contenders[name] = Ours(
                    model_dir,
                    dp,
                    {**settings, "placement_strategy": strategy, "moe_exchange": exchange},
                )
            for name, ours in contenders.items():  # warm-up
                ours.run(*replicate(base[:2], CONTENDERS[name][0], seed=-1))
            results = run_rounds(contenders, base, args.rounds, args.seed + 1)
    finally:
        for ours in contenders.values():
            ours.close()
        ray.shutdown()
        cluster.shutdown()
    rows = summarize(contenders, results)
    tokens = sum(r.max_tokens for r in base)
    print(f"{args.per_rank} requests ({tokens} requested tokens) per rank, median of {args.rounds}")
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": vars(args), "model": BUILTIN_MODEL, "settings": settings, "rows": rows}
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")
    plot(rows, Path(args.plot), args.per_rank, args.threads_per_rank)


if __name__ == "__main__":
    main()
