"""Online serving benchmark: Poisson arrivals at several rates against `lockstep serve`.

Requests go through real HTTP (aiohttp, streaming `/v1/completions`), as a user's would. Each
request has a seeded random token-id prompt of `--prompt-len` tokens and asks for exactly
`--max-tokens` tokens (`ignore_eos`). Arrivals are a Poisson process of the given rate
(requests/s; `inf` sends them all at once). Measured at the client, per rate:

- output tok/s: every request's output tokens over the time from the first send to the last
  token; req/s likewise;
- TTFT: from sending a request to its first token; ITL: the gap between consecutive tokens of
  a request (a chunk with several tokens counts its gap once per token, split evenly);
- p50 / p99 of both, in ms; failed requests, if any.

Two ways to run it:

    # against a server that is already up (label the results with what it runs)
    python scripts/bench_serving.py --url http://127.0.0.1:8000 --label vote \
        --rates 2,4,8,inf --num-requests 64

    # start `lockstep serve` once per sync policy on a free port, bench it, stop it (SIGTERM)
    python scripts/bench_serving.py --config job.yaml --sync-policies deadline,vote,every_step \
        --set dp_size=2 --rates 2,4,8,inf --num-requests 64

Writes a table to stdout, `--out` (JSON, with the settings and the machine) and `--plot`
(PNG: throughput, TTFT and ITL against the offered rate, one line per label).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp
from machine import processor


@dataclass
class RequestResult:
    sent: float
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0
    error: str | None = None


@dataclass
class RateResult:
    label: str
    rate: float  # offered requests/s (inf: all at once)
    num_requests: int
    num_failed: int
    duration_s: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], start_at: float
) -> RequestResult:
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    result = RequestResult(sent=time.perf_counter())
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                count = sum(len(c.get("token_ids", [])) for c in chunk["choices"])
                if count:
                    now = time.perf_counter()
                    if result.token_times:  # split a multi-token chunk's gap evenly
                        last = result.token_times[-1]
                        step = (now - last) / count
                        result.token_times += [last + step * (i + 1) for i in range(count)]
                    else:
                        result.token_times += [now] * count
                    result.num_tokens += count
    except aiohttp.ClientError as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


async def run_rate(args: argparse.Namespace, url: str, model: str, rate: float) -> list:
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(args.min_token_id, args.max_token_id) for _ in range(args.prompt_len)]
        for _ in range(args.num_requests)
    ]
    offsets, clock = [], 0.0
    for _ in prompts:
        offsets.append(clock)
        if math.isfinite(rate):
            clock += rng.expovariate(rate)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # no client-side cap on concurrency
    async with aiohttp.ClientSession(
        headers=headers, timeout=timeout, connector=connector
    ) as session:
        base = {
            "model": model,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        warm = await one_request(session, url, {**base, "prompt": prompts[0]}, 0.0)
        if warm.error:
            raise SystemExit(f"the warm-up request failed: {warm.error}")
        start = time.perf_counter()
        return await asyncio.gather(
            *(
                one_request(session, url, {**base, "prompt": p}, start + offset)
                for p, offset in zip(prompts, offsets, strict=True)
            )
        )


def summarize(label: str, rate: float, results: list[RequestResult]) -> RateResult:
    done = [r for r in results if r.error is None and r.token_times]
    ttft = [(r.token_times[0] - r.sent) * 1e3 for r in done]
    itl = [(b - a) * 1e3 for r in done for a, b in pairwise(r.token_times)]
    e2e = [(r.token_times[-1] - r.sent) * 1e3 for r in done]
    first = min((r.sent for r in results), default=0.0)
    last = max((r.token_times[-1] for r in done), default=first)
    duration = max(last - first, 1e-9)
    return RateResult(
        label=label,
        rate=rate,
        num_requests=len(results),
        num_failed=len(results) - len(done),
        duration_s=duration,
        output_tokens_per_s=sum(r.num_tokens for r in done) / duration,
        requests_per_s=len(done) / duration,
        ttft_ms=percentiles(ttft),
        itl_ms=percentiles(itl),
        e2e_ms=percentiles(e2e),
    )


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": math.nan, "p99": math.nan, "mean": math.nan}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": at(0.50), "p99": at(0.99), "mean": statistics.fmean(values)}


def served_model(url: str, api_key: str | None) -> str:
    async def fetch() -> str:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with (
            aiohttp.ClientSession(headers=headers) as session,
            session.get(f"{url}/v1/models") as response,
        ):
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]

    return asyncio.run(fetch())


def bench_server(args: argparse.Namespace, url: str, label: str) -> list[RateResult]:
    model = served_model(url, args.api_key)
    rows = []
    for rate in args.rates:
        results = asyncio.run(run_rate(args, url, model, rate))
        row = summarize(label, rate, results)
        rows.append(row)
        print_row(row)
    return rows


def start_server(args: argparse.Namespace, policy: str) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "launcher.cli", "serve", "--port", "0"]
    if args.config:
        command += ["--config", args.config]
    for item in [*args.set, f"sync_policy={policy}"]:
        command += ["--set", item]
    env = dict(os.environ)
    if args.api_key:
        env["LOCKSTEP_API_KEY"] = args.api_key
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("lockstep serve: listening on "):
            return process, line.split()[-1]
    raise SystemExit(f"lockstep serve exited with {process.wait()} before it listened")


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


HEADER = (
    f"{'label':<12} {'rate':>6} {'ok/all':>8} {'out tok/s':>10} {'req/s':>7} "
    f"{'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8}  (ms)"
)


def print_row(row: RateResult) -> None:
    rate = "inf" if math.isinf(row.rate) else f"{row.rate:g}"
    ok = f"{row.num_requests - row.num_failed}/{row.num_requests}"
    print(
        f"{row.label:<12} {rate:>6} {ok:>8} {row.output_tokens_per_s:>10.1f} "
        f"{row.requests_per_s:>7.2f} {row.ttft_ms['p50']:>9.1f} {row.ttft_ms['p99']:>8.1f} "
        f"{row.itl_ms['p50']:>8.1f} {row.itl_ms['p99']:>8.1f}",
        flush=True,
    )


def plot(rows: list[RateResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    finite = [r.rate for r in rows if math.isfinite(r.rate)]
    inf_x = max(finite, default=1.0) * 2  # where "all at once" is drawn
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for index, label in enumerate(dict.fromkeys(r.label for r in rows)):
        color = f"C{index}"  # one colour per label; p50 solid, p99 dashed
        mine = sorted((r for r in rows if r.label == label), key=lambda r: r.rate)
        xs = [r.rate if math.isfinite(r.rate) else inf_x for r in mine]
        rates = [r.output_tokens_per_s for r in mine]
        axes[0].plot(xs, rates, color=color, marker="o", label=label)
        for key, style in (("p50", "-"), ("p99", "--")):
            for ax, metric in ((axes[1], "ttft_ms"), (axes[2], "itl_ms")):
                values = [getattr(r, metric)[key] for r in mine]
                ax.plot(xs, values, style, color=color, marker="o", label=f"{label} {key}")
    titles = ("output tokens/s", "TTFT (ms)", "inter-token latency (ms)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel(f"offered rate, requests/s (rightmost = all at once, drawn at {inf_x:g})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _plain(value: Any) -> Any:
    """Strict JSON: infinite rates as "inf", missing percentiles as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def parse_rates(text: str) -> list[float]:
    rates = [math.inf if x.strip() == "inf" else float(x) for x in text.split(",")]
    if any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 or inf, got {text!r}")
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--config", help="start `lockstep serve --config CONFIG` per sync policy ('' = built-in)"
    )
    parser.add_argument("--label", default="server", help="with --url: what the server runs")
    parser.add_argument("--sync-policies", default="deadline,vote,every_step")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--api-key", default=os.environ.get("LOCKSTEP_API_KEY"))
    parser.add_argument("--rates", type=parse_rates, default=parse_rates("2,4,8,inf"))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-token-id", type=int, default=3)
    parser.add_argument("--max-token-id", type=int, default=259, help="exclusive")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=Path("bench_results/serving.json"))
    parser.add_argument("--plot", type=Path, default=Path("bench_results/serving.png"))
    args = parser.parse_args()

    print(HEADER)
    rows: list[RateResult] = []
    if args.url:
        rows += bench_server(args, args.url.rstrip("/"), args.label)
    else:
        for policy in args.sync_policies.split(","):
            process, url = start_server(args, policy)
            try:
                rows += bench_server(args, url, policy)
            finally:
                stop_server(process)
    record = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {
            "processor": processor(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "results": [asdict(r) for r in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(_plain(record), indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    try:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    except ImportError:
        print("matplotlib is missing (pip install -e '.[bench]'): no plot", file=sys.stderr)
    return 1 if any(r.num_failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
