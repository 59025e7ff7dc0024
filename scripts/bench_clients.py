"""The clients vLLM users run, unchanged, against `lockstep serve` and `vllm serve` side by side.

    python scripts/bench_clients.py [--rates inf,4,8] [--num-prompts 64] [--rounds 2]
    python scripts/bench_clients.py --rates inf,0.5x,0.9x --dtype bfloat16   # rates by capacity

On one checkpoint with a tokenizer (the built-in tiny Qwen3-MoE by default), one server at a
time on a free loopback port, contenders interleaved round by round:

- `vllm serve` (vLLM's CPU backend, float32, prefix caching off), `lockstep serve` at DP=1
  (local: the engine on a thread of the server) and at DP=2 (Ray); `lockstep-dpN-ray` runs
  DP=N under Ray whatever N (at DP=1 that is `lockstep serve`'s default, which heals a rank
  that dies); a Lockstep contender may carry server flags after `+`, each `FLAG=VALUE` or
  a switch `FLAG` (`lockstep-dp2+prefill-deadline-steps=0` runs `--prefill-deadline-steps 0`,
  `lockstep-dp2+no-mixed-steps` runs `--no-mixed-steps`);
- `vllm bench serve` with its `openai` (completions) and `openai-chat` backends, random
  prompts, at request rate inf and at Poisson rates: completed/failed requests, throughput,
  TTFT and ITL p50/p99. A rate written `0.5x` is that fraction of the capacity of the first
  contender (vLLM by default) measured in the same round with the same client at rate inf
  (its completed requests per second), so every server sees the same offered load;
- lm-eval's `local-completions` on two local tasks (a multiple-choice task: batched token-list
  prompts with echo + logprobs; and a generate_until task): every loglikelihood compared with
  vLLM's, and every generation;
- one guidellm run (a synchronous profile) per server.

Each client lives in a virtual environment of its own, made on first use: `.venv-vllm`
(scripts/bench_vs_vllm.py), `.venv-lmeval` (lm-eval[api] 0.4.13, no torch), `.venv-guidellm`
(guidellm, with this project's CPU torch pinned). Prints tables and writes `--out` (JSON, with
the processor's flags and the load average over the run).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from machine import describe, processor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
VENVS = {
    "lmeval": (ROOT / ".venv-lmeval", ["lm-eval[api]==0.4.13", "transformers>=5"]),
    "guidellm": (ROOT / ".venv-guidellm", ["guidellm", "torch==2.13.0"]),
}
LM_EVAL_MC = """task: lockstep_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
LM_EVAL_GEN = """task: lockstep_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 24
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
"""


# -- set-up ---------------------------------------------------------------------------------
def ensure_venv(name: str) -> Path:
    path, packages = VENVS[name]
    python = path / "bin" / "python"
    if not python.is_file():
        print(f"setting up {path} ({', '.join(packages)}); this downloads once", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *packages],
            check=True,
        )
    return path / "bin"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


def start(contender: str, model: str, port: int, log: Path, dtype: str) -> subprocess.Popen:
    common = ["--port", str(port), "--served-model-name", "tiny", "--max-model-len", "1024"]
    if contender == "vllm":
        from bench_vs_vllm import ensure_vllm_venv

        python = ensure_vllm_venv()
        command = [str(python), str(ROOT / "scripts" / "vllm_cli.py"), "serve", model,
                   "--dtype", dtype, "--no-enable-prefix-caching", *common]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    else:
        name, *flags = contender.split("+")
        dp = name.removeprefix("lockstep-dp").removesuffix("-ray")
        local = dp == "1" and not name.endswith("-ray")
        launcher = ["--launcher", "local" if local else "ray"]
        extra = []
        for flag in flags:  # FLAG=VALUE, or a switch: FLAG
            key, has_value, value = flag.partition("=")
            extra += [f"--{key}", value] if has_value else [f"--{key}"]
        command = [str(ROOT / ".venv" / "bin" / "lockstep"), "serve", model, "--dtype", dtype,
                   "--data-parallel-size", dp, *launcher, *common, *extra]  # fmt: skip
        env = dict(os.environ)
    handle = log.open("w")
    return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# -- clients --------------------------------------------------------------------------------
def bench_serve(url: str, model: str, backend: str, rate: str, args: argparse.Namespace,
                out: Path) -> dict[str, Any]:  # fmt: skip
    from bench_vs_vllm import ensure_vllm_venv

    endpoint = "/v1/completions" if backend == "openai" else "/v1/chat/completions"
    name = f"{backend}-{rate}.json"
    command = [
        str(ensure_vllm_venv()), str(ROOT / "scripts" / "vllm_cli.py"), "bench", "serve",
        "--backend", backend, "--base-url", url, "--endpoint", endpoint, "--model", "tiny",
        "--tokenizer", model, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--request-rate", rate, "--ignore-eos",
        "--seed", "0", "--percentile-metrics", "ttft,itl,tpot", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out), "--result-filename", name,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-2000:]}
    result = json.loads((out / name).read_text())
    keys = ("completed", "failed", "request_throughput", "output_throughput",
            "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")  # fmt: skip
    return {"rate": rate, **{key: result.get(key) for key in keys}}


