"""The `lockstep` command line, in vLLM's spelling.

    lockstep run   [MODEL] [--config YAML] [--set KEY=VALUE ...] [settings flags]
                   [--prompts FILE.jsonl] [--output FILE.jsonl] [--max-tokens N] [--quiet]
    lockstep serve [MODEL] [--config YAML] [--set KEY=VALUE ...] [settings flags]
    lockstep make-model --arch MODEL_TYPE --out DIR [...]   (any registered model_type)

Every config key is a flag (launcher/flags.py: `--max-model-len`, `-dp/--data-parallel-size`,
`--served-model-name`, ...); the YAML gives the base, `--set` overrides it and the flags
override both. MODEL is a checkpoint directory or a Hugging Face hub id (org/name, with
--revision), resolved through the hub's cache before any rank starts. With neither MODEL nor
--config, `run` serves the built-in tiny Qwen3-MoE with DP=2 on a local Ray. Under torchrun
every process runs the same command; rank 0 prints and writes the output.

A job torchrun restarts (`--max-restarts`, after a rank died) starts again with the results
its `--output` already holds: those that finished are kept and their prompts skipped (a rank
death under torchrun cannot be healed from inside: no process outlives the group).

This module imports nothing heavy at the top (no torch): `lockstep --help` answers at once.
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

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")
PROMPTS_HELP = """prompts file (JSONL): one JSON object per line, with exactly one of
  "prompt": "text"                 (needs the model's tokenizer.json)
  "prompt_token_ids": [1, 2, 3]
and optionally
  "max_tokens": int >= 1           (default: --max-tokens)
  "temperature": float >= 0        (below 1e-5: greedy)
  "top_p": float in (0, 1]         (1: off)
  "top_k": int >= 0                (0: off)
  "seed": int in [0, 2**64 - 1]    (default: none, a random seed per request)
  "ignore_eos": bool               (default false)
  "dp_rank": int in [0, dp_size)   (pin the request to a rank; default: round robin)
A line without temperature, top_p or top_k takes the model's generation_config.json values
for them, and vLLM's (temperature 1.0, the filters off) where it has none; its EOS ids stop
the request unless it sets ignore_eos (--generation-config: auto, vllm for none, or a DIR).

output file (JSONL): one record per request, written and flushed as each finishes, with
"index" (its line among the prompts), "prompt_token_ids", "output_token_ids", "text",
"finish_reason", "detail" and "dp_rank"; once every request has finished the file is
rewritten in input order. Under torchrun, an attempt torchrun restarted (--max-restarts) keeps
the records that finished by stop or length and runs only the other prompts. Exit status: 0
if every request finished by stop or length, 1 if any failed or was refused (the group
failing included, naming the rank), 2 for bad input, 130 when interrupted (the file keeps
every result finished so far).
"""
# Finish reasons of a request that got what it asked for; anything else makes the exit code 1.
SUCCESSFUL = ("stop", "length")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, commands = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "make-model":
        from dist_engine.models.make_model import main as make_model_main

        return make_model_main(rest)
    if rest:
        from launcher import flags

        flags.unknown_arguments_error(commands[args.command], rest)
    if args.command == "serve":
        return serve_command(args)
    from dist_engine.errors import LockstepError

    try:
        return run_job(args)
    except (ValueError, FileNotFoundError) as error:  # bad input: config, model, prompts
        print(f"lockstep: error: {error}", file=sys.stderr)
        return 2
    except LockstepError as error:  # the group could not start or failed
        print(f"lockstep: error: {error}", file=sys.stderr)
        return 1


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `lockstep` parser and its subcommands' parsers, by name."""
    from launcher import flags
    from launcher.server import serve

    parser = argparse.ArgumentParser(
        prog="lockstep", description="Lockstep MoE serving runtime", allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="run a generation job",
        epilog=PROMPTS_HELP,
        formatter_class=_Formatter,
        allow_abbrev=False,
    )
    job = run.add_argument_group("the job")
    job.add_argument("--prompts", help="JSONL file of prompts (default: built-in prompts)")
    job.add_argument("--output", help="write results here as JSONL (see below)")
    job.add_argument("--max-tokens", type=int, default=32, help="per request, unless it says")
    job.add_argument("--quiet", action="store_true", help="print only the summary table")
    flags.add_common_arguments(run, server=False)
    make_model = commands.add_parser(
        "make-model",
        help="write a tiny random Hugging Face-format MoE checkpoint",
        add_help=False,  # the subcommand parses (and documents) its own options
    )
    serve_parser = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server for the DP group",
        description=serve.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    serve.add_arguments(serve_parser)
    return parser, {"run": run, "make-model": make_model, "serve": serve_parser}


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option; the epilog (the file formats) kept as written."""


def serve_command(args: argparse.Namespace) -> int:
    """`lockstep serve` (launcher/server/serve.py); with neither MODEL nor --config, the
    built-in job's engine."""
    from launcher.server import serve

    try:
        return serve.main(args, builtin_job)
    except (ValueError, FileNotFoundError) as error:  # bad input: config, model, hub id
        print(f"lockstep: error: {error}", file=sys.stderr)
        return 2


def run_job(args: argparse.Namespace) -> int:
    from dist_engine.errors import LockstepError
    from launcher.generation_config import load_generation_defaults
    from launcher.llm import LLM, started_by_torchrun
    from scheduler import SamplingParams

    config = job_config(args)
    if config.parallel.launcher != "torchrun" and started_by_torchrun():
        raise ValueError(
            f"torchrun started this process, but the config's parallel.launcher is "
            f"{config.parallel.launcher!r}: every torchrun process would run the whole job; "
            "use a torchrun config (configs/torchrun.yaml) or run without torchrun"
        )
    # A hub id becomes its snapshot directory, pinned to its commit, before any rank starts.
    config = config.with_local_model()
    try:
        SamplingParams(max_tokens=args.max_tokens)
    except ValueError as error:
        raise ValueError(f"--max-tokens: {error}") from None
    defaults = load_generation_defaults(config.generation_config, config.model)
    prompts, sampling, pins = _load_prompts(
        args.prompts, args.max_tokens, config.parallel.dp_size, defaults
    )
    if args.output:
        check_output_path(Path(args.output))  # before any rank starts
    writes = config.parallel.launcher != "torchrun" or int(os.environ.get("RANK", "0")) == 0
    restarted = config.parallel.launcher == "torchrun" and restarted_by_torchrun()
    kept: dict[int, str] = {}
    if args.output and writes and restarted and Path(args.output).is_file():
        kept = finished_records(Path(args.output), len(prompts))
    writer = ResultWriter(Path(args.output), kept) if args.output and writes else None
    outputs: dict[int, Any] = {}
    group_error: LockstepError | None = None
    start = time.perf_counter()
    try:
        with LLM(config=config) as llm:
            ready = time.perf_counter()
            exchange, backends = llm.moe_exchange, llm.backends
            if restarted:  # every rank skips what rank 0 (the writer) found
                skipped = set(llm.client.broadcast_json(sorted(kept)))
                if writes:
                    check_kept_prompts(kept, prompts, llm.tokenizer, args.output)
                    print(f"lockstep: restarted by torchrun: {len(skipped)} of {len(prompts)} "
                          f"results are kept from {args.output}", file=sys.stderr)  # fmt: skip
            else:
                skipped = set()
            todo = [i for i in range(len(prompts)) if i not in skipped]
            try:
                for position, completion in llm.generate_as_completed(
                    [prompts[i] for i in todo],
                    [sampling[i] for i in todo],
                    dp_rank=[pins[i] for i in todo],
                    use_tqdm=not args.quiet,
                ):
                    index = todo[position]
                    outputs[index] = completion
                    if writer is not None:
                        writer.write(index, completion)
            except LockstepError as error:
                group_error = error
            done = time.perf_counter()
    except KeyboardInterrupt:
        if writer is not None:
            writer.close()
            print(
                f"lockstep: interrupted; {len(outputs)} of {len(prompts)} results are in "
                f"{args.output}",
                file=sys.stderr,
            )
        return 130
    if not writes:
        return 0 if group_error is None else 1
    ordered = [outputs[i] for i in sorted(outputs)]
    if not args.quiet:
        for index, output in zip(sorted(outputs), ordered, strict=True):
            shown = output.text if output.text is not None else output.output_token_ids
            detail = f" ({output.detail})" if output.detail else ""
            print(f"[{index}] rank {output.dp_rank} {output.finish_reason}{detail}: {shown!r}")
    _print_summary(config, ordered, ready - start, done - ready, exchange, backends)
    if writer is not None:
        writer.close(in_input_order=len(outputs) + len(kept) == len(prompts))
    if group_error is not None:
        print(f"lockstep: error: {group_error}", file=sys.stderr)
        return 1
    return 0 if all(o.finish_reason in SUCCESSFUL for o in ordered) else 1


def check_output_path(path: Path) -> None:
    """Refuse an --output the job could not write, before it starts: a directory, a missing
    parent directory, or no permission to write it."""
    if path.is_dir():
        raise ValueError(f"--output {path}: is a directory")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"--output {path}: directory {parent} does not exist")
    if not os.access(path if path.exists() else parent, os.W_OK):
        raise ValueError(f"--output {path}: not writable")


