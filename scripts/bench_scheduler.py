"""Microseconds per scheduler step: decode steps at several batch sizes, and prefill-heavy steps.

A decode step is ``schedule()`` + ``process_outputs()`` with every running sequence in the
batch; no model runs. The peer is vLLM v1's own Scheduler on the same cases (`schedule()` +
`update_from_output()`, scripts/vllm_scheduler_worker.py, in vLLM's venv), the two interleaved
over rounds. Prints a table (median and range over rounds) and writes JSON with the processor
and the load average.

    .venv/bin/python scripts/bench_scheduler.py [--rounds 3] [--peer vllm|none]
        [--out bench_results/scheduler.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from bench_vs_vllm import ensure_vllm_venv
from machine import processor

from scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence

DECODE_SIZES = (64, 256, 1024)
ARRIVAL_EVERY = 4


def _decode_scheduler(num_seqs: int, prompt_len: int, prefix_caching: bool) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(2048, num_seqs * prompt_len),
        max_model_len=4096,
        block_size=16,
        num_blocks=num_seqs * 64 + 1,
        prefill_attempt_interval=1_000_000,  # keep the measured steps pure decode
        prefill_any_attempt_interval=1_000_000,
        sync_policy="vote",
        enable_prefix_caching=prefix_caching,
    )
    sched = Scheduler(config)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    for index in range(num_seqs):
        sched.add_sequence(Sequence(f"r{index}", [index % 97 + 1] * prompt_len, params))
    outputs = sched.schedule()
    assert outputs.is_prefill and outputs.num_seqs == num_seqs, "prefill did not admit all"
    sched.process_outputs(outputs, [1] * num_seqs)
    return sched


def time_decode(num_seqs: int, steps: int, repeats: int, prefix_caching: bool) -> dict:
    samples = []
    for _ in range(repeats):
        sched = _decode_scheduler(num_seqs, prompt_len=32, prefix_caching=prefix_caching)
        tokens = [7] * num_seqs
        for _ in range(20):  # warm-up
            sched.process_outputs(sched.schedule(), tokens)
        start = time.perf_counter()
        for _ in range(steps):
            outputs = sched.schedule()
            sched.process_outputs(outputs, tokens)
        samples.append((time.perf_counter() - start) / steps * 1e6)
        assert outputs.num_seqs == num_seqs and not outputs.is_prefill
    return {"us_per_step": statistics.median(samples), "samples_us": samples}


def time_arrivals(num_seqs: int, steps: int, repeats: int) -> dict:
    """``num_seqs`` decoding under the default policy (`deadline`, mixed steps), and a new
    64-token prompt (4 output tokens) arriving every ARRIVAL_EVERY steps: the steps that take
    it in, whole or in chunks, are mixed steps, the others decode."""
    samples = []
    short = SamplingParams(max_tokens=4, ignore_eos=True)
    for _ in range(repeats):
        config = SchedulerConfig(
            max_num_seqs=num_seqs + 64,
            max_num_batched_tokens=max(2048, num_seqs * 32),
            max_model_len=4096,
            block_size=16,
            num_blocks=num_seqs * 64 + 1,
        )
        sched = Scheduler(config)
        params = SamplingParams(max_tokens=100_000, ignore_eos=True)
        for index in range(num_seqs):
            sched.add_sequence(Sequence(f"r{index}", [index % 97 + 1] * 32, params))
        arrivals = 0

        def step(index: int, sched: Scheduler = sched) -> int:
            nonlocal arrivals
            if index % ARRIVAL_EVERY == 0:
                arrivals += 1
                sched.add_sequence(Sequence(f"a{arrivals}", [arrivals % 89 + 3] * 64, short))
            outputs = sched.schedule()
            sched.process_outputs(outputs, [7] * len(outputs.scheduled_seqs))
            return outputs.num_decode_seqs if outputs.is_prefill else outputs.num_seqs

        for index in range(40):  # admission and warm-up
            step(index)
        start = time.perf_counter()
        decoded = [step(index) for index in range(40, 40 + steps)]
        samples.append((time.perf_counter() - start) / steps * 1e6)
        assert min(decoded) >= num_seqs, "a step left a running sequence out"
    return {"us_per_step": statistics.median(samples), "samples_us": samples}


def time_prefill(num_prompts: int, prompt_len: int, repeats: int) -> dict:
    """Steps that admit ``num_prompts`` new prompts each, with prefix caching on."""
    samples = []
    params = SamplingParams(max_tokens=1)
    for _ in range(repeats):
        config = SchedulerConfig(
            max_num_seqs=num_prompts,
            max_num_batched_tokens=num_prompts * prompt_len,
            max_model_len=prompt_len + 8,
            block_size=16,
            num_blocks=num_prompts * (prompt_len // 16 + 2) * 2 + 1,
            enable_prefix_caching=True,
        )
        sched = Scheduler(config)
        rounds = 50
        start = time.perf_counter()
        for round_index in range(rounds):
            for index in range(num_prompts):
                prompt = [round_index * 7 + index % 13 + 1] * prompt_len
                sched.add_sequence(Sequence(f"p{round_index}-{index}", prompt, params))
            outputs = sched.schedule()
            assert outputs.is_prefill and outputs.num_seqs == num_prompts
            sched.process_outputs(outputs, [1] * num_prompts)  # max_tokens=1: all finish
        samples.append((time.perf_counter() - start) / rounds * 1e6)
    return {"us_per_step": statistics.median(samples), "samples_us": samples}


def time_ours(sizes: tuple[int, ...], steps: int, repeats: int) -> list[dict]:
    rows = []
    for prefix_caching in (False, True):
        for size in sizes:
            result = time_decode(size, steps, repeats, prefix_caching)
            rows.append(
                {"kind": "decode", "running_seqs": size, "prefix_caching": prefix_caching, **result}
            )
    arrivals = time_arrivals(256, steps, repeats)
    rows.append(
        {"kind": "decode + arrivals", "running_seqs": 256, "prefix_caching": False, **arrivals}
    )
    prefill = time_prefill(num_prompts=64, prompt_len=256, repeats=repeats)
    rows.append({"kind": "prefill", "running_seqs": 64, "prefix_caching": True, **prefill})
    return rows


def time_peer(python: Path, sizes: tuple[int, ...], steps: int, repeats: int) -> list[dict]:
    """vLLM's Scheduler on the same cases, in its interpreter (vllm_scheduler_worker.py)."""
    request = json.dumps(
        {"sizes": list(sizes), "steps": steps, "repeats": repeats, "every": ARRIVAL_EVERY}
    )
    done = subprocess.run(
        [str(python), str(Path(__file__).with_name("vllm_scheduler_worker.py")), request],
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if done.returncode != 0:
        raise SystemExit(f"vLLM's scheduler worker failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["rows"]


def _key(row: dict) -> tuple:
    return (row["kind"], row["running_seqs"], row["prefix_caching"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, contenders interleaved")
    parser.add_argument(
        "--peer",
        choices=["vllm", "none"],
        default="vllm",
        help="time vLLM v1's Scheduler on the same cases (its venv is made on first use)",
    )
    parser.add_argument("--out", default="bench_results/scheduler.json")
    args = parser.parse_args()

    python = ensure_vllm_venv() if args.peer == "vllm" else None
    load_before = os.getloadavg()
    samples: dict[tuple, dict[str, list[float]]] = {}
    for round_index in range(args.rounds):
        contenders = ["lockstep", "vllm"] if python else ["lockstep"]
        if round_index % 2:
            contenders.reverse()
        for name in contenders:
            if name == "lockstep":
                rows = time_ours(DECODE_SIZES, args.steps, args.repeats)
            else:
                rows = time_peer(python, DECODE_SIZES, args.steps, args.repeats)
            for row in rows:
                samples.setdefault(_key(row), {}).setdefault(name, []).append(row["us_per_step"])
            print(f"round {round_index + 1}: {name} done", flush=True)

    rows = []
    for key, by_name in samples.items():
        kind, seqs, prefix_caching = key
        row = {"kind": kind, "running_seqs": seqs, "prefix_caching": prefix_caching}
        for name, values in by_name.items():
            row[name] = {"us_per_step": statistics.median(values), "rounds_us": values}
        if "vllm" in row:
            row["ratio"] = row["lockstep"]["us_per_step"] / row["vllm"]["us_per_step"]
        rows.append(row)

    print(
        "| kind | sequences | prefix cache | Lockstep µs per step (range) | µs per sequence "
        "| vLLM µs per step (range) | Lockstep / vLLM |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        ours = row["lockstep"]
        peer = row.get("vllm")
        peer_cell = f"{_fmt(peer['us_per_step'])} ({_range(peer['rounds_us'])})" if peer else "-"
        ratio = f"{row['ratio']:.3f}" if peer else "-"
        print(
            f"| {row['kind']} | {row['running_seqs']} | {'on' if row['prefix_caching'] else 'off'} "
            f"| {_fmt(ours['us_per_step'])} ({_range(ours['rounds_us'])}) "
            f"| {ours['us_per_step'] / row['running_seqs']:.2f} | {peer_cell} | {ratio} |"
        )
    decode = {
        r["running_seqs"]: r["lockstep"]["us_per_step"]
        for r in rows
        if r["kind"] == "decode" and not r["prefix_caching"]
    }
    ratio = decode[1024] / decode[256]
    print(f"Lockstep decode 1024 / 256: {ratio:.2f} (linear: 4)")
    load_after = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f}; after: {load_after[0]:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "rows": rows,
                "ratio_1024_over_256": ratio,
                "peer": args.peer,
                "rounds": args.rounds,
                "repeats": args.repeats,
                "steps": args.steps,
                "processor": processor(),
                "python": platform.python_version(),
                "load_average_before": load_before,
                "load_average_after": load_after,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


def _fmt(us: float) -> str:
    return f"{us:,.1f}"


def _range(values: list[float]) -> str:
    return f"{min(values):,.1f}-{max(values):,.1f}"


if __name__ == "__main__":
    main()
