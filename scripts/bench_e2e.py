"""Benchmark offline end-to-end generation: ours at DP=1 and DP=2 against transformers.

    .venv/bin/python scripts/bench_e2e.py [--quick] [--out bench_results/e2e.json]

(from the repository root, with the package installed editable)

The built-in tiny Qwen3-MoE (`launcher.builtin.BUILTIN_MODEL`: hidden 256, 4 layers, 16 experts
top-4, vocab 2048), float32, written by `make_tiny_checkpoint` into a temp dir. The workload is
fixed by a seed: N requests with prompt lengths and requested output lengths drawn uniformly
from ranges (default 128 requests, prompts 16–256, outputs 16–128 tokens), random token ids,
greedy, EOS ignored, so every contender produces exactly the requested tokens.

Contenders, run interleaved (one full workload each per round). Each of ours is a group of
Ray actor processes, started for its turn, warmed by one untimed pass of the workload, and
shut down after it, so one group is alive at a time, as in a job that runs one (with
`--all-alive`, every group starts once and stays up for the whole run: the idle groups' Ray
threads, actors and daemons then share the two cores with the one that runs, ~10% of its
tok/s here, docs/benchmark_notes.md):
  ours dpN default — `LLM(launcher="ray", dp_size=N)`, `generate(all prompts)`, with
                     `sync_policy: vote` (the seed's policy) at its default prefill attempt
                     intervals (70 / 100); round-robin routing over the ranks. (The engine's
                     default policy is `deadline`; bench_sync.py compares the three.)
  ours dpN tuned   — the same with smaller prefill attempt intervals (offline batch setting).
  ours dpN deadline — the engine's own defaults: `sync_policy: deadline` with mixed steps
                     (prompt chunks riding in decode steps, `mixed_prompt_tokens` unset), what
                     a job that sets no policy gets.
  ours dp1 … 1 core — DP=1 with `threads_per_rank=1`: the cores of one DP=2 rank (every other
                     rank of ours gets cpu_count // DP torch threads, so DP=1 and DP=2 both
                     use the whole machine).
  ours dp2 tuned gloo — DP=2 tuned with `moe_exchange: process_group`: the MoE all-to-alls on
                     the gloo group instead of shared memory (the default on one host).
  hf bsB           — transformers `generate` in the driver process (2 torch threads, like
                     ours at DP=1): static batches of B requests sorted by requested output
                     length (longest first, then prompt length), left padding, greedy,
                     `max_new_tokens` = the batch's longest request; tokens past a request's
                     own length are computed but not counted.
Every engine of ours runs in Ray actor processes, none in the driver: an engine thread doing
parallel torch work next to transformers would give the driver a second OpenMP pool and slow
both (see `launcher.clients.EngineHost`).
Measured per run, from the start of the job (all requests submitted at t0) to its end; start-up
(actors, model load) is excluded and reported separately:
  tok/s  — requested output tokens / wall time (useful tokens only).
  TTFT   — ours: the engine's `ttft_s` (arrival at the rank, ≈ t0, to the first token);
           transformers: t0 to the first decoding step of the request's batch (a logits
           processor timestamps every step), so it includes waiting for earlier batches.
  ITL    — gaps between a request's consecutive tokens (ours: `token_times`; transformers:
           the batch's step timestamps, for the request's own tokens only).
Reported: median over rounds of tok/s, latency percentiles pooled over rounds, and ratios of
the medians, all from this one run. Greedy outputs are cross-checked (DP=2 must equal DP=1;
agreement with transformers is reported, float32 rounding may flip near-ties).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from machine import describe, processor

from launcher import LLM, SamplingParams
from launcher.builtin import BUILTIN_MODEL
from launcher.ray_launcher import connect_ray

# These contenders compare the vote policy's attempt intervals (the shipped 70 / 100 against
# 8 / 8), so they pin it; the `deadline` contenders (the engine's default policy, which has no
# such intervals) set none.
DEFAULT_INTERVALS = {
    "sync_policy": "vote",
    "prefill_attempt_interval": 70,
    "prefill_any_attempt_interval": 100,
}
TUNED_INTERVALS = {
    "sync_policy": "vote",
    "prefill_attempt_interval": 8,
    "prefill_any_attempt_interval": 8,
}


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass
class RunResult:
    """One contender's pass over the whole workload."""

    wall_s: float
    useful_tokens: int
    ttft_s: list[float]
    itl_s: list[float]
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.useful_tokens / self.wall_s


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def make_workload(
    num: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int]
) -> list[Request]:
    """N requests, lengths uniform in the (inclusive) ranges, ids in [1, vocab) (0 is EOS)."""
    rng = random.Random(seed)
    vocab = BUILTIN_MODEL["vocab_size"]
    requests = []
    for _ in range(num):
        length = rng.randint(*prompt_range)
        prompt = [rng.randrange(1, vocab) for _ in range(length)]
        requests.append(Request(prompt, rng.randint(*output_range)))
    return requests


