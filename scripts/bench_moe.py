"""Benchmark one EP MoE layer (router + dispatch + expert compute + combine) over 2+ CPU ranks.

    .venv/bin/python scripts/bench_moe.py [--repeats 10] [--out bench_results/moe.json]

(from the repository root, with the package installed editable; `-m scripts.bench_moe` also works)

For each tokens-per-rank size every rank maps its own hidden states [T, D] to the MoE output
[T, D]; every contender starts from hidden states and includes its router (a Linear, softmax,
top-k, renormalise), because DeepSpeed's layer cannot skip its gate. Contenders over the group:
  EP normal / EP LL — `MoELayer.forward` in each dispatch mode (LL capacity C = T) with the
                      compiled SwiGLU expert kernel (`expert_backend: native`; `auto` takes it
                      only on hosts where it times fastest, see bench_backends.py), and the
                      all-to-alls through the shared-memory exchange (`parallel.moe_exchange:
                      auto` on one host, dist_engine/distributed/shm_exchange.py);
  normal gloo / LL gloo — the same with the all-to-alls on the gloo group instead
                      (`parallel.moe_exchange: process_group`, what multi-host groups use);
  normal pt         — EP normal with the experts on the PyTorch path instead
                      (`expert_backend: torch`);
  DeepSpeed         — `deepspeed.moe.layer.MoE` (`drop_tokens=False`, so capacity is the largest
                      expert count in the group: dropless), when `import deepspeed` works.
They run interleaved (one call of each per repeat, a barrier before each), so machine noise
hits all of them alike; a call's time is the slowest rank's (the layer ends in a collective).
Each rank process is pinned to its own core, as the Ray launcher pins CPU ranks by default
(`parallel.cpu_binding`; `--no-cpu-binding` leaves them to the scheduler).
Reported: the median over repeats after warm-up. Baselines, in one process afterwards, with the
same weights and one torch thread (what each EP rank has):
  1p local — MoELayer(group=None) holding all E experts, on T tokens (same FLOPs as one EP rank,
             the expert kernel as in EP normal);
  1p dense — dense_reference_moe: every expert on every token (E / K times the FLOPs).
Every contender's output is checked against dense_reference_moe on the same tokens.
Shape legend: T = tokens per rank, E = experts, K = top-k, D = hidden, I = expert intermediate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from dist_engine.distributed.cpu_binding import bind_process
from dist_engine.distributed.shm_exchange import open_shared_memory_exchange
from dist_engine.kernels import compute
from dist_engine.layers.moe import NativeExperts
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
    parser.add_argument("--timeout", type=float, default=900.0, help="whole-run limit, seconds")
    parser.add_argument(
        "--no-cpu-binding",
        dest="cpu_binding",
        action="store_false",
        help="leave the rank processes unpinned (default: each on its own core when they fit)",
    )
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


def make_hidden(args: argparse.Namespace, num_tokens: int, rank: int) -> torch.Tensor:
    """hidden [T, D], different on every rank."""
    gen = torch.Generator().manual_seed(10_000 * rank + num_tokens)
    return torch.randn(num_tokens, args.hidden, generator=gen)


def route(hidden: torch.Tensor, router: torch.Tensor, top_k: int):
    """The same gate DeepSpeed's k > 2 path computes: softmax, top-k, renormalise to sum 1."""
    routing = softmax_topk(F.linear(hidden, router), top_k, renormalize=True)
    return routing.topk_weights, routing.topk_ids


def build_layer(args, placement, rank, group, weights, capacity: int, native_experts=True):
    """Our layer with the given expert weights; native_experts: the compiled SwiGLU kernel, as
    the runtime runs float32 CPU models (dist_engine.layers.moe), else the PyTorch path."""
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
    if native_experts:
        layer.set_expert_impl(NativeExperts(compute.routed_swiglu()))
    return layer


def ours(layer: MoELayer, mode, hidden, weights, top_k: int) -> Callable[[], torch.Tensor]:
    """hidden [T, D] → [T, D] through our router and layer."""
    return lambda: layer(hidden, *route(hidden, weights["router"], top_k), mode)