def offered_rate(rate: str, capacity: float | None) -> str | None:
    """`vllm bench serve`'s --request-rate for a rate as written: `inf` or requests/s as they
    are, `0.5x` that fraction of `capacity` (None while the capacity is not measured)."""
    if not rate.endswith("x"):
        return rate
    if capacity is None:
        return None
    return f"{float(rate[:-1]) * capacity:.3f}"


def write_lm_eval_tasks(directory: Path) -> None:
    import random

    rng = random.Random(0)
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "eta",
        "theta",
        "iota",
        "kappa",
        "lambda",
        "mu",
    ]

    def phrase(low: int, high: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))

    with (directory / "mc.jsonl").open("w") as out:
        for _ in range(24):
            choices = [phrase(1, 4) for _ in range(4)]
            out.write(json.dumps({"question": phrase(3, 8), "choices": choices,
                                  "answer": rng.randrange(4)}) + "\n")  # fmt: skip
    with (directory / "gen.jsonl").open("w") as out:
        for _ in range(16):
            out.write(json.dumps({"question": phrase(3, 8), "answer": rng.choice(words)}) + "\n")
    (directory / "mc.yaml").write_text(LM_EVAL_MC.format(data=directory / "mc.jsonl"))
    (directory / "gen.yaml").write_text(LM_EVAL_GEN.format(data=directory / "gen.jsonl"))


def lm_eval(url: str, model: str, tasks: Path, out: Path) -> dict[str, Any]:
    bin_dir = ensure_venv("lmeval")
    model_args = (f"model=tiny,base_url={url}/v1/completions,tokenizer={model},"
                  "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1")  # fmt: skip
    command = [str(bin_dir / "lm_eval"), "--model", "local-completions", "--model_args",
               model_args, "--include_path", str(tasks), "--tasks", "lockstep_mc,lockstep_gen",
               "--log_samples", "--output_path", str(out)]  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-2000:]}
    samples = {}
    for task in ("lockstep_mc", "lockstep_gen"):
        (path,) = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
        samples[task] = {int(x["doc_id"]): x["resps"] for x in lines}
    return samples


def compare_lm_eval(reference: dict, other: dict) -> dict[str, Any]:
    if "error" in reference or "error" in other:
        return {"error": other.get("error") or reference.get("error")}
    deltas, greedy_same, total = [], 0, 0
    for doc, responses in reference["lockstep_mc"].items():
        for ours, theirs in zip(other["lockstep_mc"][doc], responses, strict=True):
            deltas.append(abs(float(ours[0][0]) - float(theirs[0][0])))
            greedy_same += ours[0][1] == theirs[0][1]
            total += 1
    generations = reference["lockstep_gen"]
    same = sum(other["lockstep_gen"][doc] == text for doc, text in generations.items())
    return {
        "loglikelihoods": total,
        "max_abs_loglikelihood_diff": max(deltas),
        "is_greedy_agree": greedy_same,
        "generations": len(generations),
        "generations_equal": same,
    }


