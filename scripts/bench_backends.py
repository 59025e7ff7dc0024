"""The backend table: what `auto` timed on this host, what it chose, and whether the choice
holds end to end against every fixed choice.

    .venv/bin/python scripts/bench_backends.py [--rounds 5] [--out bench_results/backends.json]

(from the repository root, with the package installed editable)

The model and workload of scripts/bench_vs_vllm.py (its random Qwen3-MoE, the `mixed`
workload), one rank (`launcher="local"`, the process's torch threads), each setting an engine
in a worker process of its own. Two parts:

1. The start-up timings: a fresh engine with every backend `auto` times each candidate per
   regime on its shapes (dist_engine/autotune.py) and logs them; the table lists each
   candidate's median time per op and regime, and the choice. The decision cache is
   bypassed (a private cache directory), so this is a fresh measurement.
2. End to end: engines with fixed backends (every op `native`, every op `torch`, the experts
   on `grouped_mm` with the rest `native`) and the `auto` engine run the workload in turn, the
   order rotated per round; output tok/s per round, median and range. `auto` should be within
   5% of the best fixed setting.
Greedy token ids must be the same for every setting (they are compared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vs_vllm import Worker, make_workload, run_phase, write_model
from machine import describe, processor

SETTINGS = {
    "auto": {},
    "native": {"attention_backend": "native", "expert_backend": "native", "norm_backend": "native"},
    "torch": {"attention_backend": "torch", "expert_backend": "torch", "norm_backend": "torch"},
    "experts grouped_mm": {
        "attention_backend": "native",
        "expert_backend": "grouped_mm",
        "norm_backend": "native",
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--out", default="bench_results/backends.json")
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    out = root / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    model = str(write_model(out.parent / "vs_vllm_model"))

    # A private decision cache: the timings below are measured now, not read back.
    cache = tempfile.mkdtemp(prefix="lockstep-backends-")
    env = {**os.environ, "LOCKSTEP_CACHE": cache, "LOCKSTEP_AUTOTUNE": "1"}
    from dist_engine.kernels import compute

    compute.prepare()  # built into the usual cache; the workers' private cache builds again
    workload = make_workload(args.workload)
    me = str(Path(__file__).resolve().parent / "bench_vs_vllm.py")
    workers: dict[str, Worker] = {}
    runs: dict[str, list[float]] = {}
    tokens: dict[str, list[list[int]]] = {}
    loads: list[float] = []
    try:
        # One process per setting (each engine its own OpenMP pool), started one at a time.
        for name, settings in SETTINGS.items():
            argv = [sys.executable, me, "--worker", "lockstep", "--dp", "1", "--model", model,
                    "--settings", json.dumps(settings)]  # fmt: skip
            workers[name] = Worker(name, argv, env)
            print(f"{name:20s} {workers[name].settings['backends']}", flush=True)
        decisions = json.loads(next(Path(cache).rglob("autotune/*.json")).read_text())
        collected: list[dict] = []
        run_phase(workers, {args.workload: workload}, args.rounds, collected)
        for run in collected:
            runs.setdefault(run["contender"], []).append(run["tok_s"])
            tokens.setdefault(run["contender"], run["tokens"])
            loads += [run["load_before"], run["load_after"]]
    finally:
        for worker in workers.values():
            worker.close()
    backends = {name: worker.settings["backends"] for name, worker in workers.items()}
    report(args, decisions, runs, tokens, backends, loads)


def report(args, decisions, runs, tokens, backends, loads) -> None:
    timing_lines = [
        "| op | regime | candidate (ms per call) | auto's choice |",
        "| --- | --- | --- | --- |",
    ]
    for decision in decisions["timings_ms"]:
        times = ", ".join(f"{k} {v:.3f}" for k, v in decision["timings_ms"].items())
        timing_lines.append(
            f"| {decision['op']} | {decision['regime']} | {times} | {decision['choice']} |"
        )
    medians = {name: statistics.median(rates) for name, rates in runs.items()}
    best_fixed = max((n for n in medians if n != "auto"), key=medians.get)
    e2e_lines = ["| setting | backends | tok/s median (range) |", "| --- | --- | ---: |"]
    for name, rates in runs.items():
        e2e_lines.append(
            f"| {name} | {backends[name]} | {medians[name]:,.0f} "
            f"({min(rates):,.0f}-{max(rates):,.0f}) |"
        )
    same = all(tokens[name] == tokens["torch"] for name in tokens)
    ratio = medians["auto"] / medians[best_fixed]
    verdict = (
        f"auto / best fixed ({best_fixed}) = {ratio:.3f} (goal >= 0.95); "
        f"greedy tokens identical across settings: {same}"
    )
    cpu = processor()
    print("\n" + "\n".join(timing_lines) + "\n\n" + "\n".join(e2e_lines) + "\n\n" + verdict)
    print(f"processor: {describe(cpu)}; "
          f"load average {min(loads):.2f}-{max(loads):.2f}")  # fmt: skip
    record = {
        "command": " ".join(sys.argv),
        "processor": cpu,
        "load_average_range": [min(loads), max(loads)],
        "threads": decisions.get("threads"),
        "decisions": decisions,
        "end_to_end_tok_s": runs,
        "backends": backends,
        "auto_over_best_fixed": ratio,
        "best_fixed": best_fixed,
        "same_tokens": same,
        "tables": "\n".join(timing_lines) + "\n\n" + "\n".join(e2e_lines),
    }
    (Path(__file__).resolve().parents[1] / args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
