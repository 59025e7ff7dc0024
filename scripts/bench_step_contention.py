"""How much a DP=1 engine's steps slow down when something else wants a share of the cores.

    .venv/bin/python scripts/bench_step_contention.py [--dtype bfloat16] [--threads 1 2]
        [--loads 0 0.3 0.6] [--served] [--rounds 3] [--out bench_results/step_contention.json]

(from the repository root, with the package installed editable; not part of the test suite)

Served, an engine shares the host's cores with its HTTP server and, under `vllm bench serve`
on the same machine, with the client, and shares its own process's interpreter lock with the
server's event loop (docs/benchmark_notes.md, "Where a served step's time goes"). This separates
the two. `LLM(launcher="local")` on the built-in tiny Qwen3-MoE runs `vllm bench serve`'s
rate-inf workload (64 prompts of 128 tokens, 64 output tokens each, all at once) offline while
another process spins for `load` of every 2 ms and sleeps the rest, for each `--loads` value:
the cores' share alone. With `--served`, one more case per round: the same engine behind
`lockstep serve`'s HTTP server (in the worker's process, as `lockstep serve --launcher local`
runs it), driven by `vllm bench serve --backend openai --request-rate inf` with that workload:
both. One worker process per `--threads` value (the
engine's torch threads), kept alive and taking turns with the others, the cases in rotating
order within a round. Reported from `DPEngine.trace`: the time the run's steps took (the engine
is busy from the first step to the last in every case) and the median decode step, median
[range] over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe, processor

ROOT = Path(__file__).resolve().parent.parent
SPIN_PERIOD_S = 0.002


def spin(load: float) -> None:
    """Busy for `load` of every period, asleep for the rest, until killed."""
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < SPIN_PERIOD_S * load:
            pass
        time.sleep(SPIN_PERIOD_S * (1 - load))


def served_client(llm: Any) -> Any:
    """Start the HTTP server on `llm`'s engine (its own event loop thread) and return a function
    that runs `vllm bench serve` against it once (warmed up once here)."""
    import asyncio
    import threading

    from bench_vs_vllm import ensure_vllm_venv

    from launcher.server.app import LockstepServer
    from launcher.server.config import ServerConfig

    server = LockstepServer(llm.client, llm.config, ServerConfig(port=0, served_model_name="tiny"))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    port = asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
    command = [
        str(ensure_vllm_venv()), str(ROOT / "scripts" / "vllm_cli.py"), "bench", "serve",
        "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", "/v1/completions", "--model", "tiny", "--tokenizer", llm.config.model,
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64",
        "--num-prompts", "64", "--request-rate", "inf", "--ignore-eos", "--seed", "0",
    ]  # fmt: skip

    def run() -> None:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or "Successful requests:                     64" not in done.stdout:
            raise RuntimeError(f"vllm bench serve failed:\n{(done.stdout + done.stderr)[-2000:]}")

    run()
    return run


def worker(threads: int, dtype: str, served: bool, settings: dict[str, Any]) -> None:
    """Build the engine, then answer one JSON line per load asked on stdin."""
    sys.path.insert(0, str(ROOT))
    from launcher import LLM, SamplingParams
    from launcher.builtin import BUILTIN_MODEL, builtin_model
    from scheduler.outputs import StepKind

    llm = LLM(
        model=str(builtin_model()), launcher="local", dtype=dtype, max_model_len=1024,
        threads_per_rank=threads, **settings,
    )  # fmt: skip
    engine = llm.client.host.engine
    rng = random.Random(0)
    vocab = BUILTIN_MODEL["vocab_size"]
    prompts = [[rng.randrange(10, vocab) for _ in range(128)] for _ in range(64)]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    serve = served_client(llm) if served else None  # warmed up there
    if not served:
        llm.generate(prompts, params, use_tqdm=False)  # untimed: lazy set-up
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            load = json.loads(line)["load"]
            hog = None
            if isinstance(load, float) and load > 0:
                hog = subprocess.Popen([sys.executable, __file__, "--spin", str(load)])
                time.sleep(0.2)
            try:
                engine.trace.clear()
                start = time.perf_counter()
                if load == "served":
                    serve()
                else:
                    llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - start
                steps = list(engine.trace)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            decode = [s.step_s for s in steps if s.kind is StepKind.DECODE and s.num_seqs]
            prefill = [s.step_s for s in steps if s.kind is StepKind.PREFILL and s.num_seqs]
            reply = {
                "wall_s": wall,  # served: with the client's start-up
                "steps_s": sum(decode) + sum(prefill),
                "decode_steps": len(decode),
                "decode_step_ms": 1000 * statistics.median(decode),
                "prefill_steps": len(prefill),
                "prefill_s": sum(prefill),
            }
            print(json.dumps(reply), flush=True)
    finally:
        llm.shutdown()


def settings(items: list[str]) -> list[tuple[str, Any]]:
    """KEY=VALUE pairs, each value read as JSON where it parses (numbers, true), else a string."""
    pairs = []
    for item in items:
        key, _, value = item.partition("=")
        try:
            pairs.append((key, json.loads(value)))
        except json.JSONDecodeError:
            pairs.append((key, value))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--loads", type=float, nargs="+", default=[0.0, 0.3, 0.6])
    parser.add_argument("--served", action="store_true", help="also behind the HTTP server")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="an engine setting for every worker, e.g. mixed_prompt_tokens=1024 (repeatable)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench_results/step_contention.json")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spin", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.spin is not None:
        spin(args.spin)
        return
    if args.worker is not None:
        worker(args.worker, args.dtype, args.served, dict(settings(args.set)))
        return

    # One worker per (threads, served): a server takes every output of its engine, so the
    # offline runs need an engine of their own.
    workers = {}
    for threads in args.threads:
        for served in [False, True] if args.served else [False]:
            command = [sys.executable, __file__, "--worker", str(threads), "--dtype", args.dtype]
            command += ["--served"] if served else []
            command += [f"--set={item}" for item in args.set]
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, cwd=ROOT)  # fmt: skip
            while not process.stdout.readline().startswith('{"ready"'):
                if process.poll() is not None:
                    raise RuntimeError(f"the worker of {threads} thread(s) exited")
            workers[threads, served] = process
    loads = [os.getloadavg()[0]]
    cases: list[float | str] = [*args.loads, *(["served"] if args.served else [])]
    runs: dict[tuple[int, float | str], list[dict[str, Any]]] = {}
    for round_index in range(args.rounds):
        shift = round_index % len(cases)
        order = cases[shift:] + cases[:shift]
        for threads in args.threads:
            for load in order:
                process = workers[threads, load == "served"]
                process.stdin.write(json.dumps({"load": load}) + "\n")
                process.stdin.flush()
                runs.setdefault((threads, load), []).append(json.loads(process.stdout.readline()))
        loads.append(os.getloadavg()[0])
    for process in workers.values():
        process.stdin.close()
        process.wait()

    def other(load: float | str) -> str:
        return "served: server + client" if load == "served" else f"spin {load:.0%} of a core"

    def cell(values: list[float], fmt: str) -> str:
        return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}-" \
               f"{format(max(values), fmt)}]"  # fmt: skip

    lines = [
        "| engine threads | other load | steps s | decode step ms (median) | prefill steps, s |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    rows = []
    for (threads, load), results in sorted(runs.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        walls = [r["steps_s"] for r in results]
        steps = [r["decode_step_ms"] for r in results]
        prefill = [r["prefill_s"] for r in results]
        lines.append(
            f"| {threads} | {other(load)} | {cell(walls, '.2f')} | {cell(steps, '.1f')} | "
            f"{results[0]['prefill_steps']}, {cell(prefill, '.2f')} |"
        )
        rows.append({"threads": threads, "load": load, "runs": results})
    cpu = processor()
    print("\n".join(lines))
    given = dict(settings(args.set)) or "defaults"
    print(f"\ndtype {args.dtype}; settings {given}; {args.rounds} rounds; load average "
          f"{min(loads):.2f}-{max(loads):.2f}; processor: {describe(cpu)}")  # fmt: skip
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(sys.argv), "processor": cpu, "dtype": args.dtype,
              "settings": dict(settings(args.set)),
              "rounds": args.rounds, "load_average": loads, "rows": rows,
              "table": "\n".join(lines)}  # fmt: skip
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