class ResultWriter:
    """--output as JSONL: each result appended and flushed as it finishes (a crash or Ctrl-C
    keeps everything finished so far), then rewritten in input order once all are in.
    ``kept``: records of an earlier attempt (index -> line), written first, as they were."""

    def __init__(self, path: Path, kept: dict[int, str] | None = None) -> None:
        self.path = path
        self._file: Any = None
        self._records: dict[int, str] = dict(kept or {})

    def write(self, index: int, output: Any) -> None:
        if self._file is None:
            self._file = self.path.open("w")
            self._file.write("".join(line + "\n" for line in self._records.values()))
        line = json.dumps(_record(index, output))
        self._records[index] = line
        self._file.write(line + "\n")
        self._file.flush()

    def close(self, in_input_order: bool = False) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if in_input_order:
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text("".join(self._records[i] + "\n" for i in sorted(self._records)))
            partial.replace(self.path)


def restarted_by_torchrun() -> bool:
    """Whether torchrun restarted this job after a failure (`--max-restarts`)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def finished_records(path: Path, num_prompts: int) -> dict[int, str]:
    """The results an earlier attempt of the job wrote to ``path`` that finished by stop or
    length: prompt index -> the line as written. A last line cut short (the attempt died while
    writing it) is left out; any other line that is not such a record is refused, naming it."""
    lines = path.read_text().splitlines()
    kept: dict[int, str] = {}
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(
                f"--output {path}:{number}: not JSON, so not this job's results"
            ) from None
        index = record.get("index") if isinstance(record, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < num_prompts:
            raise ValueError(
                f"--output {path}:{number}: a result needs an index in [0, {num_prompts}) (the "
                f"prompts' lines), got {str(index)[:40]!r}"
            )
        if record.get("finish_reason") in SUCCESSFUL:
            kept[index] = line
    return kept


def check_kept_prompts(kept: dict[int, str], prompts: list, tokenizer: Any, output: str) -> None:
    """Refuse to keep results of other prompts: a kept record's prompt tokens must be its
    prompt's (text prompts encoded with the job's tokenizer)."""
    for index, line in kept.items():
        prompt = prompts[index]
        tokens = prompt if not isinstance(prompt, str) else tokenizer.encode(prompt).ids
        if json.loads(line).get("prompt_token_ids") != list(tokens):
            raise ValueError(
                f"--output {output}: the result for prompt {index} has other prompt tokens than "
                "that prompt: the file is not this job's; remove it or choose another --output"
            )


def job_config(args: argparse.Namespace):
    """The `run` command line's EngineConfig: --config (or MODEL, or the built-in job), then
    --set, then the flags."""
    from launcher import flags

    config, _ = flags.load_settings(args, server=False, builtin=builtin_job)
    return config


def builtin_job() -> dict[str, Any]:
    """The built-in job's settings (configs/builtin.yaml says the same), its model made on
    first use."""
    from launcher.builtin import builtin_model

    return {
        "model": str(builtin_model()),
        "parallel": {"dp_size": 2, "launcher": "ray"},
        "scheduler": {"max_num_seqs": 32, "max_model_len": 1024, "num_blocks": 1024},
    }


def _load_prompts(path: str | None, max_tokens: int, dp_size: int, defaults: Any):
    """(prompts, their SamplingParams, their dp_rank pins); ``defaults``: the
    GenerationDefaults of the sampling fields a line leaves out."""
    if path is None:
        from launcher.builtin import BUILTIN_PROMPTS

        count = len(BUILTIN_PROMPTS)
        params = defaults.sampling_params(max_tokens=max_tokens)
        return BUILTIN_PROMPTS, [params] * count, [None] * count
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
            params.append(defaults.sampling_params(**settings))
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


def _record(index: int, o: Any) -> dict[str, Any]:
    return {
        "index": index,
        "prompt_token_ids": o.prompt_token_ids,
        "output_token_ids": o.output_token_ids,
        "text": o.text,
        "finish_reason": o.finish_reason,
        "detail": o.detail,
        "dp_rank": o.dp_rank,
    }


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
