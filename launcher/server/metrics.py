"""`/metrics`: the server's request latencies and the ranks' own counters, for Prometheus.

Each server has its own registry (several servers may share a process, as in tests). Latencies
are measured where the client feels them, at the server: time to first token from the moment
the request arrived, the gap between tokens (a report carrying several tokens counts its gap
once per token, split evenly), and end to end. The per-rank series come from `RankStats`,
fetched when `/metrics` is scraped.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dist_engine.engine.stats import RankStats

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_TOKEN_GAP_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 2.5,
)  # fmt: skip
# Paths with their own series; anything else is counted as "other" so that a scan of random
# URLs cannot grow the label set.
KNOWN_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model"]
        self.time_to_first_token = Histogram(
            "lockstep_time_to_first_token_seconds",
            "Time from a request's arrival to its first output token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "lockstep_inter_token_latency_seconds",
            "Time between consecutive output tokens of a request",
            labels,
            buckets=_TOKEN_GAP_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "lockstep_e2e_request_latency_seconds",
            "Time from a request's arrival to its last token (or its end)",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "lockstep_prompt_tokens", "Prompt tokens of admitted requests", labels,
            registry=self.registry,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "lockstep_generation_tokens", "Output tokens sent to clients", labels,
            registry=self.registry,
        )  # fmt: skip
        self.requests_finished = Counter(
            "lockstep_requests_finished",
            "Requests that ended, by endpoint and finish reason (stop, length, abort, error)",
            ["model", "endpoint", "finish_reason"],
            registry=self.registry,
        )
        self.http_responses = Counter(
            "lockstep_http_responses",
            "HTTP responses by path and status code",
            ["path", "status"],
            registry=self.registry,
        )
        self.requests_open = Gauge(
            "lockstep_requests_open",
            "Requests admitted and not yet ended by their rank",
            registry=self.registry,
        )
        self.healthy = Gauge(
            "lockstep_healthy", "1 while the group serves, 0 when draining or failed",
            registry=self.registry,
        )  # fmt: skip
        self.ranks = RankCollector()
        self.registry.register(self.ranks)

    def response(self, path: str, status: int) -> None:
        self.http_responses.labels(path if path in KNOWN_PATHS else "other", str(status)).inc()

    def render(self, stats: list[RankStats], num_open: int, healthy: bool) -> bytes:
        self.ranks.snapshot = list(stats)
        self.requests_open.set(num_open)
        self.healthy.set(1 if healthy else 0)
        return generate_latest(self.registry)


class RankCollector(Collector):
    """Per-rank series from the latest `RankStats` snapshot."""

    def __init__(self) -> None:
        self.snapshot: list[RankStats] = []

    def describe(self) -> list[Metric]:
        return []  # series appear once the first scrape has fetched the ranks' stats

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot
        gauges = {
            "running": ("Requests running (decoding or being prefilled)", "num_running"),
            "waiting": ("Requests queued, not yet running", "num_waiting"),
            "kv_usage_ratio": ("Fraction of the rank's usable KV blocks in use", "kv_usage"),
            "kv_free_blocks": ("Free (or evictable) KV blocks", "num_free_blocks"),
        }
        for name, (doc, attribute) in gauges.items():
            family = GaugeMetricFamily(f"lockstep_rank_{name}", doc, labels=["dp_rank"])
            for rank in stats:
                family.add_metric([str(rank.dp_rank)], getattr(rank, attribute))
            yield family
        steps = CounterMetricFamily(
            "lockstep_rank_steps",
            "Steps by kind: prefill, decode, placeholder (a forward with no tokens, to join the "
            "group's all-to-alls), known_empty (no forward: the vote proved the group empty)",
            labels=["dp_rank", "kind"],
        )
        votes = CounterMetricFamily(
            "lockstep_rank_votes",
            "Step votes (vote 1) by the attempt point that called them",
            labels=["dp_rank", "point"],
        )
        counters = {
            "second_votes": ("Vote 2s: did any rank assemble a prefill batch", "num_second_votes"),
            "preemptions": ("Sequences preempted for lack of KV blocks", "num_preemptions"),
            "prefix_cache_hit_tokens": (
                "Prompt tokens admitted with their KV already in the prefix cache",
                "num_prefix_cache_hit_tokens",
            ),
        }
        for rank in stats:
            for kind, count in rank.num_steps.items():
                steps.add_metric([str(rank.dp_rank), kind], count)
            for point, count in rank.num_votes.items():
                votes.add_metric([str(rank.dp_rank), point], count)
        yield steps
        yield votes
        for name, (doc, attribute) in counters.items():
            family = CounterMetricFamily(f"lockstep_rank_{name}", doc, labels=["dp_rank"])
            for rank in stats:
                family.add_metric([str(rank.dp_rank)], getattr(rank, attribute))
            yield family
