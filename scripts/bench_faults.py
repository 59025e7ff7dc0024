"""A group that heals: from a rank's SIGKILL (or SIGSTOP) to the first token after it, and
throughput before / during / after, by DP size and model size.

    .venv/bin/python scripts/bench_faults.py [--dp 2 4] [--models small large]
        [--faults kill stop] [--modes heal shrink] [--collective-timeout 4] [--requests 32]
        [--prompt-len 32]
        [--max-tokens 96] [--cache-dir DIR] [--out bench_results/faults.json]

(from the repository root, with the package installed editable)

Models (Qwen3-MoE, float32, random weights written once under `--cache-dir`): `small` is the
built-in tiny model (`launcher.builtin.BUILTIN_MODEL`: hidden 256, 4 layers, 16 experts);
`large` is hidden 768, 8 layers, 32 experts of 384 (about 0.9 GB), so that loading the
experts, the part of a recovery that grows with the model, shows.

Per (model, DP size, fault, mode): an `LLM` on an embedded Ray (`on_rank_failure` = the mode:
`heal` replaces the rank, `shrink` goes on with the survivors, who take over its experts; one
torch thread per rank) streams the workload (`--requests` prompts of `--prompt-len` random
tokens, greedy, EOS ignored, `--max-tokens` each) once without a fault (the reference, and a
warm-up), then again, SIGKILLing rank 1 once a third of the tokens have arrived (`--faults
stop`: SIGSTOPping it, which its peers see once their collective has waited
`--collective-timeout` seconds, the group's `collective_timeout_s`). Every token is
timestamped as it reaches the driver, with the group generation it came from. Reported:
  start-up s      — the LLM's start (placement, actors, model load), for comparison;
  fault->token s  — from the kill to the first token of the re-formed group (in the JSON,
                    `fault_to_resumed_token_s`: to the first token of a request the killed
                    rank held, which is re-prefilled on its replacement);
  tok/s before / during / after — tokens reaching the driver per second from the first token
                    to the kill, from the kill to the new group's first token, and from then
                    to the end (which includes re-prefilling the resumed requests);
  resumed/open    — requests resubmitted (a heal in place: the killed rank's only), of those
                    unfinished at the kill (a shrink resubmits them to the survivors);
  kept            — the ranks whose process survived the heal (their requests went on);
  same            — whether every request's tokens equal the fault-free run's; the JSON's
                    `differing` lists each request that does not, with the first position
                    that differs, how many of its tokens came from the old group, and both
                    token lists.
A difference is not by itself a healing fault: fp32 GEMMs give a row bits that depend on the
batch's row count (on the AVX2 host, M < 4 and M >= 4 differ by ~6e-5), so any change of
schedule (a resumed prefill, another arrival order) can flip an MoE router's top-k where two
experts' scores are within ~1e-5, and the tokens after it then differ by model, not by noise.
Check a differing request against an independent run (the single-process engine,
transformers) before blaming the heal; docs/benchmark_notes.md records the case found this way.
Figures are this host's under whatever else runs on it, not properties of the code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from machine import describe, processor

from dist_engine.models.make_model import make_tiny_checkpoint
from launcher import LLM, SamplingParams
from launcher.builtin import BUILTIN_MODEL

LARGE_MODEL = dict(
    arch="qwen3_moe",
    seed=0,
    vocab_size=4096,
    hidden_size=768,
    num_layers=8,
    num_heads=12,
    num_kv_heads=4,
    head_dim=64,
    num_experts=32,
    top_k=4,
    moe_intermediate_size=384,
)
MODELS = {"small": BUILTIN_MODEL, "large": LARGE_MODEL}


def model_dir(name: str, cache_dir: Path) -> Path:
    target = cache_dir / f"bench-faults-{name}"
    if not (target / "config.json").is_file():
        settings = dict(MODELS[name])
        make_tiny_checkpoint(settings.pop("arch"), target, settings.pop("seed"), **settings)
    return target


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]


def stream(
    llm: LLM,
    prompts: list[list[int]],
    params: SamplingParams,
    kill_at_tokens: int | None,
    signum: int = signal.SIGKILL,
):
    """Stream the prompts; returns (token arrivals [(time, generation)], tokens per prompt,
    the kill's time or None, (the requests unfinished then, those of them on the killed rank),
    the tokens each prompt had then, the group each token came from). Kills rank 1 once
    ``kill_at_tokens`` tokens have arrived (sends it ``signum``)."""
    index_of = {tuple(p): i for i, p in enumerate(prompts)}
    arrivals: list[tuple[float, int]] = []
    tokens: list[list[int]] = [[] for _ in prompts]
    generations: list[list[int]] = [[] for _ in prompts]  # the group each token came from
    finished: set[int] = set()
    rank_of: dict[int, int] = {}
    killed_at, unfinished, at_kill, resumed_at = None, (0, 0), None, None
    killed_in = -1  # the group generation the kill hit
    for completion in llm.generate_stream(prompts, params):
        now, generation = time.monotonic(), llm.client.generation
        index = index_of[tuple(completion.prompt_token_ids)]
        arrivals += [(now, generation)] * len(completion.new_token_ids)
        tokens[index] += completion.new_token_ids
        generations[index] += [generation] * len(completion.new_token_ids)
        rank_of.setdefault(index, completion.dp_rank)
        if (
            resumed_at is None and killed_at is not None and generation > killed_in
            and rank_of[index] == 1 and completion.new_token_ids
        ):  # fmt: skip
            resumed_at = now  # a token of a request the killed rank held, from the new group
        if completion.finished:
            finished.add(index)
        if killed_at is None and kill_at_tokens is not None and len(arrivals) >= kill_at_tokens:
            os.kill(llm.client.pids[1], signum)
            open_ = [i for i in range(len(prompts)) if i not in finished]
            on_killed = sum(1 for i in open_ if rank_of.get(i) == 1)
            killed_at, unfinished = time.monotonic(), (len(open_), on_killed)
            killed_in = generation
            at_kill = [len(t) for t in tokens]
    return arrivals, tokens, killed_at, unfinished, at_kill, generations, resumed_at


def rate(arrivals: list[tuple[float, int]], start: float, end: float) -> float:
    count = sum(1 for at, _ in arrivals if start < at <= end)
    return count / (end - start) if end > start else 0.0


def measure(
    name: str, dp_size: int, fault: str, mode: str, args: argparse.Namespace
) -> dict[str, Any]:
    directory = model_dir(name, Path(args.cache_dir))
    prompts = workload(args, MODELS[name]["vocab_size"])
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    settings = dict(
        threads_per_rank=1, max_num_seqs=args.requests, max_model_len=1024, num_blocks=2048,
        block_size=16, max_recoveries_per_hour=10, collective_timeout_s=args.collective_timeout,
        on_rank_failure=mode,
    )  # fmt: skip
    start = time.monotonic()
    with LLM(model=str(directory), launcher="ray", dp_size=dp_size, **settings) as llm:
        startup_s = time.monotonic() - start
        _, reference, *_ = stream(llm, prompts, params, None)
        generation = llm.client.generation
        total = args.requests * args.max_tokens
        pids = dict(llm.client.pids)
        signum = signal.SIGSTOP if fault == "stop" else signal.SIGKILL
        try:
            faulted = stream(llm, prompts, params, total // 3, signum)
        finally:
            if fault == "stop":  # the heal kills it; if it did not, let it go on
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pids[1], signal.SIGCONT)
        after = dict(llm.client.pids)
        detach_wait_s = llm.client.last_detach_wait_s
        live = llm.client.live_ranks
    kept = sorted(rank for rank in pids if rank != 1 and after.get(rank) == pids[rank])
    arrivals, tokens, killed_at, unfinished, at_kill, generations, resumed_at = faulted
    assert killed_at is not None, "the workload ended before the kill"
    old = [g.count(generation) for g in generations]
    first = arrivals[0][0]
    healed_at = next(at for at, gen in arrivals if gen > generation)
    return {
        "model": name,
        "dp": dp_size,
        "fault": fault,
        "mode": mode,
        "live_ranks_after": live,
        "collective_timeout_s": args.collective_timeout,
        # The heal's wait for the live ranks to leave the failed group.
        "detach_wait_s": detach_wait_s,
        "startup_s": startup_s,
        "fault_to_token_s": healed_at - killed_at,
        # From the kill to the first token of a request the killed rank held (its resumption).
        "fault_to_resumed_token_s": resumed_at - killed_at if resumed_at else None,
        "tok_s_before": rate(arrivals, first, killed_at),
        "tok_s_during": rate(arrivals, killed_at, healed_at),
        "tok_s_after": rate(arrivals, healed_at, arrivals[-1][0]),
        "unfinished": unfinished[0],
        # A heal in place resubmits only the killed rank's requests; the others go on.
        "resumed": unfinished[1] if kept else unfinished[0],
        "kept_ranks": kept,
        "same_tokens": tokens == reference,
        "differing": differing(reference, tokens, at_kill, old),
        "tokens": len(arrivals),
    }


def differing(reference, tokens, at_kill: list[int], from_old_group: list[int]):
    """Each request whose tokens differ from the fault-free run's: its index, the first
    position that differs, how many tokens it had when the rank was killed, and how many
    came from the old group (those after it came from the re-formed one)."""
    rows = []
    for index, (want, got) in enumerate(zip(reference, tokens, strict=True)):
        if want != got:
            pairs = enumerate(zip(want, got, strict=False))
            first = next((k for k, (a, b) in pairs if a != b), min(len(want), len(got)))
            rows.append({"request": index, "first_difference": first, "at_kill": at_kill[index],
                         "from_old_group": from_old_group[index],
                         "want": want, "got": got})  # fmt: skip
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = ("model", "DP", "fault", "mode", "start-up s", "fault->token s", "before",
              "during", "after", "resumed/open", "kept", "same")  # fmt: skip
    print(
        f"{header[0]:<7}{header[1]:>4}{header[2]:>6}{header[3]:>7}"
        + "".join(f"{h:>15}" for h in header[4:])
    )
    for row in rows:
        print(
            f"{row['model']:<7}{row['dp']:>4}{row['fault']:>6}{row['mode']:>7}"
            f"{row['startup_s']:>15.2f}"
            f"{row['fault_to_token_s']:>15.2f}{row['tok_s_before']:>15.1f}"
            f"{row['tok_s_during']:>15.1f}{row['tok_s_after']:>15.1f}"
            f"{str(row['resumed']) + '/' + str(row['unfinished']):>15}"
            f"{','.join(map(str, row['kept_ranks'])) or '-':>15}"
            f"{row['same_tokens']!s:>15}"
        )
    print("(before / during / after: tokens/s reaching the driver)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=(2, 4))
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=("small", "large"))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--faults", nargs="+", choices=("kill", "stop"), default=("kill",))
    parser.add_argument(
        "--modes", nargs="+", choices=("heal", "shrink"), default=("heal",),
        help="on_rank_failure: replace the rank, or go on with the survivors",
    )  # fmt: skip
    parser.add_argument(
        "--collective-timeout", type=float, default=4.0,
        help="the group's collective_timeout_s: how long a stopped rank's peers wait for it",
    )  # fmt: skip
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "lockstep" / "bench"))
    parser.add_argument("--out", default="bench_results/faults.json")
    args = parser.parse_args()
    os.environ.setdefault("LOCKSTEP_AUTOTUNE", "0")  # the rule's backends, no timing per start
    rows = []
    for name in args.models:
        for dp_size in args.dp:
            for fault in args.faults:
                for mode in args.modes:
                    rows.append(measure(name, dp_size, fault, mode, args))
                    print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    cpu = processor()
    print(f"processor: {describe(cpu)}; median fault->token "
          f"{statistics.median(r['fault_to_token_s'] for r in rows):.2f} s")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": vars(args), "processor": cpu, "models": MODELS, "rows": rows}
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