def engine_settings(
    max_num_seqs: int, max_len: int, intervals: dict[str, int], block_size: int = 16
) -> dict[str, Any]:
    """Scheduler sizes for throughput: a KV pool that holds `max_num_seqs` longest requests
    (no preemption), a 2048-token prefill budget, and the given attempt intervals."""
    blocks_per_seq = -(-max_len // block_size)
    return {
        "dtype": "float32",
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": 2048,
        "max_model_len": max(max_len, 512),
        "block_size": block_size,
        "num_blocks": max_num_seqs * blocks_per_seq + 1,
        **intervals,
    }


# -- ours -------------------------------------------------------------------------------------
class OursGroup:
    def __init__(
        self, model_dir: Path, dp_size: int, settings: dict[str, Any], kept_alive: bool = True
    ) -> None:
        """kept_alive: start the group now and keep it until `close`; else start it for each
        `run` (warmed by one untimed pass of the workload) and shut it down after."""
        self.model_dir, self.dp_size, self.settings = model_dir, dp_size, settings
        self.kept_alive = kept_alive
        self.llm: LLM | None = None
        self.startup_s = float("nan")  # the first start's, actors and model load
        if kept_alive:
            self._start()

    def _start(self) -> None:
        start = time.perf_counter()
        self.llm = LLM(model=self.model_dir, dp_size=self.dp_size, launcher="ray", **self.settings)
        if math.isnan(self.startup_s):  # the first start
            self.startup_s = time.perf_counter() - start

    def run(self, workload: list[Request], pins: list[int] | None = None) -> RunResult:
        """`pins`: the DP rank of each request (default: the LLM's round-robin routing)."""
        if self.kept_alive:
            return self._run(workload, pins)
        self._start()
        try:
            # One untimed pass first, so the timed one is a warm group's, as in a long-running
            # job (the first pass after a start also does lazy set-up and grows the heap).
            self._run(workload, pins)
            return self._run(workload, pins)
        finally:
            self.close()

    def _run(self, workload: list[Request], pins: list[int] | None = None) -> RunResult:
        assert self.llm is not None
        prompts = [r.prompt for r in workload]
        params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in workload]
        start = time.perf_counter()
        done = self.llm.generate(prompts, params, dp_rank=pins, use_tqdm=False)
        wall = time.perf_counter() - start
        for request, completion in zip(workload, done, strict=True):
            if len(completion.output_token_ids) != request.max_tokens:
                raise RuntimeError(f"{completion.request_id}: {completion.finish_reason}")
        return RunResult(
            wall_s=wall,
            useful_tokens=sum(r.max_tokens for r in workload),
            ttft_s=[c.ttft_s for c in done],
            itl_s=[gap for c in done for gap in gaps(c.token_times)],
            outputs=[c.output_token_ids for c in done],
        )

    def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None


