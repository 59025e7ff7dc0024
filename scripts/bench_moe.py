"""Benchmark one EP MoE layer (dispatch + expert compute + combine) over a real gloo group.

    .venv/bin/python -m scripts.bench_moe [--repeats 10] [--out bench_results/moe.json]

(from the repository root; `-m` keeps the root importable without a sys.path edit)

For each tokens-per-rank size and both dispatch modes, every rank runs `MoELayer.forward` on its
own tokens; a repeat's time is the slowest rank's (the layer ends in a collective, so that is
the step's time). Reported: the median over repeats after warm-up. Baselines, in one process with
the same expert weights and as many torch threads as one EP rank has:
  local  — MoELayer(group=None) holding all E experts, on T tokens (same FLOPs as one EP rank);
  dense  — dense_reference_moe: every expert on every token (E / K times the FLOPs).
DeepSpeed's MoE layer (`drop_tokens=False`, `top2_2nd_expert_sampling=False`) runs over the same
group when `import deepspeed` works; its time includes its own gate (ours excludes routing).
Low-latency capacity C is set to T for each size (bytes sent grow with C, not with T).
Shape legend: T = tokens per rank, E = experts, K = top-k, D = hidden, I = expert intermediate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from moe import DispatchMode, ExpertPlacement, MoELayer, dense_reference_moe, softmax_topk

DEEPSPEED_SKIP = "skipped: deepspeed not installed (pip install -e '.[deepspeed]' torch==2.13.0)"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600.0, help="whole-run limit, seconds")
    parser.add_argument("--out", default="bench_results/moe.json")
    return parser.parse_args()


def expert_weights(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Same on every process: router [E, D], gate/up [E, I, D], down [E, D, I]."""
    gen = torch.Generator().manual_seed(0)
    e, d, i = args.experts, args.hidden, args.intermediate
    return {
        "router": torch.randn(e, d, generator=gen) * d**-0.5,
        "gate": torch.randn(e, i, d, generator=gen) * d**-0.5,
        "up": torch.randn(e, i, d, generator=gen) * d**-0.5,
        "down": torch.randn(e, d, i, generator=gen) * i**-0.5,
    }


def make_tokens(args: argparse.Namespace, num_tokens: int, rank: int):
    """hidden [T, D], router logits' top-k weights and ids [T, K]."""
    gen = torch.Generator().manual_seed(10_000 * rank + num_tokens)
    hidden = torch.randn(num_tokens, args.hidden, generator=gen)
    routing = softmax_topk(hidden @ expert_weights(args)["router"].t(), args.top_k, True)
    return hidden, routing.topk_weights, routing.topk_ids


def build_layer(args, placement, rank, group, weights, capacity: int) -> MoELayer:
    layer = MoELayer(
        args.experts,
        args.hidden,
        args.intermediate,
        placement,
        rank=rank,
        group=group,
        ll_max_tokens_per_rank=capacity,
    )
    for logical in placement.hosted_logical(rank):
        layer.load_expert(
            logical, weights["gate"][logical], weights["up"][logical], weights["down"][logical]
        )
    return layer


def timed(fn, args: argparse.Namespace, group=None) -> list[float]:
    """Seconds per call after warm-up; with a group, the slowest rank's time per call."""
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.repeats):
        if group is not None:
            dist.barrier(group)
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if group is not None:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        times.append(float(elapsed))
    return times


def rank_main(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    group = dist.group.WORLD
    weights = expert_weights(args)
    placement = ExpertPlacement.even(args.experts, world_size)
    results: dict[str, Any] = {"ep": {}, "max_abs_err": 0.0, "deepspeed": {}}
    with torch.no_grad():
        for mode in DispatchMode:
            for num_tokens in args.tokens:
                # Low-latency capacity = T: the engine's tightest setting (C = max_num_seqs).
                layer = build_layer(args, placement, rank, group, weights, capacity=num_tokens)
                hidden, topk_w, topk_ids = make_tokens(args, num_tokens, rank)
                out = layer(hidden, topk_w, topk_ids, mode)
                if num_tokens == args.tokens[0]:
                    ref = dense_reference_moe(
                        hidden, topk_w, topk_ids, weights["gate"], weights["up"], weights["down"]
                    )
                    err = float((out - ref).abs().max())
                    results["max_abs_err"] = max(results["max_abs_err"], err)
                times = timed(partial(layer, hidden, topk_w, topk_ids, mode), args, group)
                results["ep"][f"{mode.value}/{num_tokens}"] = statistics.median(times)
        results["deepspeed"] = deepspeed_times(rank, world_size, args, weights, group)
    return results


class SwiGLUExpert(nn.Module):
    """One expert as DeepSpeed wants it: a module it deep-copies per local expert."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def deepspeed_times(rank, world_size, args, weights, group) -> dict[str, Any]:
    """Median seconds of DeepSpeed's MoE per size, or {"skipped": reason}. Never raises."""
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE
    except ImportError:
        return {"skipped": DEEPSPEED_SKIP}
    try:
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        moe = MoE(
            hidden_size=args.hidden,
            expert=SwiGLUExpert(args.hidden, args.intermediate),
            num_experts=args.experts,
            ep_size=world_size,
            k=args.top_k,
            drop_tokens=False,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        ).eval()
        moe.set_deepspeed_parallelism()
        num_local = args.experts // world_size
        with torch.no_grad():
            moe.deepspeed_moe.gate.wg.weight.copy_(weights["router"])
            for local, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                logical = rank * num_local + local
                expert.gate_proj.weight.copy_(weights["gate"][logical])
                expert.up_proj.weight.copy_(weights["up"][logical])
                expert.down_proj.weight.copy_(weights["down"][logical])
        out = {}
        for num_tokens in args.tokens:
            hidden, _, _ = make_tokens(args, num_tokens, rank)
            times = timed(partial(moe, hidden), args, group)
            out[str(num_tokens)] = statistics.median(times)
        return out
    except Exception:
        return {"skipped": "deepspeed failed:\n" + traceback.format_exc()}


def child(rank, world_size, port, args, queue) -> None:
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
        )
        queue.put((rank, rank_main(rank, world_size, args)))
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, traceback.format_exc()))