def dense(hidden, weights, top_k: int) -> Callable[[], torch.Tensor]:
    expert_w = (weights["gate"], weights["up"], weights["down"])
    return lambda: dense_reference_moe(hidden, *route(hidden, weights["router"], top_k), *expert_w)


def time_once(fn: Callable[[], Any], group=None) -> float:
    """Seconds for one call; with a group, the slowest rank's (a barrier lines the ranks up)."""
    if group is not None:
        dist.barrier(group)
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def interleaved_medians(contenders: dict[str, Callable], args, group=None) -> dict[str, float]:
    """Median seconds per contender; each repeat calls every contender once, in turn."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for repeat in range(args.warmup + args.repeats):
        for name, fn in contenders.items():
            elapsed = time_once(fn, group)
            if repeat >= args.warmup:
                times[name].append(elapsed)
    return {name: statistics.median(values) for name, values in times.items()}


def max_over_ranks(value: float, group) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor)


def rank_main(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    group = dist.group.WORLD
    exchange = open_shared_memory_exchange(group, "shared_memory", timeout_s=300)
    weights = expert_weights(args)
    placement = ExpertPlacement.even(args.experts, world_size)
    deepspeed_moe, deepspeed_status = build_deepspeed(rank, world_size, args, weights)
    results: dict[str, Any] = {"ep": {}, "max_abs_err": {}, "deepspeed": deepspeed_status}
    with torch.no_grad():
        for num_tokens in args.tokens:
            # Low-latency capacity = T: the engine's tightest setting (C = max_num_seqs).
            layer = build_layer(args, placement, rank, exchange, weights, capacity=num_tokens)
            gloo_layer = build_layer(args, placement, rank, group, weights, capacity=num_tokens)
            hidden = make_hidden(args, num_tokens, rank)
            contenders = {}
            for mode in DispatchMode:
                contenders[mode.value] = ours(layer, mode, hidden, weights, args.top_k)
                contenders[f"{mode.value}_gloo"] = ours(
                    gloo_layer, mode, hidden, weights, args.top_k
                )
            torch_layer = build_layer(
                args, placement, rank, exchange, weights, num_tokens, native_experts=False
            )
            normal = DispatchMode.NORMAL
            contenders["normal_torch"] = ours(torch_layer, normal, hidden, weights, args.top_k)
            if deepspeed_moe is not None:
                contenders["deepspeed"] = lambda m=deepspeed_moe, h=hidden: m(h)[0]
            reference = dense(hidden, weights, args.top_k)()
            for name, fn in contenders.items():
                err = max_over_ranks(float((fn() - reference).abs().max()), group)
                results["max_abs_err"][name] = max(results["max_abs_err"].get(name, 0.0), err)
            for name, seconds in interleaved_medians(contenders, args, group).items():
                results["ep"][f"{name}/{num_tokens}"] = seconds
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


def build_deepspeed(rank, world_size, args, weights) -> tuple[nn.Module | None, str]:
    """DeepSpeed's MoE with our router and expert weights, or (None, why not). Never raises.

    drop_tokens=False makes DeepSpeed size every expert's buffer to the largest expert count in
    the group (an all-reduce MAX per call), so nothing is dropped; top2_2nd_expert_sampling only
    matters for k = 2 but is set off so the gate is the deterministic top-k for any k.
    """
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE
    except ImportError:
        return None, DEEPSPEED_SKIP
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
        # DeepSpeed hosts experts in contiguous blocks per rank, like ExpertPlacement.even.
        num_local = args.experts // world_size
        with torch.no_grad():
            moe.deepspeed_moe.gate.wg.weight.copy_(weights["router"])
            for local, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                logical = rank * num_local + local
                expert.gate_proj.weight.copy_(weights["gate"][logical])
                expert.up_proj.weight.copy_(weights["up"][logical])
                expert.down_proj.weight.copy_(weights["down"][logical])
        return moe, f"ok (deepspeed {deepspeed.__version__})"
    except Exception:
        return None, "skipped: deepspeed failed:\n" + traceback.format_exc()


def child(rank, world_size, port, args, queue) -> None:
    try:
        torch.set_num_threads(1)
        if args.cpu_binding:  # before the process group, so gloo's threads inherit the pin
            bind_process(rank, world_size, threads=1)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=300)
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
            hidden = make_hidden(args, num_tokens, rank=0)
            contenders = {
                "local": ours(layer, DispatchMode.NORMAL, hidden, weights, args.top_k),
                "dense": dense(hidden, weights, args.top_k),
            }
            for name, seconds in interleaved_medians(contenders, args).items():
                out[name][num_tokens] = seconds
    return out


def table_rows(args, ep: dict[str, Any], single: dict[str, dict[int, float]]) -> list[dict]:
    rows = []
    for num_tokens in args.tokens:
        normal = ep["ep"][f"normal/{num_tokens}"]
        deepspeed = ep["ep"].get(f"deepspeed/{num_tokens}")
        rows.append(
            {
                "tokens_per_rank": num_tokens,
                "ep_normal_ms": 1e3 * normal,
                "ep_normal_gloo_ms": 1e3 * ep["ep"][f"normal_gloo/{num_tokens}"],
                "ep_low_latency_ms": 1e3 * ep["ep"][f"low_latency/{num_tokens}"],
                "ep_low_latency_gloo_ms": 1e3 * ep["ep"][f"low_latency_gloo/{num_tokens}"],
                "ep_normal_torch_ms": 1e3 * ep["ep"][f"normal_torch/{num_tokens}"],
                "single_local_ms": 1e3 * single["local"][num_tokens],
                "single_dense_ms": 1e3 * single["dense"][num_tokens],
                "deepspeed_ms": None if deepspeed is None else 1e3 * deepspeed,
                "deepspeed_over_normal": None if deepspeed is None else deepspeed / normal,
                "deepspeed_over_normal_gloo": (
                    None if deepspeed is None else deepspeed / ep["ep"][f"normal_gloo/{num_tokens}"]
                ),
            }
        )
    return rows


def print_table(args, rows: list[dict], ep: dict[str, Any]) -> None:
    print(
        f"MoE layer, {args.world_size} ranks, D={args.hidden} I={args.intermediate} "
        f"E={args.experts} K={args.top_k}, median of {args.repeats} (ms), router included; "
        f"1 thread per process, ranks {'pinned' if args.cpu_binding else 'unpinned'}"
    )
    columns = (
        "T/rank", "EP normal", "normal gloo", "EP LL", "LL gloo", "normal pt", "1p local",
        "1p dense", "DeepSpeed", "DS/normal", "DS/n gloo",
    )  # fmt: skip
    print(f"{columns[0]:>7}" + "".join(f" {name:>11}" for name in columns[1:]))
    for row in rows:
        keys = (
            "ep_normal_ms", "ep_normal_gloo_ms", "ep_low_latency_ms", "ep_low_latency_gloo_ms",
            "ep_normal_torch_ms", "single_local_ms", "single_dense_ms", "deepspeed_ms",
        )  # fmt: skip
        text = ["-" if row[key] is None else f"{row[key]:.2f}" for key in keys]
        for key in ("deepspeed_over_normal", "deepspeed_over_normal_gloo"):
            text.append("-" if row[key] is None else f"{row[key]:.2f}x")
        print(f"{row['tokens_per_rank']:>7}" + "".join(f" {cell:>11}" for cell in text))
    print(
        "EP normal / EP LL / normal pt: all-to-alls through shared memory; normal gloo / LL "
        "gloo: through the gloo group"
    )
    errors = ", ".join(f"{name} {err:.2e}" for name, err in ep["max_abs_err"].items())
    print(f"max abs error vs dense_reference_moe, over all sizes and ranks: {errors}")
    print(f"DeepSpeed: {ep['deepspeed']}")


def main() -> None:
    args = parse_args()
    ep = run_ranks(args)
    single = single_process_times(args)
    rows = table_rows(args, ep, single)
    print_table(args, rows, ep)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": vars(args),
        "rows": rows,
        "max_abs_err": ep["max_abs_err"],
        "deepspeed": ep["deepspeed"],
    }
    out_path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
