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

    .venv/bin/python scripts/bench_eplb.py --live [--dp 2 4] [--sources checkpoint peer] [--fp8]
        [--live-out bench_results/eplb_live.json]

The live part: a DP group of real ranks (spawned processes, gloo, one torch thread each) serves
the same greedy requests on a skewed DeepSeek-V3-shaped checkpoint (its selection bias raised
for a few experts, so they are chosen by most tokens; --fp8: a block-FP8 release, as
DeepSeek's): once without EPLB, then with it once per expert source (`moe.eplb_expert_source`:
new experts read from the checkpoint, or sent by a peer that holds them; decisions every
--interval forward steps over a window of as many; one redundant slot per rank). It reports
the rates the group measured as it formed (one expert from a peer and from the checkpoint,
the slowest rank's: what "auto" chooses by), and for each run balancedness as the engine
measures it (the first decision's window under the starting placement, the prediction for
the new one on that window, and the last window measured), the slowest rank's expert CPU
time per decode step before and after the first rebalance (`run_local_experts`, thread CPU
time, so ranks sharing cores do not count each other's time), the rebalance's cost (time
the steps paused, background staging: the slowest rank's, bytes moved, of them bytes peers
sent), and whether every request's tokens are the same with and without EPLB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from machine import describe, processor

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
    live = parser.add_argument_group("live (--live)")
    live.add_argument("--live", action="store_true", help="run the engine part instead")
    live.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    live.add_argument("--requests-per-rank", type=int, default=48)
    live.add_argument("--max-tokens", type=int, default=48)
    live.add_argument("--interval", type=int, default=16, help="eplb_interval_steps = window")
    live.add_argument(
        "--sources",
        nargs="+",
        default=["checkpoint", "peer"],
        choices=["checkpoint", "peer"],
        help="moe.eplb_expert_source per run",
    )
    live.add_argument("--fp8", action="store_true", help="a block-FP8 checkpoint")
    live.add_argument("--live-out", default="bench_results/eplb_live.json")
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
        f"processor: {describe(cpu)}; "
        f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}"
    )


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


# -- the live part -------------------------------------------------------------------------------
# DeepSeek-V3's shape, small: 16 experts in 4 groups (a token reaches 2), top-4, 3 MoE layers.
LIVE_MODEL = dict(
    vocab_size=512,
    hidden_size=512,
    num_heads=4,
    num_experts=16,
    top_k=4,
    moe_intermediate_size=1024,
    intermediate_size=1024,
    num_layers=4,
    n_group=4,
    topk_group=2,
)
# Expert -> raised selection bias: groups 0 and 1 (experts 0-7) win most tokens, and the
# starting placement keeps those experts on the first ranks.
HOT_BIAS = {2: 0.3, 5: 0.3, 6: 0.15}
LIVE_TIMEOUT_S = 60.0


def make_skewed_checkpoint(out: Path, fp8: bool = False) -> Path:
    """The live part's checkpoint: random weights, the bias of HOT_BIAS's experts raised."""
    from safetensors.torch import load_file, save_file

    from dist_engine.models.make_model import make_tiny_checkpoint

    make_tiny_checkpoint("deepseek_v3", out, seed=3, fp8=fp8, **LIVE_MODEL)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
            for expert, boost in HOT_BIAS.items():
                tensors[name][expert] += boost
        save_file(tensors, path, metadata={"format": "pt"})
    return out


def _live_config(model_dir: str, world: int, args: argparse.Namespace, source: str | None):
    """source: the EPLB run's `moe.eplb_expert_source`; None: EPLB off."""
    from dist_engine.engine.config import EngineConfig

    settings = {
        "enable_eplb": True,
        "eplb_num_redundant_experts": world,
        "eplb_window_steps": args.interval,
        "eplb_interval_steps": args.interval,
        "eplb_expert_source": source,
    }
    return EngineConfig.from_dict(
        {
            "model": model_dir,
            "dtype": "float32",
            "expert_backend": "torch",  # the same expert path on every rank and run
            "parallel": {"dp_size": world, "launcher": "local", "backend": "gloo"},
            "scheduler": {
                "max_num_seqs": args.requests_per_rank,
                "max_num_batched_tokens": 1024,
                "max_model_len": 256,
                "block_size": 16,
                "num_blocks": 512,
            },
            "moe": settings if source is not None else {},
        }
    )


