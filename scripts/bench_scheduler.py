"""Microseconds per scheduler step: decode steps at several batch sizes, and prefill-heavy steps.

A decode step is ``schedule()`` + ``process_outputs()`` with every running sequence in the
batch; no model runs. Prints a table and writes JSON.

    .venv/bin/python scripts/bench_scheduler.py [--out bench_results/scheduler.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence

DECODE_SIZES = (64, 256, 1024)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_results/scheduler.json")
    args = parser.parse_args()

    rows = []
    for prefix_caching in (False, True):
        for size in DECODE_SIZES:
            result = time_decode(size, args.steps, args.repeats, prefix_caching)
            rows.append(
                {
                    "kind": "decode",
                    "running_seqs": size,
                    "prefix_caching": prefix_caching,
                    **result,
                    "us_per_seq": result["us_per_step"] / size,
                }
            )
    prefill = time_prefill(num_prompts=64, prompt_len=256, repeats=args.repeats)
    rows.append(
        {
            "kind": "prefill",
            "running_seqs": 64,
            "prefix_caching": True,
            **prefill,
            "us_per_seq": prefill["us_per_step"] / 64,
        }
    )

    print(f"{'kind':8} {'seqs':>6} {'prefix$':>8} {'us/step':>10} {'us/seq':>8}")
    for row in rows:
        print(
            f"{row['kind']:8} {row['running_seqs']:>6} {row['prefix_caching']!s:>8} "
            f"{row['us_per_step']:>10.1f} {row['us_per_seq']:>8.2f}"
        )
    by_size = {
        r["running_seqs"]: r["us_per_step"]
        for r in rows
        if r["kind"] == "decode" and not r["prefix_caching"]
    }
    ratio = by_size[1024] / by_size[256]
    print(
        f"decode 1024/256 ratio: {ratio:.2f} (target <= 4.5); "
        f"256 seqs: {by_size[256]:.0f} us (target <= 250)"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "rows": rows,
                "ratio_1024_over_256": ratio,
                "python": platform.python_version(),
                "machine": platform.machine(),
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