# -- transformers -----------------------------------------------------------------------------
class StepClock:
    """A logits processor that only records when each decoding step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


class Transformers:
    def __init__(self, model_dir: Path, batch_size: int) -> None:
        from transformers import AutoModelForCausalLM

        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, local_files_only=True
        )
        model.generation_config.eos_token_id = None  # like ignore_eos: stop on length only
        self.model = model.eval()
        self.batch_size = batch_size
        self.startup_s = time.perf_counter() - start

    def batches(self, workload: list[Request]) -> list[list[int]]:
        order = sorted(
            range(len(workload)),
            key=lambda i: (workload[i].max_tokens, len(workload[i].prompt)),
            reverse=True,
        )
        return [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]

    def run(self, workload: list[Request]) -> RunResult:
        outputs: list[list[int]] = [[] for _ in workload]
        ttft: list[float] = []
        itl: list[float] = []
        start = time.perf_counter()
        for batch in self.batches(workload):
            clock = self.generate_batch([workload[i] for i in batch], outputs, batch)
            for i in batch:
                own = clock.times[: workload[i].max_tokens]
                ttft.append(own[0] - start)
                itl.extend(gaps(own))
        wall = time.perf_counter() - start
        useful = sum(r.max_tokens for r in workload)
        return RunResult(wall, useful, ttft, itl, outputs)

    def generate_batch(
        self, requests: list[Request], outputs: list[list[int]], indices: list[int]
    ) -> StepClock:
        from transformers import LogitsProcessorList

        width = max(len(r.prompt) for r in requests)
        ids = torch.zeros(len(requests), width, dtype=torch.int64)
        mask = torch.zeros(len(requests), width, dtype=torch.int64)
        for row, request in enumerate(requests):
            ids[row, width - len(request.prompt) :] = torch.tensor(request.prompt)
            mask[row, width - len(request.prompt) :] = 1
        clock = StepClock()
        with torch.no_grad():
            generated = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(r.max_tokens for r in requests),
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([clock]),
            )
        for row, (index, request) in enumerate(zip(indices, requests, strict=True)):
            outputs[index] = generated[row, width : width + request.max_tokens].tolist()
        return clock

    def close(self) -> None:
        self.model = None


# -- driver -----------------------------------------------------------------------------------
Contender = OursGroup | Transformers


def percentiles(values: list[float], points: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{p}": float("nan") for p in points}
    ordered = sorted(values)
    last = len(ordered) - 1
    return {f"p{p}": ordered[round(p / 100 * last)] for p in points}


def run_rounds(
    contenders: dict[str, Contender], workload: list[Request], rounds: int, log: Callable
) -> dict[str, list[RunResult]]:
    """Each round runs every contender once over the full workload, in the same order."""
    results: dict[str, list[RunResult]] = {name: [] for name in contenders}
    for round_index in range(rounds):
        for name, contender in contenders.items():
            result = contender.run(workload)
            results[name].append(result)
            log(f"round {round_index + 1}/{rounds} {name}: {result.tok_s:.0f} tok/s")
    return results


def summarize(
    contenders: dict[str, Contender], results: dict[str, list[RunResult]]
) -> dict[str, dict[str, Any]]:
    rows = {}
    for name, runs in results.items():
        rows[name] = {
            "startup_s": contenders[name].startup_s,
            "tok_s": statistics.median(r.tok_s for r in runs),
            "tok_s_runs": [r.tok_s for r in runs],
            "wall_s": statistics.median(r.wall_s for r in runs),
            "useful_tokens": runs[0].useful_tokens,
            "ttft_ms": {k: 1e3 * v for k, v in percentiles(pooled(runs, "ttft_s")).items()},
            "itl_ms": {k: 1e3 * v for k, v in percentiles(pooled(runs, "itl_s")).items()},
        }
    return rows


def pooled(runs: list[RunResult], attr: str) -> list[float]:
    return [value for run in runs for value in getattr(run, attr)]


def agreement(results: dict[str, list[RunResult]], base: str, other: str) -> float:
    """Fraction of requests whose greedy outputs are identical in the two contenders."""
    a, b = results[base][0].outputs, results[other][0].outputs
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def print_table(rows: dict[str, dict[str, Any]], baseline: str) -> None:
    header = ("contender", "tok/s", f"vs {baseline}", "TTFT p50", "TTFT p90", "ITL p50")
    print(f"{header[0]:<24}" + "".join(f" {h:>11}" for h in header[1:]) + "  start-up s")
    for name, row in rows.items():
        ratio = row["tok_s"] / rows[baseline]["tok_s"]
        print(
            f"{name:<24} {row['tok_s']:>11.0f} {ratio:>10.2f}x"
            f" {row['ttft_ms']['p50']:>9.0f}ms {row['ttft_ms']['p90']:>9.0f}ms"
            f" {row['itl_ms']['p50']:>9.1f}ms {row['startup_s']:>11.1f}"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 requests, 1 round, one HF bs")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    parser.add_argument("--max-num-seqs", type=int, default=128, help="per rank")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=(16, 64, 128))
    parser.add_argument(
        "--all-alive", action="store_true", help="keep every group of ours up for the whole run"
    )
    parser.add_argument("--out", default="bench_results/e2e.json")
    args = parser.parse_args()
    args.hf_batch_sizes = tuple(args.hf_batch_sizes)
    if args.quick:
        args.requests, args.rounds, args.hf_batch_sizes = 32, 1, (16,)
    return args


def build_contenders(model_dir: Path, args: argparse.Namespace) -> dict[str, Contender]:
    max_len = args.prompt_len[1] + args.output_len[1]
    contenders: dict[str, Contender] = {}
    alive = args.all_alive
    for label, intervals in (("default", DEFAULT_INTERVALS), ("tuned", TUNED_INTERVALS)):
        settings = engine_settings(args.max_num_seqs, max_len, intervals)
        for dp in (1, 2):
            contenders[f"ours dp{dp} {label}"] = OursGroup(model_dir, dp, settings, alive)
        one_core = {**settings, "threads_per_rank": 1}
        contenders[f"ours dp1 {label} 1 core"] = OursGroup(model_dir, 1, one_core, alive)
    shipped = engine_settings(args.max_num_seqs, max_len, {})
    for dp in (1, 2):
        contenders[f"ours dp{dp} deadline"] = OursGroup(model_dir, dp, shipped, alive)
    # DP=2's all-to-alls on the gloo group instead of shared memory (what a multi-host group
    # gets), to show what the exchange is worth end to end.
    gloo = {
        **engine_settings(args.max_num_seqs, max_len, TUNED_INTERVALS),
        "moe_exchange": "process_group",
    }
    contenders["ours dp2 tuned gloo"] = OursGroup(model_dir, 2, gloo, alive)
    for batch_size in args.hf_batch_sizes:
        contenders[f"hf bs{batch_size}"] = Transformers(model_dir, batch_size)
    return contenders


def warm_up(contenders: dict[str, Contender], workload: list[Request]) -> None:
    """The contenders that stay up pay their lazy set-up here (the others at each start)."""
    small = workload[:4]
    for contender in contenders.values():
        if not isinstance(contender, OursGroup) or contender.kept_alive:
            contender.run(small)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    workload = make_workload(args.requests, args.seed, args.prompt_len, args.output_len)
    load_before = os.getloadavg()
    connect_ray(num_cpus=13)  # logical CPUs: every contender's ranks stay up at once (13)
    import ray

    with tempfile.TemporaryDirectory() as tmp:
        settings = dict(BUILTIN_MODEL)
        from dist_engine.models.make_model import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint(settings.pop("arch"), tmp, **settings)
        contenders = build_contenders(model_dir, args)
        try:
            warm_up(contenders, workload)
            results = run_rounds(contenders, workload, args.rounds, log=print)
        finally:
            for contender in contenders.values():
                contender.close()
            ray.shutdown()
    load = {"before": load_before, "after": os.getloadavg()}
    rows = summarize(contenders, results)
    hf_names = [f"hf bs{b}" for b in args.hf_batch_sizes]
    baseline = max(hf_names, key=lambda name: rows[name]["tok_s"])
    checks = {
        "dp2_equals_dp1": agreement(results, "ours dp1 default", "ours dp2 default"),
        "tuned_equals_default": agreement(results, "ours dp1 default", "ours dp1 tuned"),
        "gloo_equals_shared_memory": agreement(results, "ours dp2 tuned", "ours dp2 tuned gloo"),
        "hf_agreement": agreement(results, "ours dp1 default", baseline),
        "deadline_equals_default": agreement(results, "ours dp1 default", "ours dp1 deadline"),
        "deadline_dp2_equals_dp1": agreement(results, "ours dp1 deadline", "ours dp2 deadline"),
    }
    print(
        f"{args.requests} requests, prompts {args.prompt_len}, outputs {args.output_len}, "
        f"{sum(r.max_tokens for r in workload)} requested tokens; median of {args.rounds} rounds"
    )
    print_table(rows, baseline)
    targets = target_ratios(rows, baseline)
    for name, value in targets.items():
        print(f"{name}: {value:.2f}x")
    print("output checks (fraction of identical requests):", checks)
    print(
        f"{describe(processor())}; load average (1, 5, 15 min) before "
        f"{', '.join(f'{x:.2f}' for x in load['before'])}, after "
        f"{', '.join(f'{x:.2f}' for x in load['after'])}"
    )
    write_json(args, rows, {"baseline": baseline, **targets}, checks, load)


def target_ratios(rows: dict[str, dict[str, Any]], baseline: str) -> dict[str, float]:
    """The issue's targets: DP=1 >= 3x the best transformers batch size, DP=2 >= 1.6x DP=1.
    DP=2 is compared with DP=1 on the whole machine (both use every core) and with DP=1 on one
    core (the cores of one DP=2 rank)."""
    ratios = {}
    for label in ("default", "tuned"):
        dp1, dp2 = rows[f"ours dp1 {label}"]["tok_s"], rows[f"ours dp2 {label}"]["tok_s"]
        one_core = rows[f"ours dp1 {label} 1 core"]["tok_s"]
        ratios[f"dp1 {label} / {baseline} (target 3)"] = dp1 / rows[baseline]["tok_s"]
        ratios[f"dp2 / dp1 {label} (target 1.6)"] = dp2 / dp1
        ratios[f"dp2 / dp1 {label} 1 core (target 1.6)"] = dp2 / one_core
    dp1, dp2 = rows["ours dp1 deadline"]["tok_s"], rows["ours dp2 deadline"]["tok_s"]
    ratios[f"dp1 deadline / {baseline} (target 3)"] = dp1 / rows[baseline]["tok_s"]
    ratios["dp2 / dp1 deadline (target 1.6)"] = dp2 / dp1
    return ratios


def write_json(
    args: argparse.Namespace, rows: dict, ratios: dict, checks: dict, load: dict
) -> None:
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": vars(args),
        "model": BUILTIN_MODEL,
        "processor": processor(),
        "load_average": load,
        "intervals": {"default": DEFAULT_INTERVALS, "tuned": TUNED_INTERVALS},
        "rows": rows,
        "ratios": ratios,
        "checks": checks,
    }
    out_path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
