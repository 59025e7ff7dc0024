"""Host work per decode step: what a step costs outside its forward, at 64 and 256 sequences.

    .venv/bin/python scripts/bench_decode_host.py [--seqs 64 256] [--steps 50] [--out FILE.json]
        [--prompt-len 200] [--output-len 0] [--stream] [--penalties]

(from the repository root; not part of the test suite)

A CUDA graph replays the forward, so what is left of a decode step is the host's own work:
the scheduler's decode assembly and output accounting, the runner's inputs (token ids, slots,
block tables into the persistent buffers, `DecodeInputs.fill`) and the sampler. This runs the
real Scheduler and ModelRunner on a tiny model (2 layers: its forward is small, and is timed
apart) with every sequence decoding, and prints, per batch size, the median milliseconds per
step of each part and of the forward, as a table and as JSON. Contexts start at 200 tokens
(`--prompt-len`) in blocks of 16 and grow by one per step, so block boundaries are crossed.
`--stream`: every request streams, and "stream outputs" (part of the host total then) times
what the engine does for a streamed request each step: its output of the step's new tokens
(`Request.delta`, the `RequestOutput` a front end or the output channel gets), and "output
channel" what a Ray rank's writer and its driver do with those outputs (launcher/
output_channel.py: the frame's encoding, its decoding into outputs again; on two processes
there, timed one after the other here; not in the host total). `--output-len N`: every
sequence starts with N output tokens already made (resumed, as a healed request is: they are
prefilled with its prompt), so a long output's per-step cost shows.
`--penalties`: every request samples at temperature 1.0 with repetition, frequency and
presence penalties (vLLM's, as an OpenAI client sets them), so "sampling" counts the penalties
over each sequence's prompt and outputs every step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import processor  # noqa: E402

from dist_engine.backends import Backends  # noqa: E402
from dist_engine.engine.request import Request, resume_sequence  # noqa: E402
from dist_engine.engine.runner import ModelRunner  # noqa: E402
from dist_engine.models.loader import load_model  # noqa: E402
from dist_engine.models.make_model import make_tiny_checkpoint  # noqa: E402
from launcher.output_channel import Decoder, Encoder  # noqa: E402
from scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence  # noqa: E402

BLOCK_SIZE = 16
PROMPT_LEN = 200
PARTS = (
    "schedule",
    "runner inputs",
    "forward",
    "sampling",
    "process outputs",
    "stream outputs",
    "output channel",
)


PENALTIES = dict(temperature=1.0, repetition_penalty=1.1, frequency_penalty=0.5,
                 presence_penalty=0.5)  # fmt: skip


def measure(
    model,
    num_seqs: int,
    num_steps: int,
    prompt_len: int = PROMPT_LEN,
    stream: bool = False,
    penalties: bool = False,
    output_len: int = 0,
) -> dict[str, float]:
    # Resumed sequences are prefilled one or a few a step, those in decoding meanwhile.
    max_tokens = output_len + num_steps + (num_seqs + 8 if output_len else 2)
    longest = prompt_len + max_tokens + 8
    config = SchedulerConfig(
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(num_seqs * prompt_len, prompt_len + output_len),
        max_model_len=longest,
        block_size=BLOCK_SIZE,
        num_blocks=num_seqs * (-(-longest // BLOCK_SIZE)) + 2,
        # Long resumed prompts go in first, a step each, rather than a chunk of each mixed
        # into decode steps (whose tokens would end the first sequences before the last start).
        **(dict(prefill_deadline_steps=0, mixed_steps=False) if output_len else {}),
    )
    model.attach_kv_cache(model.new_kv_cache(config.num_blocks, BLOCK_SIZE))
    runner = ModelRunner(
        model, BLOCK_SIZE, max_model_len=config.max_model_len, max_num_seqs=num_seqs
    )
    timings: dict[str, list[float]] = {part: [] for part in PARTS}
    forward_ms: list[float] = []
    sample_ms: list[float] = []
    decode_step, sample_all = runner.decode_step, runner._sample_all

    def timed_forward(*args):
        start = time.perf_counter()
        out = decode_step(*args)
        forward_ms.append((time.perf_counter() - start) * 1e3)
        return out

    def timed_sample(*args):
        start = time.perf_counter()
        out = sample_all(*args)
        sample_ms.append((time.perf_counter() - start) * 1e3)
        return out

    runner.decode_step, runner._sample_all = timed_forward, timed_sample
    sched = Scheduler(config)
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, **(PENALTIES if penalties else {})
    )
    requests = {}
    encoder, decoder = Encoder(), Decoder()
    for index in range(num_seqs):
        prompt = [(index * 31 + i) % 300 + 1 for i in range(prompt_len)]
        seq = Sequence(f"r{index}", prompt, params)
        if output_len:
            resume_sequence(seq, [(index * 7 + i) % 300 + 1 for i in range(output_len)])
        sched.add_sequence(seq)
        requests[seq.request_id] = Request.admit(seq, stream=stream)
    while True:  # the prompts, until every sequence decodes
        outputs = sched.schedule()
        sched.process_outputs(outputs, runner.execute(outputs, requests)[0])
        streamed = [request.delta(0) for request in requests.values()]  # None: not streamed
        decoder.decode(encoder.payload(("out", [o for o in streamed if o is not None])))
        if not outputs.is_prefill and outputs.num_seqs == num_seqs:
            break
    forward_ms.clear()
    sample_ms.clear()
    for _ in range(num_steps):
        start = time.perf_counter()
        outputs = sched.schedule()
        scheduled = time.perf_counter()
        assert not outputs.is_prefill and outputs.num_seqs == num_seqs
        tokens = runner.execute(outputs, requests)[0]
        executed = time.perf_counter()
        sched.process_outputs(outputs, tokens)
        done = time.perf_counter()
        deltas = [request.delta(0) for request in requests.values()] if stream else []
        streamed = time.perf_counter()
        if stream:  # (a sequence ended by this step has no delta: None)
            decoder.decode(encoder.payload(("out", [d for d in deltas if d is not None])))
        channel = time.perf_counter()
        inside = forward_ms[-1] + sample_ms[-1]
        timings["schedule"].append((scheduled - start) * 1e3)
        timings["runner inputs"].append((executed - scheduled) * 1e3 - inside)
        timings["forward"].append(forward_ms[-1])
        timings["sampling"].append(sample_ms[-1])
        timings["process outputs"].append((done - executed) * 1e3)
        timings["stream outputs"].append((streamed - done) * 1e3)
        timings["output channel"].append((channel - streamed) * 1e3)
    result = {part: statistics.median(values) for part, values in timings.items()}
    # The output channel's work is another thread's and another process's, not the step's.
    apart = ("forward", "output channel")
    result["host total"] = sum(v for part, v in result.items() if part not in apart)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    parser.add_argument("--output-len", type=int, default=0, help="output tokens at the start")
    parser.add_argument("--stream", action="store_true", help="every request streams")
    parser.add_argument("--penalties", action="store_true", help="every request penalised")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint("qwen3_moe", Path(tmp), seed=1, num_layers=2)
        model = load_model(model_dir, backends=Backends.all("torch"))
        results = {
            n: measure(
                model, n, args.steps, args.prompt_len, args.stream, args.penalties, args.output_len
            )
            for n in args.seqs
        }
    columns = [*PARTS, "host total"]
    print(f"{'ms per decode step (median)':<28}" + "".join(f"{n:>10} seqs" for n in results))
    for part in columns:
        print(f"{part:<28}" + "".join(f"{results[n][part]:>15.3f}" for n in results))
    report = {
        "processor": processor(),
        "steps": args.steps,
        "threads": args.threads,
        "block_size": BLOCK_SIZE,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "stream": args.stream,
        "penalties": args.penalties,
    }
    report["ms_per_step"] = {str(n): values for n, values in results.items()}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
