"""The `lockstep` command line.

    lockstep run [--config YAML] [--launcher ray|torchrun|local] [--dp-size N]
                 [--prompts FILE.jsonl] [--output FILE.jsonl] [--max-tokens N] [--set k=v ...]
    lockstep make-model --arch qwen3_moe|mixtral --out DIR [...]
    lockstep serve [--config YAML] [--set k=v ...] [--host H] [--port N] [--api-key KEY]

With no config, `run` serves the built-in tiny Qwen3-MoE with DP=2 on a local Ray. Prompts
files hold one JSON object per line: {"prompt": "text"} or {"prompt_token_ids": [...]}, with
optional "max_tokens", "temperature", "top_p", "top_k", "seed", "dp_rank". Under torchrun every
process runs the same command; rank 0 prints and writes the output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="lockstep", description="Lockstep MoE serving runtime")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("run", help="run a generation job")
    run.add_argument("--config", help="YAML engine config (default: the built-in job)")
    run.add_argument("--launcher", choices=["ray", "torchrun", "local"])
    run.add_argument("--dp-size", type=int)
    run.add_argument("--prompts", help="JSONL file of prompts (default: built-in prompts)")
    run.add_argument("--output", help="write results here as JSONL, in input order")
    run.add_argument("--max-tokens", type=int, default=32)
    run.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting"
    )
    run.add_argument("--quiet", action="store_true", help="print only the summary table")
    commands.add_parser(
        "make-model",
        help="write a tiny random Hugging Face-format MoE checkpoint",
        add_help=False,  # the subcommand parses (and documents) its own options
    )
    from launcher.server import serve

    serve.add_arguments(
        commands.add_parser("serve", help="an OpenAI-compatible HTTP server for the DP group")
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "serve" and not rest:
        return serve_command(args)
    if args.command == "make-model":
        from dist_engine.models.make_model import main as make_model_main

        return make_model_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return run_job(args)
    except ValueError as error:
        print(f"lockstep: error: {error}", file=sys.stderr)
        return 2


def serve_command(args: argparse.Namespace) -> int:
    """`lockstep serve` (launcher/server/serve.py); with no --config, the built-in job's engine."""
    from launcher.server import serve

    builtin = argparse.Namespace(config=None, launcher=None, dp_size=None, set=[])
    try:
        return serve.main(args, lambda: _job_config(builtin))
    except ValueError as error:
        print(f"lockstep: error: {error}", file=sys.stderr)
        return 2


def run_job(args: argparse.Namespace) -> int:
    from launcher.llm import LLM
    from scheduler import SamplingParams

    config = _job_config(args)
    try:
        SamplingParams(max_tokens=args.max_tokens)
    except ValueError as error:
        raise ValueError(f"--max-tokens: {error}") from None
    prompts, sampling, pins = _load_prompts(args.prompts, args.max_tokens, config.parallel.dp_size)
    start = time.perf_counter()
    with LLM(config=config) as llm:
        ready = time.perf_counter()
        outputs = llm.generate(prompts, sampling, dp_rank=pins, use_tqdm=not args.quiet)
        done = time.perf_counter()
        exchange, backends = llm.moe_exchange, llm.backends
    if config.parallel.launcher == "torchrun" and int(os.environ.get("RANK", "0")) != 0:
        return 0
    if not args.quiet:
        for index, output in enumerate(outputs):
            shown = output.text if output.text is not None else output.output_token_ids
            print(f"[{index}] rank {output.dp_rank} {output.finish_reason}: {shown!r}")
    _print_summary(config, outputs, ready - start, done - ready, exchange, backends)
    if args.output:
        _write_outputs(Path(args.output), outputs)
    failed = [o for o in outputs if (o.finish_reason or "").startswith("error")]
    return 1 if failed else 0


