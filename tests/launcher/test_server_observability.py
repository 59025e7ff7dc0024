"""What an operator reads: the Grafana dashboard's queries against the series the server
exports, the periodic stats line, the access log, and their settings.

The pure parts run without a server; two small servers (launcher local, DP=1) show the log
lines appearing, moving and staying quiet as configured.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerThread

from dist_engine.engine.config import EngineConfig
from dist_engine.engine.engine import StepTrace
from dist_engine.engine.stats import (
    RankExpertStats,
    RankStats,
    StepCounters,
    as_replacement,
    group_expert_stats,
)
from dist_engine.log import LOGGER_NAME
from launcher.server.config import ServerConfig
from launcher.server.metrics import RequestTimer, ServerMetrics, StatsLog
from scheduler import AttemptPoint, StepKind

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "lockstep.json"
# Crude, as PromQL goes, but enough to find every series a query names (digits for "e2e").
METRIC_NAME = re.compile(r"lockstep:[a-z0-9_]+")
STATS_LINE = re.compile(
    r"DP rank 0: Avg prompt throughput: (?P<prompt>[\d.]+) tokens/s, "
    r"Avg generation throughput: (?P<generation>[\d.]+) tokens/s, "
    r"Running: (?P<running>\d+) reqs, Waiting: (?P<waiting>\d+) reqs, "
    r"KV cache usage: (?P<kv>[\d.]+)%(, Prefix cache hit rate: (?P<hit>[\d.]+)%)?$"
)
ACCESS_LINE = re.compile(
    r'^127\.0\.0\.1 "(?P<request>[A-Z]+ \S+) HTTP/1\.1" (?P<status>\d{3}) [\d.]+s$'
)


def rank_stats(dp_rank: int = 0, **values) -> RankStats:
    fields = {
        "num_running": 0,
        "num_waiting": 0,
        "num_free_blocks": 100,
        "num_usable_blocks": 100,
        "kv_usage": 0.0,
        **values,
    }
    return RankStats(dp_rank=dp_rank, **fields)


# -- the dashboard ------------------------------------------------------------------------------
def queries(node) -> list[str]:
    """Every PromQL string in a dashboard: panel targets and variable queries."""
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)]
        if isinstance(node.get("query"), str) and node.get("type") != "datasource":
            found.append(node["query"])
        return found + [q for value in node.values() for q in queries(value)]
    if isinstance(node, list):
        return [q for item in node for q in queries(item)]
    return []


def test_the_dashboard_queries_only_series_the_server_exports():
    metrics = ServerMetrics("tiny", num_ranks=2, max_model_len=1024)
    timer = RequestTimer(metrics, engine=1, arrival=0.0, num_prompt_tokens=7, max_tokens=4)
    timer.tokens(1, 0.1)
    timer.tokens(3, 0.4)
    timer.finish("length", 0.5)
    metrics.response("/v1/completions", 200)
    steps = {"prefill": 1, "mixed": 0, "decode": 3, "placeholder": 2, "known_empty": 1}
    stats = [rank_stats(rank, num_steps=steps, num_votes={"any": 1}) for rank in (0, 1)]
    text = metrics.render(stats, num_open=0, healthy=True).decode()
    exported = {
        sample.name for family in text_string_to_metric_families(text) for sample in family.samples
    }

    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for query in queries(dashboard) for name in METRIC_NAME.findall(query)}
    assert used <= exported, sorted(used - exported)
    # It shows what a vLLM dashboard shows, and the lock-step counters.
    assert {
        "lockstep:time_to_first_token_seconds_bucket",
        "lockstep:inter_token_latency_seconds_bucket",
        "lockstep:e2e_request_latency_seconds_bucket",
        "lockstep:prompt_tokens_total",
        "lockstep:generation_tokens_total",
        "lockstep:num_requests_running",
        "lockstep:num_requests_waiting",
        "lockstep:kv_cache_usage_perc",
        "lockstep:steps_total",
        "lockstep:votes_total",
    } <= used
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert all(panel["targets"] and panel["datasource"]["uid"] for panel in panels)
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert {"DS_PROMETHEUS", "model_name", "engine"} <= variables


# -- per-request series, without a server -------------------------------------------------------
def test_a_request_that_ends_before_its_first_token_counts_no_prompt_and_no_latency():
    metrics = ServerMetrics("tiny", num_ranks=1, max_model_len=64)
    timer = RequestTimer(metrics, engine=0, arrival=10.0, num_prompt_tokens=5, max_tokens=8)
    timer.finish("abort", 12.0)
    timer.finish("abort", 13.0)  # a second end is no end
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(metrics.render([], 0, True).decode())
        for sample in family.samples
        if sample.labels.get("finished_reason", "abort") == "abort"
    }
    assert values["lockstep:request_success_total"] == 1
    assert values["lockstep:e2e_request_latency_seconds_sum"] == 2.0
    assert values["lockstep:time_to_first_token_seconds_count"] == 0
    assert values["lockstep:prompt_tokens_total"] == 0  # never prefilled, as far as we know
    assert values["lockstep:request_prompt_tokens_sum"] == 5
    assert values["lockstep:request_decode_time_seconds_sum"] == 0
    assert values["lockstep:request_decode_time_seconds_count"] == 1
    assert (metrics.num_requests, metrics.num_prompt_tokens) == (1, 0)


def test_step_counters_count_the_prompt_tokens_a_rank_computes():
    counters = StepCounters()
    for kind, num_seqs, num_tokens, num_decode in [
        (StepKind.PREFILL, 2, 30, 0),  # two prompt chunks
        (StepKind.DECODE, 2, 2, 0),
        (StepKind.PREFILL, 3, 12, 2),  # mixed: a 10-token chunk and two decode tokens
        (StepKind.PREFILL, 0, 0, 0),  # a placeholder
    ]:
        trace = StepTrace(0, kind, AttemptPoint.NONE, None, None, num_seqs, num_tokens,
                          0.0, 0.0, 0.0, 0.0, num_decode)  # fmt: skip
        counters.record(trace)
    assert counters.num_prefill_tokens == 40


# -- the stats line, without a server -----------------------------------------------------------
def test_eplb_series_and_the_groups_expert_stats():
    """Each rank's EPLB state under lockstep:eplb_*, per layer and by outcome; a rank without
    EPLB adds none. The group's view sums the bytes and takes the slowest staging."""
    experts = [
        RankExpertStats(
            balancedness=[0.5, 0.75],
            num_rebalances=2,
            num_skipped=3,
            num_failed=1,
            last_adopted_step=40,
            last_staging_s=staging,
            last_pause_s=0.01,
            last_bytes=num_bytes,
        )
        for staging, num_bytes in ((0.2, 1000), (0.3, 500))
    ]
    stats = [rank_stats(rank, experts=e) for rank, e in enumerate(experts)]
    metrics = ServerMetrics("tiny", num_ranks=2, max_model_len=64)
    text = metrics.render(stats, num_open=0, healthy=True).decode()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "eplb" in sample.name
    }

    def value(name: str, engine: int, **labels: str) -> float:
        key = {"model_name": "tiny", "engine": str(engine), **labels}
        return samples[(f"lockstep:{name}", tuple(sorted(key.items())))]

    assert value("eplb_balancedness", 1, layer="1") == 0.75
    assert value("eplb_rebalances_total", 0, outcome="adopted") == 2
    assert value("eplb_rebalances_total", 0, outcome="skipped") == 3
    assert value("eplb_rebalances_total", 1, outcome="failed") == 1
    assert value("eplb_last_rebalance_bytes", 1) == 500
    assert value("eplb_last_rebalance_staging_seconds", 0) == 0.2
    assert value("eplb_last_rebalance_pause_seconds", 1) == 0.01
    plain = metrics.render([rank_stats(0)], num_open=0, healthy=True).decode()
    assert "eplb" not in plain
    group = group_expert_stats(stats)
    assert group.enabled and group.balancedness == [0.5, 0.75] and group.num_rebalances == 2
    assert (group.last_rebalance_bytes, group.last_rebalance_staging_s) == (1500, 0.3)
    assert group.last_rebalance_step == 40 and len(group.ranks) == 2
    assert not group_expert_stats([rank_stats(0)]).enabled


