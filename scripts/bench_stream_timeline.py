"""Where a stream's inter-token gap comes from: each token's time at the engine and at the client.

    .venv/bin/python scripts/bench_stream_timeline.py [--rate 4] [--num-prompts 64]
        [--input-len 128] [--output-len 64] [--launcher local] [--dp 1] [--threads-per-rank N]
        [--out bench_results/stream_timeline.json]

(from the repository root, with the package installed editable)

`lockstep serve`'s parts in this process: an `LLM` on the built-in tiny Qwen3-MoE (float32, as
scripts/bench_clients.py runs it; `--launcher local`, the default, puts the engine on a thread
of this process, `ray` puts each of `--dp` ranks in a process of its own) and a
`LockstepServer` over its client on an event loop of its own. A client in another process
streams `/v1/completions` with `return_token_ids` (random token prompts of `--input-len`,
`--output-len` tokens each, EOS ignored, Poisson arrivals at `--rate` requests/s, `inf`: all at
once) and records when each chunk arrives and how many token ids it carries. The engine records
when each token was sampled (`RequestOutput.token_times`, time.monotonic() on the rank, which is
this host's clock for every process). Joined per request, per token:

  engine gap      — between a token's sampling and the previous one's (the step time as the
                    request sees it);
  client gap      — between chunks, as `vllm bench serve` counts ITL (every chunk after the
                    first);
  delivery        — from a chunk's last token's sampling to the chunk's arrival (the server,
                    the event loop, HTTP);
  tokens / chunk  — more than one means the server sent tokens together.

and per request, the first token's way: intake (the client's send → the request's arrival at
its rank), rank (arrival → the first token's sampling: queueing and prefill) and first
delivery (sampling → the first chunk at the client).

If the client's gap follows the engine's, the gap is the step time; if it exceeds it, the
delivery adds it. Figures are this host's under whatever else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from machine import processor

ROOT = Path(__file__).resolve().parents[1]


# -- the client (its own process) -------------------------------------------------------------
async def _client(spec: dict[str, Any]) -> list[dict[str, Any]]:
    import aiohttp  # the server's own HTTP library, so nothing more to install

    rng = random.Random(spec["seed"])
    records: list[dict[str, Any]] = []

    async def one(index: int, prompt: list[int], session: aiohttp.ClientSession) -> None:
        body = {
            "model": "tiny", "prompt": prompt, "max_tokens": spec["output_len"], "stream": True,
            "ignore_eos": True, "return_token_ids": True, "temperature": 0.0,
        }  # fmt: skip
        chunks: list[tuple[float, int]] = []
        sent = time.monotonic()
        async with session.post(f"{spec['url']}/v1/completions", json=body) as reply:
            reply.raise_for_status()
            async for raw in reply.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                choices = event.get("choices") or []
                if not choices:
                    continue
                count = len(choices[0].get("token_ids") or [])
                if count or choices[0].get("text"):
                    chunks.append((time.monotonic(), count))
        records.append({"index": index, "sent": sent, "chunks": chunks})

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        for index, prompt in enumerate(spec["prompts"]):
            tasks.append(asyncio.ensure_future(one(index, prompt, session)))
            if spec["rate"] != "inf":
                await asyncio.sleep(rng.expovariate(float(spec["rate"])))
        await asyncio.gather(*tasks)
    return records


def client_main() -> None:
    spec = json.loads(sys.stdin.read())
    print(json.dumps(asyncio.run(_client(spec))))


# -- the server and the engine (this process) -----------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    from launcher import LLM
    from launcher.builtin import BUILTIN_MODEL, builtin_model
    from launcher.server import frontend
    from launcher.server.app import LockstepServer
    from launcher.server.config import ServerConfig

    finals: dict[tuple[int, ...], Any] = {}
    original_next = frontend.RequestStream.next

    async def next_recording(self):  # the engine's record of each request, as it ends
        output = await original_next(self)
        if output.finished:
            finals[tuple(output.prompt_token_ids)] = output
        return output

    frontend.RequestStream.next = next_recording
    rng = random.Random(0)
    model = str(builtin_model())
    llm = LLM(
        model=model, launcher=args.launcher, dp_size=args.dp, dtype="float32", max_model_len=1024,
        threads_per_rank=args.threads_per_rank,
    )  # fmt: skip
    vocab = BUILTIN_MODEL["vocab_size"]
    prompts = [
        [rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    server = LockstepServer(llm.client, llm.config, ServerConfig(port=0, served_model_name="tiny"))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    port = asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
    spec = {
        "url": f"http://127.0.0.1:{port}", "prompts": prompts, "rate": args.rate,
        "output_len": args.output_len, "seed": 1,
    }  # fmt: skip
    try:
        warm = dict(spec, prompts=prompts[:4], rate="inf")
        _run_client(warm)  # the first requests pay for lazy set-up
        finals.clear()
        load = os.getloadavg()[0]
        records = _run_client(spec)
        load = max(load, os.getloadavg()[0])
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        llm.shutdown()
    return analyse(records, prompts, finals, load)


def _run_client(spec: dict[str, Any]) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, __file__, "--client"], input=json.dumps(spec), capture_output=True,
        text=True, timeout=1800,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the client failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def analyse(records, prompts, finals, load: float) -> dict[str, Any]:
    engine_gaps, client_gaps, delivery, per_chunk = [], [], [], []
    intake, rank, first_delivery = [], [], []
    for record in records:
        final = finals[tuple(prompts[record["index"]])]
        times = final.token_times
        intake.append(final.arrival_time - record["sent"])
        rank.append(times[0] - final.arrival_time)
        first_delivery.append(record["chunks"][0][0] - times[0])
        engine_gaps += [b - a for a, b in itertools.pairwise(times)]
        arrivals = [at for at, _ in record["chunks"]]
        client_gaps += [b - a for a, b in itertools.pairwise(arrivals)]
        seen = 0
        for at, count in record["chunks"]:
            if count:
                seen += count
                delivery.append(at - times[seen - 1])
                per_chunk.append(count)
    return {
        "requests": len(records),
        "load_average": load,
        "engine_gap_ms": _percentiles(engine_gaps),
        "client_gap_ms": _percentiles(client_gaps),
        "delivery_ms": _percentiles(delivery),
        "intake_ms": _percentiles(intake),
        "rank_to_first_token_ms": _percentiles(rank),
        "first_delivery_ms": _percentiles(first_delivery),
        "chunks_with_more_than_one_token": sum(1 for c in per_chunk if c > 1),
        "chunks": len(per_chunk),
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    """values in seconds → p50 / p90 / p99 (bench_e2e's rule) and the mean, in ms. Imported
    here, by the server side only: the client process stays free of torch."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_e2e import percentiles

    ms = [1e3 * value for value in values]
    return {**percentiles(ms), "mean": statistics.fmean(ms)} if ms else {}


def main() -> None:
    if "--client" in sys.argv:
        client_main()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="4")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--launcher", default="local", choices=("local", "ray"))
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--threads-per-rank", type=int, help="default: the launcher's")
    parser.add_argument("--out", default="bench_results/stream_timeline.json")
    args = parser.parse_args()
    result = run(args)
    print(f"{args.launcher} DP={args.dp}, rate {args.rate}/s, {result['requests']} requests of "
          f"{args.input_len} -> {args.output_len} tokens, load average "
          f"{result['load_average']:.2f}")  # fmt: skip
    print("| ms | p50 | p90 | p99 | mean |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in ("engine_gap_ms", "client_gap_ms", "delivery_ms", "intake_ms",
                 "rank_to_first_token_ms", "first_delivery_ms"):  # fmt: skip
        row = result[name]
        print(f"| {name} | " + " | ".join(f"{row[k]:.1f}" for k in ("p50", "p90", "p99", "mean"))
              + " |")  # fmt: skip
    print(f"chunks with more than one token: {result['chunks_with_more_than_one_token']} of "
          f"{result['chunks']}")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "processor": processor(), **result}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
