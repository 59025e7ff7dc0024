"""`/metrics` in vLLM's vocabulary under the `lockstep:` prefix, and the periodic stats line.

Names, types, label names and bucket boundaries follow vLLM's Prometheus logger
(vllm/v1/metrics/loggers.py) with `vllm:` read as `lockstep:`, so a dashboard written for
vLLM needs only its prefix changed (docs/grafana/lockstep.json is one). Every series carries
`model_name`; per-rank ones carry `engine`, the DP rank, as vLLM's DP does. Each server has
its own registry (several servers may share a process, as in tests).

Where the numbers come from:

- per request, measured at the server on the `engine` that served it (`RequestTimer`): time
  to first token from the request's arrival at the server, the gap between tokens (a report
  carrying several tokens counts its gap once per token, split evenly), end to end, decode
  time (first token to last) and time per output token; prompt and generation tokens (the
  prompt counts once its first token is out, as vLLM counts prefill work), per-request token
  counts, `max_tokens`, `n` and the finish reason (`request_success`);
- per rank, from the latest `RankStats` (`RankCollector`): running and waiting requests, KV
  usage and free blocks, preemptions, prefix-cache queries and hits, the lock-step
  counters: steps by kind, votes by attempt point, second votes; and with EPLB
  (`moe.enable_eplb`; vLLM exports none) balancedness per MoE layer, rebalances by outcome,
  and the last rebalance's bytes, staging and pause time;
- the server's own: open requests, health, HTTP responses by path and status;
- healing (`on_rank_failure: heal`; Lockstep's own, vLLM has none): failures of the group,
  recoveries, requests resumed, and how long each recovery took (failure seen to new group
  up, requests resubmitted).

Left out of vLLM's set: queue, prefill and inference time (a rank reports no time at which
a request was first scheduled, so time to first token cannot be split), tokens per step
(`iteration_tokens_total`: no per-step counts reach the server), `cache_config_info`, and
what Lockstep has no part for (speculative decoding, LoRA, multimodal and external prefix
caches, sleep mode, KV block residency sampling, NaN-corrupted requests).

`StatsLog` is vLLM's periodic log line (its `LoggingStatLogger`) for the whole group.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dist_engine.engine.stats import RankStats
from dist_engine.log import get_logger

log = get_logger()

# vLLM's boundaries, each for the same series there.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_GAP_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_N_BUCKETS = (1, 2, 5, 10, 20)
# A recovery is a group's start-up: model load dominates (seconds here, minutes for a large
# checkpoint).
_RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
# vLLM's finish reasons; Lockstep's others (a prompt that does not fit, a preempted request
# that was stopped, a failed group) are errors.
FINISHED_REASONS = ("stop", "length", "abort", "error")
# Paths with their own series; anything else is counted as "other" so that a scan of random
# URLs cannot grow the label set.
KNOWN_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
PREFIX = "lockstep:"
_LABELS = ["model_name", "engine"]


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's buckets for token counts."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class ServerMetrics:
    """The server's registry: per-request series (fed by `RequestTimer`), the ranks' series
    (`RankCollector`, from the stats handed to `render`) and the server's own."""

    def __init__(self, model_name: str, num_ranks: int, max_model_len: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.num_ranks = num_ranks
        # Plain totals beside the counters, for the stats line.
        self.num_requests = 0  # generation requests opened on a rank
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        token_buckets = buckets_1_2_5(max_model_len)

        def counter(name: str, doc: str) -> list:
            return self._per_engine(Counter(PREFIX + name, doc, _LABELS, registry=self.registry))

        def histogram(name: str, doc: str, buckets: tuple | list) -> list:
            metric = Histogram(PREFIX + name, doc, _LABELS, buckets=buckets, registry=self.registry)
            return self._per_engine(metric)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests prefilled")
        self.generation_tokens = counter("generation_tokens", "Output tokens sent to clients")
        success = Counter(
            PREFIX + "request_success",
            "Requests that ended, by finish reason (stop, length, abort: the client left, error)",
            [*_LABELS, "finished_reason"],
            registry=self.registry,
        )
        self.request_success = {
            reason: [success.labels(model_name, str(rank), reason) for rank in range(num_ranks)]
            for reason in FINISHED_REASONS
        }
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Time from a request's arrival at the server to its first output token",
            _TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between consecutive output tokens of a request",
            _TOKEN_GAP_BUCKETS,
        )
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "A request's decode time over its output tokens after the first",
            _TOKEN_GAP_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "Time from a request's arrival at the server to its end",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds",
            "Time from a request's first output token to its last (0 without tokens)",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Output tokens per request", token_buckets
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Output tokens of a request's longest choice (one choice per request here)",
            token_buckets,
        )
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens a request ran with", token_buckets
        )
        self.request_params_n = histogram(
            "request_params_n", "The n request parameter (always 1 here)", _N_BUCKETS
        )
        self.http_responses = Counter(
            PREFIX + "http_responses",
            "HTTP responses by path and status code",
            ["model_name", "path", "status"],
            registry=self.registry,
        )
        self.requests_open = Gauge(
            PREFIX + "requests_open",
            "Requests opened on a rank and not yet ended by it",
            ["model_name"],
            registry=self.registry,
        ).labels(model_name)
        self.healthy = Gauge(
            PREFIX + "healthy",
            "1 while the group serves, 0 when draining or failed",
            ["model_name"],
            registry=self.registry,
        ).labels(model_name)

        def group_counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(
                model_name
            )

        self.rank_failures = group_counter(
            "rank_failures", "Failures of the DP group: a rank died or stopped answering"
        )
        self.recoveries = group_counter(
            "recoveries", "Failed groups replaced by a new one of the same size (healed)"
        )
        self.resumed_requests = group_counter(
            "resumed_requests", "Unfinished requests resubmitted to a re-formed group"
        )
        self.live_ranks = Gauge(
            PREFIX + "live_ranks",
            "DP ranks in the group now serving (fewer than the DP size while it runs shrunk "
            "onto the survivors of a failure)",
            ["model_name"],
            registry=self.registry,
        ).labels(model_name)
        self.live_ranks.set(num_ranks)
        self.recovery_seconds = Histogram(
            PREFIX + "recovery_seconds",
            "Time from a group failure being seen to its replacement serving the resubmitted "
            "requests",
            ["model_name"],
            buckets=_RECOVERY_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.ranks = RankCollector(model_name)
        self.registry.register(self.ranks)

    def _per_engine(self, metric: Counter | Histogram) -> list:
        # Every rank's series exists from the start, as in vLLM: a rate over a series that
        # appears mid-window misses its first increments.
        return [metric.labels(self.model_name, str(rank)) for rank in range(self.num_ranks)]

    def rank_failed(self) -> None:
        self.rank_failures.inc()

    def recovered(self, seconds: float, num_resumed: int) -> None:
        self.recoveries.inc()
        self.resumed_requests.inc(num_resumed)
        self.recovery_seconds.observe(seconds)

    def resized(self, num_live: int) -> None:
        self.live_ranks.set(num_live)

    def response(self, path: str, status: int) -> None:
        path = path if path in KNOWN_PATHS else "other"
        self.http_responses.labels(self.model_name, path, str(status)).inc()

    def render(self, stats: list[RankStats], num_open: int, healthy: bool) -> bytes:
        self.ranks.snapshot = list(stats)
        self.requests_open.set(num_open)
        self.healthy.set(1 if healthy else 0)
        return generate_latest(self.registry)


class RequestTimer:
    """One request's timings and counts, observed into ``metrics`` as its tokens reach the
    server. Times are ``time.monotonic()`` seconds."""

    def __init__(
        self,
        metrics: ServerMetrics,
        engine: int,
        arrival: float,
        num_prompt_tokens: int,
        max_tokens: int,
    ) -> None:
        self.metrics = metrics
        self.engine = engine
        self.arrival = arrival
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.num_generation_tokens = 0
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.ended = False
        metrics.num_requests += 1

    def tokens(self, num_tokens: int, now: float) -> None:
        """``num_tokens`` output tokens reached the server at ``now``."""
        if not num_tokens:
            return
        metrics, engine = self.metrics, self.engine
        metrics.generation_tokens[engine].inc(num_tokens)
        metrics.num_generation_tokens += num_tokens
        if self.first_token_time is None:
            self.first_token_time = now
            metrics.time_to_first_token[engine].observe(now - self.arrival)
            metrics.prompt_tokens[engine].inc(self.num_prompt_tokens)
            metrics.num_prompt_tokens += self.num_prompt_tokens
            num_gaps, gap = num_tokens - 1, 0.0
        else:
            assert self.last_token_time is not None
            num_gaps, gap = num_tokens, (now - self.last_token_time) / num_tokens
        for _ in range(num_gaps):
            metrics.inter_token_latency[engine].observe(gap)
        self.last_token_time = now
        self.num_generation_tokens += num_tokens

    def finish(self, reason: str, now: float) -> None:
        """The request ended (once; later calls do nothing); ``reason`` is one of
        `FINISHED_REASONS`."""
        if self.ended:
            return
        self.ended = True
        metrics, engine = self.metrics, self.engine
        first, last = self.first_token_time, self.last_token_time
        decode_s = last - first if first is not None and last is not None else 0.0
        num_after_first = self.num_generation_tokens - 1
        metrics.request_success[reason][engine].inc()
        metrics.e2e_request_latency[engine].observe(now - self.arrival)
        metrics.request_decode_time[engine].observe(decode_s)
        metrics.request_time_per_output_token[engine].observe(
            decode_s / num_after_first if num_after_first > 0 else 0.0
        )
        metrics.request_prompt_tokens[engine].observe(self.num_prompt_tokens)
        metrics.request_generation_tokens[engine].observe(self.num_generation_tokens)
        metrics.request_max_num_generation_tokens[engine].observe(self.num_generation_tokens)
        metrics.request_params_max_tokens[engine].observe(self.max_tokens)
        metrics.request_params_n[engine].observe(1)


class RankCollector(Collector):
    """Per-rank series from the latest `RankStats` snapshot, labelled by `engine`."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: list[RankStats] = []

    def describe(self) -> list[Metric]:
        return []  # series appear once the first scrape has fetched the ranks' stats

    def collect(self) -> Iterator[Metric]:
        for name, doc, attribute in _RANK_GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=_LABELS)
            for rank in self.snapshot:
                family.add_metric(self._labels(rank), getattr(rank, attribute))
            yield family
        for name, doc, attribute in _RANK_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=_LABELS)
            for rank in self.snapshot:
                family.add_metric(self._labels(rank), getattr(rank, attribute))
            yield family
        steps = CounterMetricFamily(
            PREFIX + "steps",
            "Steps by kind: prefill, mixed (prompt chunks and decode tokens), decode, "
            "placeholder (a forward with no tokens, to join the group's all-to-alls), "
            "known_empty (no forward: the vote proved the group empty)",
            labels=[*_LABELS, "kind"],
        )
        votes = CounterMetricFamily(
            PREFIX + "votes",
            "Step votes (vote 1) by the attempt point that called them",
            labels=[*_LABELS, "point"],
        )
        for rank in self.snapshot:
            for kind, count in rank.num_steps.items():
                steps.add_metric([*self._labels(rank), kind], count)
            for point, count in rank.num_votes.items():
                votes.add_metric([*self._labels(rank), point], count)
        yield steps
        yield votes
        yield from self._eplb()

    def _eplb(self) -> Iterator[Metric]:
        """EPLB's series, for the ranks that run it (engine/eplb.py)."""
        ranks = [rank for rank in self.snapshot if rank.experts is not None]
        balance = GaugeMetricFamily(
            PREFIX + "eplb_balancedness",
            "Mean over max tokens per rank of each MoE layer (0-based among the MoE layers) "
            "over the window measured at the last EPLB decision (1: perfect balance)",
            labels=[*_LABELS, "layer"],
        )
        outcomes = CounterMetricFamily(
            PREFIX + "eplb_rebalances",
            "EPLB decisions by outcome: adopted, skipped (would not gain enough), failed (a "
            "rank's staging failed; the old placement stayed)",
            labels=[*_LABELS, "outcome"],
        )
        last = {
            name: GaugeMetricFamily(PREFIX + name, doc, labels=_LABELS)
            for name, doc in _EPLB_LAST.items()
        }
        for rank in ranks:
            labels, experts = self._labels(rank), rank.experts
            for layer, value in enumerate(experts.balancedness):
                balance.add_metric([*labels, str(layer)], value)
            for outcome, count in (
                ("adopted", experts.num_rebalances),
                ("skipped", experts.num_skipped),
                ("failed", experts.num_failed),
            ):
                outcomes.add_metric([*labels, outcome], count)
            last["eplb_last_rebalance_bytes"].add_metric(labels, experts.last_bytes)
            last["eplb_last_rebalance_staging_seconds"].add_metric(labels, experts.last_staging_s)
            last["eplb_last_rebalance_pause_seconds"].add_metric(labels, experts.last_pause_s)
        if ranks:
            yield balance
            yield outcomes
            yield from last.values()

    def _labels(self, rank: RankStats) -> list[str]:
        return [self.model_name, str(rank.dp_rank)]


_RANK_GAUGES = (
    ("num_requests_running", "Requests running: decoding, or being prefilled", "num_running"),
    (
        "num_requests_waiting",
        "Requests queued, or a prompt part-way through its chunks",
        "num_waiting",
    ),
    ("kv_cache_usage_perc", "Fraction of the rank's usable KV blocks in use (1: all)", "kv_usage"),
    ("kv_cache_free_blocks", "Free (or evictable) KV blocks", "num_free_blocks"),
)
_RANK_COUNTERS = (
    ("num_preemptions", "Sequences preempted for lack of KV blocks", "num_preemptions"),
    (
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache (0 without prefix caching)",
        "num_prefix_cache_query_tokens",
    ),
    (
        "prefix_cache_hits",
        "Prompt tokens found in the prefix cache",
        "num_prefix_cache_hit_tokens",
    ),
    ("second_votes", "Vote 2s: did any rank assemble a prefill batch", "num_second_votes"),
)


_EPLB_LAST = {
    "eplb_last_rebalance_bytes": "Expert weights the rank wrote into its slots at the last "
    "adopted rebalance",
    "eplb_last_rebalance_staging_seconds": "The rank's background staging time of the last "
    "adopted rebalance",
    "eplb_last_rebalance_pause_seconds": "Time the rank's steps paused for the last adopted "
    "rebalance (its decision and its commit)",
}


class StatsLog:
    """vLLM's periodic stats line for the whole DP group: prompt and generation throughput
    over the interval, running and waiting requests, mean KV usage, preemptions in the
    interval, and the prefix-cache hit rate since start (when the ranks cache prefixes).

    `observe` is handed every fresh `RankStats` list; it logs at most once per
    ``interval_s``, and only for an interval with traffic (a request opened, a token out, a
    request running or waiting) or the first one after, so the return to idle shows.
    """

    def __init__(self, metrics: ServerMetrics, interval_s: float, now: float) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self._last_time = now
        self._last_totals = self._totals()
        self._last_preemptions = 0
        self._busy = False

    def _totals(self) -> tuple[int, int, int]:
        metrics = self.metrics
        return metrics.num_requests, metrics.num_prompt_tokens, metrics.num_generation_tokens

    def observe(self, stats: list[RankStats], now: float) -> str | None:
        """Log (and return) the line if an interval with traffic has passed; else None."""
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return None
        totals = self._totals()
        num_requests, num_prompt, num_generated = (
            now_total - before for now_total, before in zip(totals, self._last_totals, strict=True)
        )
        preemptions = sum(rank.num_preemptions for rank in stats)
        preempted = max(0, preemptions - self._last_preemptions)  # a replaced rank restarts
        running = sum(rank.num_running for rank in stats)
        waiting = sum(rank.num_waiting for rank in stats)
        busy = bool(num_requests or num_prompt or num_generated or running or waiting)
        was_busy, self._busy = self._busy, busy
        self._last_time, self._last_totals = now, totals
        self._last_preemptions = preemptions
        if not busy and not was_busy:
            return None
        ranks = sorted(rank.dp_rank for rank in stats) or list(range(self.metrics.num_ranks))
        parts = [
            f"Avg prompt throughput: {num_prompt / elapsed:.1f} tokens/s",
            f"Avg generation throughput: {num_generated / elapsed:.1f} tokens/s",
            f"Running: {running} reqs",
            f"Waiting: {waiting} reqs",
        ]
        if preempted:
            parts.append(f"Preemptions: {preempted}")
        if stats:
            usage = sum(rank.kv_usage for rank in stats) / len(stats)
            parts.append(f"KV cache usage: {usage * 100:.1f}%")
        queries = sum(rank.num_prefix_cache_query_tokens for rank in stats)
        if queries:
            hits = sum(rank.num_prefix_cache_hit_tokens for rank in stats)
            parts.append(f"Prefix cache hit rate: {hits / queries * 100:.1f}%")
        line = f"{_ranks_name(ranks)}: " + ", ".join(parts)
        log.info("%s", line)
        return line


def _ranks_name(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"DP rank {ranks[0]}"
    return f"DP ranks {ranks[0]}-{ranks[-1]}"