def test_a_replacement_reports_the_groups_eplb_state_without_the_kept_ranks_costs():
    """A replacement joining a re-formed group takes a kept rank's EPLB stats
    (`as_replacement`): the group's view then counts the last rebalance's bytes and times
    once, as the kept rank paid them, not twice."""
    kept = RankExpertStats(
        balancedness=[0.5, 0.75],
        num_rebalances=2,
        last_adopted_step=40,
        last_balancedness_after=[0.9, 0.95],
        last_staging_s=0.2,
        last_pause_s=0.01,
        last_bytes=1000,
        last_staged_bytes=600,
        last_received_bytes=400,
        expert_source="peer",
    )
    joined = as_replacement(kept)
    assert (joined.balancedness, joined.num_rebalances) == ([0.5, 0.75], 2)
    assert (joined.last_adopted_step, joined.last_balancedness_after) == (40, [0.9, 0.95])
    group = group_expert_stats([rank_stats(0, experts=kept), rank_stats(1, experts=joined)])
    assert (group.last_rebalance_bytes, group.last_received_bytes) == (1000, 400)
    assert (group.last_staged_bytes, group.last_rebalance_staging_s) == (600, 0.2)
    assert group.last_rebalance_pause_s == 0.01 and group.num_rebalances == 2


def test_the_stats_line_reports_each_busy_interval_and_one_idle_one():
    metrics = ServerMetrics("tiny", num_ranks=2, max_model_len=64)
    log = StatsLog(metrics, interval_s=10.0, now=0.0)
    idle = [rank_stats(0), rank_stats(1)]
    assert log.observe(idle, 10.0) is None  # nothing happened: no line
    timer = RequestTimer(metrics, engine=1, arrival=11.0, num_prompt_tokens=30, max_tokens=50)
    timer.tokens(20, 12.0)
    busy = [
        rank_stats(0, kv_usage=0.1, num_preemptions=2, num_prefix_cache_query_tokens=30),
        rank_stats(1, num_running=3, num_waiting=1, kv_usage=0.3, num_preemptions=1),
    ]
    assert log.observe(busy, 15.0) is None  # not an interval yet
    assert log.observe(busy, 20.0) == (
        "DP ranks 0-1: Avg prompt throughput: 3.0 tokens/s, Avg generation throughput: 2.0 "
        "tokens/s, Running: 3 reqs, Waiting: 1 reqs, Preemptions: 3, KV cache usage: 20.0%, "
        "Prefix cache hit rate: 0.0%"
    )
    timer.tokens(30, 25.0)
    timer.finish("length", 25.0)
    done = [
        rank_stats(0, num_preemptions=2, num_prefix_cache_query_tokens=60,
                   num_prefix_cache_hit_tokens=15),
        rank_stats(1, num_preemptions=1),
    ]  # fmt: skip
    line = log.observe(done, 30.0)
    assert "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 3.0 tokens/s" in line
    assert "Preemptions" not in line and line.endswith("Prefix cache hit rate: 25.0%")
    # The first idle interval still reports (the return to zero shows); later ones do not.
    assert log.observe(done, 40.0).startswith(
        "DP ranks 0-1: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0"
    )
    assert log.observe(done, 50.0) is None
    assert log.observe(done, 60.0) is None


