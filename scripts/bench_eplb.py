"""EPLB placement quality on synthetic DeepSeek-V3-sized load traces (no engine, no ranks).

    .venv/bin/python scripts/bench_eplb.py [--layers 4] [--out bench_results/eplb.json]

(from the repository root, with the package installed editable)

For E = 256 logical experts (V3's, in 8 groups) and L MoE layers, each trace fixes a popularity
per layer and draws token-expert pairs from it, step after step:
  zipf-S — the expert of popularity rank r gets ~ 1 / r**S (S in 0.5 .. 1.5), ranks shuffled
           per layer: router skew;
  hot    — every expert near the mean except a handful at several times it, as DeepSeek-V3's
           correction bias leaves a few experts hot.
A window of W steps is summed (what `moe.ExpertLoadWindow` holds), `moe.rebalance` places the
experts from it, and the placement is scored by `moe.balancedness` (mean / max tokens per rank)
on that window ("fit") and on the next W steps, drawn afresh ("next": what the engine would
see after moving). "before" is the even placement (`ExpertPlacement.even`, no redundancy).
Sweeps N = 64 and 256 ranks, the global policy and the hierarchical one on the node counts
where it applies (num_nodes divides the 8 groups), and eplb_num_redundant_experts in
{0, 32, 64, 128, 256} where E + redundant is a multiple of N. Time: median wall time of one
`rebalance` call for all L layers, one torch thread, on this machine's processor (printed).
A pair's k choices are drawn independently (not forced distinct): only the counts matter here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from moe import ExpertPlacement, balancedness, rebalance
from moe.eplb import HIERARCHICAL

NUM_EXPERTS = 256
NUM_GROUPS = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="MoE layers L")
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--redundant", type=int, nargs="+", default=[0, 32, 64, 128, 256])
    parser.add_argument("--zipf", type=float, nargs="+", default=[0.5, 1.0, 1.5])
    parser.add_argument("--hot-experts", type=int, default=6, help="experts the bias makes hot")
    parser.add_argument("--hot-factor", type=float, default=5.0, help="their load / the mean")
    parser.add_argument("--window-steps", type=int, default=32)
    parser.add_argument("--tokens-per-step", type=int, default=2048, help="whole group's")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timed rebalance calls")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_results/eplb.json")
    parser.add_argument("--plot", default="bench_results/eplb.png", help="if matplotlib is here")
    return parser.parse_args()


def popularities(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """trace name → [L, E] probabilities an expert is chosen, per layer."""
    gen = torch.Generator().manual_seed(args.seed)
    ranks = torch.arange(1, NUM_EXPERTS + 1, dtype=torch.float64)
    traces = {}
    for exponent in args.zipf:
        base = 1.0 / ranks**exponent
        shuffled = [base[torch.randperm(NUM_EXPERTS, generator=gen)] for _ in range(args.layers)]
        traces[f"zipf-{exponent:g}"] = torch.stack(shuffled)
    hot = []
    for _ in range(args.layers):
        weight = 1.0 + 0.2 * torch.rand(NUM_EXPERTS, generator=gen, dtype=torch.float64)
        chosen = torch.randperm(NUM_EXPERTS, generator=gen)[: args.hot_experts]
        weight[chosen] = args.hot_factor * weight.mean()
        hot.append(weight)
    traces[f"hot-{args.hot_experts}x{args.hot_factor:g}"] = torch.stack(hot)
    return {name: p / p.sum(dim=1, keepdim=True) for name, p in traces.items()}


def draw_window(popularity: torch.Tensor, args: argparse.Namespace, gen) -> torch.Tensor:
    """[L, E] int64 pairs per expert over one window of W steps."""
    num_pairs = args.window_steps * args.tokens_per_step * args.top_k
    rows = [
        torch.bincount(
            torch.multinomial(layer, num_pairs, replacement=True, generator=gen),
            minlength=NUM_EXPERTS,
        )
        for layer in popularity
    ]
    return torch.stack(rows)


def policies(args: argparse.Namespace, num_ranks: int) -> list[tuple[str, int]]:
    """(label, num_nodes) per distinct policy: global once, hierarchical per node count."""
    out = [("global", 1)]
    for nodes in args.nodes:
        if num_ranks % nodes == 0 and NUM_GROUPS % nodes == 0:
            out.append((f"hier/{nodes} nodes", nodes))
    return out


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mean_balancedness(load: torch.Tensor, placements: list[ExpertPlacement]) -> float:
    return statistics.fmean(balancedness(load[i], p) for i, p in enumerate(placements))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    rows = []
    for trace, popularity in popularities(args).items():
        fit, following = draw_window(popularity, args, gen), draw_window(popularity, args, gen)
        for num_ranks in args.ranks:
            even = [ExpertPlacement.even(NUM_EXPERTS, num_ranks)] * args.layers
            before = mean_balancedness(fit, even)
            for label, nodes in policies(args, num_ranks):
                for redundant in args.redundant:
                    num_physical = NUM_EXPERTS + redundant
                    if num_physical % num_ranks:
                        continue
                    place = partial(rebalance, fit, num_physical, NUM_GROUPS, nodes, num_ranks)
                    result = place()
                    seconds = median_seconds(place, args.repeats)
                    placements = [result.placement(i) for i in range(args.layers)]
                    after = [balancedness(fit[i], p) for i, p in enumerate(placements)]
                    rows.append(
                        {
                            "trace": trace,
                            "ranks": num_ranks,
                            "policy": label,
                            "nodes": nodes,
                            "hierarchical": result.policy == HIERARCHICAL,
                            "redundant": redundant,
                            "physical": num_physical,
                            "balancedness_before": before,
                            "balancedness_fit": statistics.fmean(after),
                            "balancedness_fit_worst_layer": min(after),
                            "balancedness_next": mean_balancedness(following, placements),
                            "max_over_mean_before": 1.0 / before,
                            "max_over_mean_fit": statistics.fmean(1.0 / b for b in after),
                            "rebalance_ms": 1e3 * seconds,
                        }
                    )
    return rows


def print_table(args: argparse.Namespace, rows: list[dict[str, Any]], cpu: dict) -> None:
    print(
        f"EPLB placement quality: E={NUM_EXPERTS} in {NUM_GROUPS} groups, L={args.layers}, "
        f"window {args.window_steps} steps x {args.tokens_per_step} tokens x top-{args.top_k}; "
        f"balancedness = mean / max tokens per rank, mean over layers"
    )
    print(
        "| trace | N | policy | redundant | before | fit | fit, worst layer | next window "
        "| max/mean before → fit | rebalance ms |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['trace']} | {row['ranks']} | {row['policy']} | {row['redundant']} "
            f"| {row['balancedness_before']:.3f} | {row['balancedness_fit']:.3f} "
            f"| {row['balancedness_fit_worst_layer']:.3f} | {row['balancedness_next']:.3f} "
            f"| {row['max_over_mean_before']:.2f} → {row['max_over_mean_fit']:.2f} "
            f"| {row['rebalance_ms']:.1f} |"
        )
    skipped = [
        nodes
        for nodes in args.nodes
        if NUM_GROUPS % nodes != 0 or any(n % nodes for n in args.ranks)
    ]
    if skipped:
        print(
            f"nodes {skipped}: hierarchical does not apply ({NUM_GROUPS} groups not divisible, "
            f"or ranks not divisible), so rebalance() takes the global policy shown"
        )
    print(
        f"processor: {cpu['model']}, AVX-512 {','.join(cpu['avx512']) or 'none'}; "
        f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}"
    )


def processor() -> dict[str, Any]:
    model, flags = platform.processor(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    avx512 = sorted(flag for flag in flags if flag.startswith("avx512"))
    return {"model": model, "cores": os.cpu_count(), "avx2": "avx2" in flags, "avx512": avx512}


def plot(rows: list[dict[str, Any]], path: Path) -> str:
    """Balancedness (next window) against redundant experts, one panel per trace."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib not installed (pip install -e '.[bench]' torch==2.13.0)"
    traces = sorted({row["trace"] for row in rows})
    figure, axes = plt.subplots(1, len(traces), figsize=(4 * len(traces), 3.5), sharey=True)
    for axis, trace in zip(figure.axes if len(traces) > 1 else [axes], traces, strict=True):
        series = sorted({(row["ranks"], row["policy"]) for row in rows if row["trace"] == trace})
        for ranks, label in series:
            points = [
                r for r in rows if (r["trace"], r["ranks"], r["policy"]) == (trace, ranks, label)
            ]
            xs = [r["redundant"] for r in points]
            ys = [r["balancedness_next"] for r in points]
            axis.plot(xs, ys, marker="o", label=f"N={ranks} {label}")
        axis.set_title(trace)
        axis.set_xlabel("redundant experts")
        axis.set_ylim(0, 1.05)
    figure.axes[0].set_ylabel("balancedness (next window)")
    figure.axes[-1].legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return f"wrote {path}"


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # a rank rebalances on its own core; also keeps timings stable
    load_before = os.getloadavg()[0]
    rows = run(args)
    cpu = processor()
    print_table(args, rows, cpu)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.platform(),
        "processor": cpu,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_range": [load_before, os.getloadavg()[0]],
        "args": vars(args),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")
    print(plot(rows, Path(args.plot)))


if __name__ == "__main__":
    main()