class _ExpertClock:
    """Thread CPU time inside `run_local_experts`, per step of one engine (bench only)."""

    seconds = 0.0  # inside the expert compute since the step began
    patched = False

    def __init__(self, engine: Any) -> None:
        import moe.layer

        self.per_step: dict[int, float] = {}
        if not _ExpertClock.patched:  # once per process: every engine's layers call it
            experts = moe.layer.run_local_experts

            def timed_experts(*a: Any, **k: Any) -> Any:
                start = time.thread_time()
                try:
                    return experts(*a, **k)
                finally:
                    _ExpertClock.seconds += time.thread_time() - start

            moe.layer.run_local_experts = timed_experts
            _ExpertClock.patched = True
        execute = engine.runner.execute

        def timed_execute(outputs: Any, requests: Any) -> Any:
            _ExpertClock.seconds = 0.0
            result = execute(outputs, requests)
            self.per_step[outputs.step_index] = _ExpertClock.seconds
            return result

        engine.runner.execute = timed_execute


def _live_rank(rank: int, world: int, model_dir: str, args: argparse.Namespace) -> list[dict]:
    """One rank: the workload without EPLB, then with it per source (a fresh engine and
    model each)."""
    import torch.distributed as dist

    from dist_engine.distributed.groups import init_distributed
    from dist_engine.distributed.spawn import current_store
    from dist_engine.engine.engine import DPEngine
    from scheduler import SamplingParams

    ctx = init_distributed(rank, world, current_store(), backend="gloo", timeout_s=LIVE_TIMEOUT_S)
    rng = random.Random(rank)
    prompts = [
        [rng.randrange(1, LIVE_MODEL["vocab_size"]) for _ in range(rng.randint(16, 48))]
        for _ in range(args.requests_per_rank)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    runs = []
    for job, source in enumerate((None, *args.sources)):
        finals: dict[str, Any] = {}
        done = threading.Event()

        def collect(output: Any, finals: dict = finals, done: threading.Event = done) -> None:
            if output.finished:
                finals[output.request_id] = output
                if len(finals) == len(prompts):
                    done.set()

        engine = DPEngine(_live_config(model_dir, world, args, source), ctx, on_output=collect)
        clock = _ExpertClock(engine)
        thread = threading.Thread(target=engine.run, daemon=True)
        thread.start()
        for i, prompt in enumerate(prompts):
            engine.submit(f"r{rank}-{i}", prompt, params)
        if not done.wait(600):
            raise TimeoutError(f"rank {rank}: requests never ended")
        store = dist.TCPStore(ctx.store.host, ctx.store.port, is_master=False)
        keys = [f"bench_eplb/{job}/done/{r}" for r in range(world)]
        store.set(keys[rank], b"1")
        if rank == 0:
            while not store.check(keys):
                time.sleep(0.01)
            engine.shutdown()
        thread.join(LIVE_TIMEOUT_S)
        runs.append(
            {
                "tokens": {rid: out.output_token_ids for rid, out in finals.items()},
                "trace": [(t.step, t.kind.value, t.num_seqs, t.eplb) for t in engine.trace],
                "expert_s": clock.per_step,
                "stats": engine.stats().experts,
            }
        )
    return runs


def run_live(args: argparse.Namespace, world: int, model_dir: str) -> list[dict[str, Any]]:
    from dist_engine.distributed.spawn import run_multirank

    per_rank = run_multirank(
        world, _live_rank, (model_dir, args), timeout_s=1800, group_timeout_s=LIVE_TIMEOUT_S,
        num_threads=1,
    )  # fmt: skip
    off = [ranks[0] for ranks in per_rank]
    return [
        _live_row(args, world, source, off, [ranks[job] for ranks in per_rank])
        for job, source in enumerate(args.sources, start=1)
    ]


def _live_row(
    args: argparse.Namespace, world: int, source: str, off: list[dict], on: list[dict]
) -> dict[str, Any]:
    trace = on[0]["trace"]
    adopted = [step for step, _, _, event in trace if event == "adopted"]
    first = adopted[0] if adopted else None
    decode = _full_decode_steps(on, args.requests_per_rank)

    def slowest(steps: list[int], runs: list[dict]) -> float:
        return statistics.fmean(max(r["expert_s"][s] for r in runs) for s in steps)

    def mean_rank(steps: list[int], runs: list[dict]) -> float:
        return statistics.fmean(statistics.fmean(r["expert_s"][s] for r in runs) for s in steps)

    before = [s for s in decode if first is None or s < first]
    after = [s for s in decode if first is not None and s > first]
    off_decode = _full_decode_steps(off, args.requests_per_rank)
    stats = [r["stats"] for r in on]
    group = stats[0]
    return {
        "dp": world,
        "source": source,
        "num_rebalances": group.num_rebalances,
        "num_skipped": group.num_skipped,
        "first_adopted_step": first,
        "balancedness_last_before": statistics.fmean(group.last_balancedness_before or [1.0]),
        "balancedness_last_predicted": statistics.fmean(group.last_balancedness_after or [1.0]),
        "balancedness_last_window": statistics.fmean(group.balancedness or [1.0]),
        "slowest_expert_ms_before": 1e3 * slowest(before, on) if before else None,
        "slowest_expert_ms_after": 1e3 * slowest(after, on) if after else None,
        "mean_expert_ms_before": 1e3 * mean_rank(before, on) if before else None,
        "mean_expert_ms_after": 1e3 * mean_rank(after, on) if after else None,
        "slowest_expert_ms_without_eplb": 1e3 * slowest(off_decode, off),
        "num_decode_steps": [len(before), len(after)],
        "pause_ms": 1e3 * max(s.last_pause_s for s in stats),
        "staging_ms": 1e3 * max(s.last_staging_s for s in stats),
        "bytes_moved": sum(s.last_bytes for s in stats),
        "bytes_from_peers": sum(s.last_received_bytes for s in stats),
        # Measured as the group formed (only where a peer group exists: the peer runs).
        "probe_peer_mb_s": group.peer_bytes_per_s / 1e6,
        "probe_checkpoint_mb_s": group.checkpoint_bytes_per_s / 1e6,
        "tokens_unchanged": all(a["tokens"] == b["tokens"] for a, b in zip(off, on, strict=True)),
    }


def _full_decode_steps(runs: list[dict], batch: int) -> list[int]:
    """Decode steps in which every rank ran its whole batch (steps agree across ranks)."""
    seqs = [{step: n for step, _, n, _ in run["trace"]} for run in runs]
    return [
        step
        for step, kind, _, _ in runs[0]["trace"]
        if kind == "decode" and all(counts.get(step) == batch for counts in seqs)
    ]


def print_live(rows: list[dict[str, Any]], cpu: dict, fp8: bool) -> None:
    print(
        f"EPLB live: DeepSeek-V3-shaped ({'block-FP8' if fp8 else 'float32'} checkpoint, "
        f"served in float32), {LIVE_MODEL['num_experts']} experts top-"
        f"{LIVE_MODEL['top_k']}, 3 MoE layers, biased experts {sorted(HOT_BIAS)}; one redundant "
        f"slot per rank; balancedness = mean / max tokens per rank (mean over layers); expert "
        f"time = the slowest rank's CPU time in the expert compute per full decode step"
    )
    print(
        "| DP | experts from | rebalances (skipped) | balancedness before → predicted "
        "| last window | slowest rank expert ms/step: no EPLB, before → after | pause ms "
        "| staging ms | MiB moved (from peers) | tokens unchanged |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        print(
            f"| {row['dp']} | {row['source']} | {row['num_rebalances']} ({row['num_skipped']}) "
            f"| {row['balancedness_last_before']:.3f} → {row['balancedness_last_predicted']:.3f} "
            f"| {row['balancedness_last_window']:.3f} "
            f"| {row['slowest_expert_ms_without_eplb']:.2f}: "
            f"{_ms(row['slowest_expert_ms_before'])} → {_ms(row['slowest_expert_ms_after'])} "
            f"| {row['pause_ms']:.1f} | {row['staging_ms']:.1f} "
            f"| {row['bytes_moved'] / 2**20:.1f} ({row['bytes_from_peers'] / 2**20:.1f}) "
            f"| {row['tokens_unchanged']} |"
        )
    for row in rows:
        if row["probe_peer_mb_s"]:
            peer, checkpoint = row["probe_peer_mb_s"], row["probe_checkpoint_mb_s"]
            auto = "peer" if peer > checkpoint else "checkpoint"
            print(
                f"DP={row['dp']}: one expert at start-up, slowest rank: {peer:.0f} "
                f"MB/s from a peer, {checkpoint:.0f} MB/s from the checkpoint "
                f"(eplb_expert_source=auto takes the {auto})"
            )
    print(
        f"processor: {describe(cpu)}; one torch "
        f"thread per rank; load average {os.getloadavg()[0]:.2f}"
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main_live(args: argparse.Namespace) -> None:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_skewed_checkpoint(Path(tmp) / "deepseek-v3-skewed", args.fp8))
        rows = [row for world in args.dp for row in run_live(args, world, model_dir)]
    cpu = processor()
    print_live(rows, cpu, args.fp8)
    out = Path(args.live_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.platform(),
        "processor": cpu,
        "torch": torch.__version__,
        "load_average_range": [load_before, os.getloadavg()[0]],
        "args": vars(args),
        "model": LIVE_MODEL,
        "hot_bias": HOT_BIAS,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


def main() -> None:
    args = parse_args()
    if args.live:
        main_live(args)
        return
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