# -- settings -----------------------------------------------------------------------------------
def test_the_log_settings_are_checked():
    assert (ServerConfig().stats_log_interval_s, ServerConfig().access_log) == (10.0, False)
    for bad in (-1, "often", float("nan"), True):
        with pytest.raises(ValueError, match=r"server.stats_log_interval_s must be a number"):
            ServerConfig(stats_log_interval_s=bad)
    with pytest.raises(ValueError, match=r"server.access_log must be true or false, got 'yes'"):
        ServerConfig(access_log="yes")
    assert ServerConfig.from_dict({"stats_log_interval_s": 0, "access_log": True}).access_log


# -- a server's log -----------------------------------------------------------------------------
class Lines(logging.Handler):
    """The lockstep logger's messages, by logger name (it does not propagate to the root)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def of(self, name: str) -> list[str]:
        return [r.getMessage() for r in list(self.records) if r.name == name]

    def stats(self) -> list[re.Match]:
        return [m for m in map(STATS_LINE.match, self.of(LOGGER_NAME)) if m]


@pytest.fixture
def lines():
    handler = Lines()
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def start_server(model_dir: str, **server: object) -> ServerThread:
    engine = EngineConfig.from_dict({
        "model": model_dir,
        "dtype": "float32",
        "parallel": {"dp_size": 1, "launcher": "local", "threads_per_rank": 1},
        "scheduler": {"max_model_len": 256, "num_blocks": 128, "block_size": 8,
                      "enable_prefix_caching": True},
    })  # fmt: skip
    return ServerThread(engine, ServerConfig(port=0, **server))


def complete(server: ServerThread, prompt: list[int], max_tokens: int) -> int:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


PROMPT = list(range(1, 41))  # five blocks of 8: a repeat finds four in the prefix cache


def test_the_stats_line_moves_with_traffic_and_the_access_log_has_a_line_per_request(
    model_dir, lines
):
    server = start_server(model_dir, stats_log_interval_s=0.2, access_log=True)
    try:
        for _ in range(3):
            assert complete(server, PROMPT, 12) == 200
        assert status_of(f"{server.url}/health") == 200
        assert status_of(f"{server.url}/no/such/path?x=%0Aforged") == 404
        # The traffic's interval shows tokens; the first interval after it, zeros; then quiet.
        wait_for(lambda: any(float(m["generation"]) > 0 for m in lines.stats()))
        wait_for(lambda: float(lines.stats()[-1]["generation"]) == 0.0)
        quiet = len(lines.stats())
        time.sleep(2.5)  # two of the monitor's ticks with nothing to report
        assert len(lines.stats()) == quiet
    finally:
        server.stop()
    stats = lines.stats()
    moving = [m for m in stats if float(m["generation"]) > 0]
    assert sum(float(m["prompt"]) for m in moving) > 0
    assert all(m["kv"] is not None and m["hit"] is not None for m in stats)
    # Three prompts of 40 tokens, two of which found 32 cached: 64 of 120.
    assert float(stats[-1]["hit"]) == pytest.approx(100 * 64 / 120, abs=0.05)
    assert (stats[-1]["running"], stats[-1]["waiting"]) == ("0", "0")

    access = [ACCESS_LINE.match(line) for line in lines.of(f"{LOGGER_NAME}.access")]
    assert all(access), lines.of(f"{LOGGER_NAME}.access")
    requests = [(m["request"], m["status"]) for m in access]
    assert requests == [("POST /v1/completions", "200")] * 3 + [
        ("GET /health", "200"),
        ("GET /no/such/path?x=%0Aforged", "404"),  # the raw target: no line break to forge
    ]


def test_no_log_lines_when_both_are_off(model_dir, lines):
    server = start_server(model_dir, stats_log_interval_s=0)
    try:
        assert server.server.frontend.on_stats is None
        assert complete(server, PROMPT, 8) == 200
        assert status_of(f"{server.url}/health") == 200
        time.sleep(2.2)  # two of the monitor's ticks
    finally:
        server.stop()
    assert lines.of(f"{LOGGER_NAME}.access") == []
    assert lines.stats() == []