def _job_config(args: argparse.Namespace):
    from dist_engine.engine.config import EngineConfig

    if args.config:
        if not Path(args.config).is_file():
            raise ValueError(f"--config {args.config}: no such file")
        config = EngineConfig.from_yaml(args.config)
    else:
        from launcher.builtin import builtin_model

        config = EngineConfig.from_dict(
            {
                "model": str(builtin_model()),
                "parallel": {"dp_size": 2, "launcher": "ray"},
                "scheduler": {"max_num_seqs": 32, "max_model_len": 1024, "num_blocks": 1024},
            }
        )
    overrides: dict[str, Any] = {}
    if args.launcher:
        overrides["launcher"] = args.launcher
    if args.dp_size is not None:  # so that --dp-size 0 is refused, not ignored
        overrides["dp_size"] = args.dp_size
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
        overrides[key.strip()] = yaml.safe_load(value)
    return config.with_overrides(**overrides) if overrides else config


def _load_prompts(path: str | None, max_tokens: int, dp_size: int):
    from scheduler import SamplingParams

    if path is None:
        from launcher.builtin import BUILTIN_PROMPTS

        count = len(BUILTIN_PROMPTS)
        return BUILTIN_PROMPTS, [SamplingParams(max_tokens=max_tokens)] * count, [None] * count
    if not Path(path).is_file():
        raise ValueError(f"--prompts {path}: no such file")
    prompts, params, pins = [], [], []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON: {error}") from None
        if not isinstance(item, dict) or ("prompt" in item) == ("prompt_token_ids" in item):
            raise ValueError(f"{path}:{number}: need exactly one of 'prompt', 'prompt_token_ids'")
        prompt = item.get("prompt", item.get("prompt_token_ids"))
        if "prompt" in item and not isinstance(prompt, str):
            raise ValueError(f"{path}:{number}: 'prompt' must be a string, got {prompt!r}")
        if "prompt_token_ids" in item and (
            not isinstance(prompt, list)
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            raise ValueError(
                f"{path}:{number}: 'prompt_token_ids' must be a list of ints, got {prompt!r}"
            )
        settings = {"max_tokens": max_tokens, **{k: item[k] for k in SAMPLING_KEYS if k in item}}
        try:
            params.append(SamplingParams(**settings))
        except ValueError as error:
            raise ValueError(f"{path}:{number}: {error}") from None
        pin = item.get("dp_rank")
        if pin is not None and (
            not isinstance(pin, int) or isinstance(pin, bool) or not 0 <= pin < dp_size
        ):
            raise ValueError(f"{path}:{number}: dp_rank must be in [0, {dp_size}), got {pin!r}")
        prompts.append(prompt)
        pins.append(pin)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts, params, pins


def _write_outputs(path: Path, outputs) -> None:
    with path.open("w") as out:
        for index, o in enumerate(outputs):
            record = {
                "index": index,
                "prompt_token_ids": o.prompt_token_ids,
                "output_token_ids": o.output_token_ids,
                "text": o.text,
                "finish_reason": o.finish_reason,
                "dp_rank": o.dp_rank,
            }
            out.write(json.dumps(record) + "\n")


def _print_summary(
    config, outputs, startup_s: float, generate_s: float, exchange: str, backends: str
) -> None:
    num_out = sum(len(o.output_token_ids) for o in outputs)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    ttft = sorted(o.ttft_s * 1e3 for o in outputs if o.ttft_s is not None)
    gaps = sorted(
        (b - a) * 1e3
        for o in outputs
        for a, b in zip(o.token_times, o.token_times[1:], strict=False)
    )
    rows = [
        ("launcher / DP", f"{config.parallel.launcher} / {config.parallel.dp_size}"),
        ("MoE exchange", exchange),
        ("backends", backends),
        ("requests", f"{len(outputs)}"),
        ("prompt tokens", f"{num_in}"),
        ("output tokens", f"{num_out}"),
        ("start-up", f"{startup_s:.2f} s"),
        ("generate", f"{generate_s:.2f} s"),
        ("output tokens/s", f"{num_out / generate_s:.1f}" if generate_s > 0 else "-"),
        ("TTFT p50 / p90", _percentiles(ttft, (50, 90), "ms")),
        ("inter-token p50 / p99", _percentiles(gaps, (50, 99), "ms")),
    ]
    width = max(len(name) for name, _ in rows)
    print("-" * (width + 24))
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print("-" * (width + 24))


def _percentiles(values: list[float], points: tuple[int, ...], unit: str) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.1f} {unit}"
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return " / ".join(f"{cuts[p - 1]:.1f}" for p in points) + f" {unit}"


if __name__ == "__main__":
    sys.exit(main())