def run_ranks(args: argparse.Namespace) -> dict[str, Any]:
    """Spawn the EP group; return rank 0's results (times are already maxed over ranks)."""
    store = dist.TCPStore("127.0.0.1", 0, args.world_size, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=child, args=(rank, args.world_size, store.port, args, queue))
        for rank in range(args.world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        reports = dict(queue.get(timeout=args.timeout) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    for rank, report in sorted(reports.items()):
        if isinstance(report, str):
            raise RuntimeError(f"rank {rank} failed:\n{report}")
    return reports[0]


def single_process_times(args: argparse.Namespace) -> dict[str, dict[int, float]]:
    torch.set_num_threads(1)  # what each EP rank has
    weights = expert_weights(args)
    placement = ExpertPlacement.even(args.experts, 1)
    layer = build_layer(args, placement, 0, None, weights, capacity=max(args.tokens))
    out: dict[str, dict[int, float]] = {"local": {}, "dense": {}}
    with torch.no_grad():
        for num_tokens in args.tokens:
            hidden, topk_w, topk_ids = make_tokens(args, num_tokens, rank=0)
            local = timed(partial(layer, hidden, topk_w, topk_ids, DispatchMode.NORMAL), args)
            expert_w = (weights["gate"], weights["up"], weights["down"])
            dense = timed(partial(dense_reference_moe, hidden, topk_w, topk_ids, *expert_w), args)
            out["local"][num_tokens] = statistics.median(local)
            out["dense"][num_tokens] = statistics.median(dense)
    return out


def main() -> None:
    args = parse_args()
    ep = run_ranks(args)
    single = single_process_times(args)
    ds = ep["deepspeed"]
    rows = []
    for num_tokens in args.tokens:
        rows.append(
            {
                "tokens_per_rank": num_tokens,
                "ep_normal_ms": 1e3 * ep["ep"][f"normal/{num_tokens}"],
                "ep_low_latency_ms": 1e3 * ep["ep"][f"low_latency/{num_tokens}"],
                "single_local_ms": 1e3 * single["local"][num_tokens],
                "single_dense_ms": 1e3 * single["dense"][num_tokens],
                "deepspeed_ms": None if "skipped" in ds else 1e3 * ds[str(num_tokens)],
            }
        )
    header = f"{'T/rank':>7} {'EP normal':>10} {'EP LL':>10} {'1p local':>10} {'1p dense':>10}"
    print(
        f"MoE layer, {args.world_size} ranks gloo, D={args.hidden} I={args.intermediate} "
        f"E={args.experts} K={args.top_k}, median of {args.repeats} (ms); 1 thread per process"
    )
    print(header + f" {'DeepSpeed':>10}")
    for row in rows:
        ds_cell = "-" if row["deepspeed_ms"] is None else f"{row['deepspeed_ms']:.2f}"
        print(
            f"{row['tokens_per_rank']:>7} {row['ep_normal_ms']:>10.2f} "
            f"{row['ep_low_latency_ms']:>10.2f} {row['single_local_ms']:>10.2f} "
            f"{row['single_dense_ms']:>10.2f} {ds_cell:>10}"
        )
    print(f"EP vs dense reference, max abs error: {ep['max_abs_err']:.2e}")
    if "skipped" in ds:
        print(f"DeepSpeed: {ds['skipped']}")
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": vars(args), "rows": rows, "max_abs_err": ep["max_abs_err"]}
    payload["deepspeed"] = ds.get("skipped", "ok")
    out_path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