def guidellm(url: str, model: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One synchronous guidellm run (its `run` command, guidellm >= 0.6): request counts by
    outcome, TTFT and ITL medians."""
    bin_dir = ensure_venv("guidellm")
    report_path = out / "guidellm.json"
    command = [
        str(bin_dir / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={url},model=tiny",
        "--profile", "kind=synchronous",
        "--constraint", "kind=max_requests,count=16",
        "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},"
                  f"output_tokens={args.output_len}",
        "--tokenizer", f"kind=huggingface_auto,model={model}",
        "--output", f"kind=json,path={report_path}",
    ]  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0 or not report_path.is_file():
        return {"error": (done.stdout + done.stderr)[-2000:]}
    metrics = json.loads(report_path.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]

    def median(name: str) -> float | None:
        return (metrics.get(name) or {}).get("successful", {}).get("median")

    return {
        "successful": totals.get("successful"),
        "errored": totals.get("errored"),
        "incomplete": totals.get("incomplete"),
        "median_ttft_ms": median("time_to_first_token_ms"),
        "median_itl_ms": median("inter_token_latency_ms"),
    }


# -- the run --------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint with a tokenizer (default: the built-in)")
    parser.add_argument("--contenders", default="vllm,lockstep-dp1,lockstep-dp2")
    parser.add_argument("--rates", default="inf,4,8")
    parser.add_argument("--backends", default="openai,openai-chat")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="both servers' --dtype")
    parser.add_argument("--no-lm-eval", action="store_true")
    parser.add_argument("--no-guidellm", action="store_true")
    parser.add_argument("--out", default="bench_results/clients.json")
    args = parser.parse_args()
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from launcher.builtin import builtin_model

        args.model = str(builtin_model())
    contenders = args.contenders.split(",")
    work = Path(tempfile.mkdtemp(prefix="lockstep-clients-"))
    tasks = work / "tasks"
    tasks.mkdir()
    write_lm_eval_tasks(tasks)
    loads = [os.getloadavg()[0]]
    capacity: dict[tuple[int, str], float] = {}  # (round, backend) -> requests/s at rate inf
    results: dict[str, Any] = {c: {"bench_serve": {}, "lm_eval": None, "guidellm": None}
                               for c in contenders}  # fmt: skip
    for round_index in range(args.rounds):
        for contender in contenders:  # interleaved: every contender once per round
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            out = work / f"{contender}-{round_index}"
            out.mkdir()
            process = start(contender, args.model, port, out / "server.log", args.dtype)
            try:
                wait_ready(url, process, 600)
                for backend in args.backends.split(","):
                    for rate in args.rates.split(","):
                        offered = offered_rate(rate, capacity.get((round_index, backend)))
                        if offered is None:
                            row = {"error": f"{rate}: no capacity measured at rate inf by "
                                   f"{contenders[0]} in round {round_index} first"}  # fmt: skip
                        else:
                            row = bench_serve(url, args.model, backend, offered, args, out)
                        if contender == contenders[0] and rate == "inf" and "error" not in row:
                            capacity[(round_index, backend)] = row["request_throughput"]
                        key = f"{backend}@{rate}"
                        results[contender]["bench_serve"].setdefault(key, []).append(row)
                        print(f"round {round_index} {contender:14} {key:18} {row}", flush=True)
                if round_index == 0 and not args.no_lm_eval:
                    results[contender]["lm_eval"] = lm_eval(url, args.model, tasks, out / "lm")
                if round_index == 0 and not args.no_guidellm:
                    results[contender]["guidellm"] = guidellm(url, args.model, out, args)
            finally:
                stop(process)
            loads.append(os.getloadavg()[0])
    summary = summarize(results, contenders)
    report = {
        "model": args.model,
        "settings": {k: v for k, v in vars(args).items() if k != "model"},
        "processor": processor(),
        "load_average_range": [min(loads), max(loads)],
        "summary": summary,
        "raw": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print_tables(summary, report)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def summarize(results: dict[str, Any], contenders: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for contender in contenders:
        rows = {}
        for key, runs in results[contender]["bench_serve"].items():
            good = [r for r in runs if "error" not in r]
            if not good:
                rows[key] = {"error": runs[0].get("error", "")[-300:]}
                continue
            rows[key] = {
                "offered_rate": [r["rate"] for r in good],
                "completed": [r["completed"] for r in good],
                "failed": [r["failed"] for r in good],
                **{
                    name: [
                        min(r[name] for r in good),
                        statistics.median(r[name] for r in good),
                        max(r[name] for r in good),
                    ]
                    for name in (
                        "output_throughput",
                        "median_ttft_ms",
                        "median_itl_ms",
                        "p99_itl_ms",
                    )
                },
            }
        entry: dict[str, Any] = {"bench_serve": rows, "guidellm": results[contender]["guidellm"]}
        if contender != "vllm" and "vllm" in results and results["vllm"]["lm_eval"] is not None:
            entry["lm_eval_vs_vllm"] = compare_lm_eval(
                results["vllm"]["lm_eval"], results[contender]["lm_eval"]
            )
        summary[contender] = entry
    return summary


def print_tables(summary: dict[str, Any], report: dict[str, Any]) -> None:
    proc = report["processor"]
    low, high = report["load_average_range"]
    print(f"\n{describe(proc)}; load average {low:.2f}-{high:.2f}")
    print(f"{'server':14} {'client@rate':20} {'done/failed':>12} {'out tok/s':>22} "
          f"{'TTFT p50 ms':>22} {'ITL p50 ms':>20} {'ITL p99 ms':>22}")  # fmt: skip
    for contender, entry in summary.items():
        for key, row in entry["bench_serve"].items():
            if "error" in row:
                print(f"{contender:14} {key:20} error: {row['error'][:60]}")
                continue
            done = f"{sum(row['completed'])}/{sum(row['failed'])}"
            if key.endswith("x"):  # the requests/s each round offered
                key = f"{key} ({'/'.join(f'{float(r):.1f}' for r in row['offered_rate'])}/s)"

            def span(name: str, row: dict = row) -> str:
                low, mid, high = row[name]
                return f"{mid:8.1f} [{low:.1f}-{high:.1f}]"

            print(f"{contender:14} {key:20} {done:>12} {span('output_throughput'):>22} "
                  f"{span('median_ttft_ms'):>22} {span('median_itl_ms'):>20} "
                  f"{span('p99_itl_ms'):>22}")  # fmt: skip
    for contender, entry in summary.items():
        if "lm_eval_vs_vllm" in entry:
            print(f"lm-eval {contender} vs vllm: {entry['lm_eval_vs_vllm']}")
        print(f"guidellm {contender}: {entry['guidellm']}")


if __name__ == "__main__":
    raise SystemExit(main())
