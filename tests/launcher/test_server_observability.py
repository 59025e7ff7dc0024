"""What an operator reads: the Grafana dashboard's queries against the series the server
exports, and the per-request series' edge cases."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from dist_engine.engine.engine import StepTrace
from dist_engine.engine.stats import RankStats, StepCounters
from launcher.server.metrics import RequestTimer, ServerMetrics
from scheduler import AttemptPoint, StepKind

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "lockstep.json"
# Crude, as PromQL goes, but enough to find every series a query names (digits for "e2e").
METRIC_NAME = re.compile(r"lockstep:[a-z0-9_]+")


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
