"""Where a DP=1 step spends its time: bench_vs_vllm's model and workloads, split by part.

    .venv/bin/python scripts/profile_step.py [--workload decode_heavy] [--batch N] [--out ...json]

(from the repository root, with the package installed editable; not part of the test suite)

Runs `launcher.LLM(launcher="local")` with its defaults (backends `auto`) on bench_vs_vllm's
checkpoint, one untimed pass, then `--rounds` timed passes with a wall-clock timer around each
part of the step below, and prints, per regime (decode steps, prefill steps), the milliseconds
per step each part took on its own (a part's time less the time of the parts inside it):

  engine + scheduler   DPEngine.step outside the runner (schedule, vote, outputs, delivery)
  runner inputs        ModelRunner.execute outside the model (token ids, attention metadata)
  embed/rotary/norm    the model's forward outside its layers (embedding, cos/sin, final norm)
  linears              qkv and output projections and the router (Linear.forward)
  RMSNorm              every RMSNorm (the layers' and Qwen3's per-head q/k norms)
  rotary + KV write    the attention backend's rotate_and_store
  attention            the attention backend's attend
  attention rest       the attention module's own reshapes and splits
  routing              softmax top-k over the router's logits
  experts              MoELayer.forward: replica choice, dispatch, expert compute, combine
  MoE/layer rest       the MoE block's and the decoder layer's own work (residual adds)
  lm head              compute_logits on the rows that sample
  sampling             the sampler

The timers add two clock reads per call (about 50 calls per layer-step): the total with
timers is printed beside the throughput of the timed passes. vLLM runs its model in another
process; what is observable of it from outside is its time per step, wall / steps, which
bench_vs_vllm's JSON gives for both engines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vs_vllm import MAX_MODEL_LEN, ROOT, make_workload, write_model
from machine import describe, processor

PARTS = [
    "engine + scheduler",
    "runner inputs",
    "embed/rotary/norm",
    "linears",
    "RMSNorm",
    "rotary + KV write",
    "attention",
    "attention rest",
    "routing",
    "experts",
    "MoE/layer rest",
    "lm head",
    "sampling",
]


class Timers:
    """Exclusive wall time per part: a part's time less its timed children's, per regime."""

    def __init__(self) -> None:
        self.stack: list[list[Any]] = []  # [part, start, children's time]
        self.regime = "decode"
        self.totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.steps: dict[str, int] = defaultdict(int)
        self.enabled = False

    def wrap(self, owner: type, name: str, part: str) -> None:
        original = getattr(owner, name)
        timers = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not timers.enabled:
                return original(*args, **kwargs)
            frame = [part, time.perf_counter(), 0.0]
            timers.stack.append(frame)
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - frame[1]
                timers.stack.pop()
                timers.totals[timers.regime][part] += elapsed - frame[2]
                if timers.stack:
                    timers.stack[-1][2] += elapsed

        setattr(owner, name, timed)


def install(timers: Timers) -> None:
    from dist_engine.attention.native_backend import NativeAttention
    from dist_engine.attention.torch_backend import TorchAttention
    from dist_engine.engine.engine import DPEngine
    from dist_engine.engine.runner import ModelRunner
    from dist_engine.layers.attention import GQAttention
    from dist_engine.layers.linear import Linear
    from dist_engine.layers.moe import MoEBlock
    from dist_engine.layers.norm import RMSNorm
    from dist_engine.models.decoder import DecoderLayer, MoECausalLM
    from moe import routing
    from moe.layer import MoELayer

    timers.wrap(DPEngine, "step", "engine + scheduler")
    timers.wrap(ModelRunner, "_sample", "sampling")
    timers.wrap(MoECausalLM, "forward", "embed/rotary/norm")
    timers.wrap(MoECausalLM, "compute_logits", "lm head")
    timers.wrap(DecoderLayer, "forward", "MoE/layer rest")
    timers.wrap(MoEBlock, "forward", "MoE/layer rest")
    timers.wrap(GQAttention, "forward", "attention rest")
    # PerRegime holds two of the concrete backends (one per regime) and calls theirs, which
    # are timed themselves; where both regimes share one backend, it is called directly.
    for backend in (NativeAttention, TorchAttention):
        timers.wrap(backend, "rotate_and_store", "rotary + KV write")
        timers.wrap(backend, "attend", "attention")
    timers.wrap(Linear, "forward", "linears")
    timers.wrap(RMSNorm, "forward", "RMSNorm")
    timers.wrap(MoELayer, "forward", "experts")
    for method in vars(routing).values():
        if isinstance(method, type) and hasattr(method, "route"):
            timers.wrap(method, "route", "routing")

    timers.wrap(ModelRunner, "execute", "runner inputs")
    execute = ModelRunner.execute

    def execute_in_regime(self: Any, outputs: Any, requests: Any) -> Any:
        if timers.enabled and not outputs.known_empty:
            timers.regime = "prefill" if outputs.is_prefill else "decode"
            timers.steps[timers.regime] += 1
        return execute(self, outputs, requests)

    ModelRunner.execute = execute_in_regime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="decode_heavy", choices=["mixed", "decode_heavy"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--batch", type=int, default=None,
        help="only the workload's first N prompts: decode steps of at most N sequences",
    )  # fmt: skip
    parser.add_argument("--shape", default="qwen3moe", choices=["qwen3moe", "mixtral"])
    parser.add_argument("--dtype", default="float32", help="the compute dtype (`auto`, bfloat16)")
    parser.add_argument("--out", default="bench_results/profile_step.json")
    args = parser.parse_args()
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.shape == "qwen3moe" else f"_{args.shape}"
    model = str(write_model(out.parent / f"vs_vllm_model{suffix}", args.shape))

    timers = Timers()
    install(timers)
    from launcher import LLM, SamplingParams

    llm = LLM(model=model, launcher="local", max_model_len=MAX_MODEL_LEN, dtype=args.dtype)
    workload = make_workload(args.workload, args.shape)
    if args.batch is not None:
        workload = {key: values[: args.batch] for key, values in workload.items()}
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in workload["max_tokens"]]
    try:
        llm.generate(workload["prompts"], params, use_tqdm=False)  # untimed
        timers.enabled = True
        start = time.perf_counter()
        for _ in range(args.rounds):
            llm.generate(workload["prompts"], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        backends = llm.backends
    finally:
        llm.shutdown()

    tok_s = args.rounds * sum(workload["max_tokens"]) / seconds
    rows = []
    lines = [
        "| part | decode ms/step | share | prefill ms/step | share |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    sums = {r: sum(timers.totals[r].values()) for r in ("decode", "prefill")}
    for part in PARTS:
        row: dict[str, Any] = {"part": part}
        cells = [part]
        for regime in ("decode", "prefill"):
            steps = max(timers.steps[regime], 1)
            ms = 1000 * timers.totals[regime][part] / steps
            share = timers.totals[regime][part] / sums[regime] if sums[regime] else 0.0
            row[f"{regime}_ms"], row[f"{regime}_share"] = ms, share
            cells += [f"{ms:.2f}", f"{share:.0%}"]
        rows.append(row)
        lines.append("| " + " | ".join(cells) + " |")
    totals = [1000 * sums[r] / max(timers.steps[r], 1) for r in ("decode", "prefill")]
    lines.append(f"| **step** | **{totals[0]:.2f}** | | **{totals[1]:.2f}** | |")
    cpu = processor()
    print("\n".join(lines))
    print(f"\n{args.workload}: {dict(timers.steps)} steps over {args.rounds} passes, "
          f"{tok_s:,.0f} tok/s with timers; backends: {backends}")  # fmt: skip
    print(f"processor: {describe(cpu)}")
    record = {
        "command": " ".join(sys.argv),
        "processor": cpu,
        "workload": args.workload,
        "batch": args.batch,
        "shape": args.shape,
        "dtype": args.dtype,
        "rounds": args.rounds,
        "steps": dict(timers.steps),
        "tok_s_with_timers": tok_s,
        "backends": backends,
        "rows": rows,
        "step_ms": {"decode": totals[0], "prefill": totals[1]},
        "table": "\n".join(lines),
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
