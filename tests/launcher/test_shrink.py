"""A group that goes on without a lost rank, with real processes: it shrinks onto its
survivors (they take over the lost rank's experts, reading them from the checkpoint), every
request ends exactly once with the tokens of the fault-free run, and a group under
`on_rank_failure: heal` grows back to its full size once a replacement can start.

- `shrink`, DP=4 on one node: DP rank 2 SIGKILLed mid-run through `LLM.generate_stream`,
  then DP rank 3 SIGSTOPped in the group of three under the server with concurrent
  streaming `openai` clients: 4 -> 3 -> 2 ranks.
- `heal`, DP=2 on two Ray nodes (STRICT_SPREAD), through the server with concurrent
  streaming `openai` clients: one node is removed mid-run, so no replacement can be placed;
  the survivor serves alone, then a new node joins and the group grows back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from launcher import LLM, SamplingParams
from launcher.server.app import LockstepServer
from launcher.server.config import ServerConfig

pytestmark = pytest.mark.multirank

TIMEOUT_S = 4  # parallel.collective_timeout_s: a stopped rank's peers give up after this
SETTINGS = dict(
    threads_per_rank=1, max_model_len=192, num_blocks=256, block_size=4, max_num_seqs=8,
    collective_timeout_s=TIMEOUT_S, max_recoveries_per_hour=20,
)  # fmt: skip
PROMPTS = [[(7 * i + 3 * j) % 380 + 1 for j in range(4 + i % 5)] for i in range(12)]
# Greedy and seeded sampling alternate; seeded ones keep their seed whichever rank runs them.
PARAMS = [
    SamplingParams(max_tokens=96, ignore_eos=True, temperature=float(i % 2), seed=50 + i)
    for i in range(len(PROMPTS))
]
PROMPT_INDEX = {tuple(prompt): index for index, prompt in enumerate(PROMPTS)}


def test_a_dp4_group_shrinks_twice_and_every_request_ends_unchanged(model_dir):
    """`on_rank_failure: shrink`. Through `generate_stream`: DP rank 2 SIGKILLed once every
    request has tokens. Then through the server, eight streaming `openai` clients pinned
    round the four DP ranks (the pins to the lost rank go to live ones): DP rank 3 SIGSTOPped
    once every stream has tokens (its peers give it up after the collective timeout), and two
    streams pinned to it opened while the group re-forms. The
    survivors keep their processes and requests, the lost ranks' requests resume on them,
    every request ends once with the fault-free tokens, and the two left serve alone."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=8, include_dashboard=False, object_store_memory=200 * 2**20)
    try:
        with LLM(model=model_dir, dp_size=4, launcher="ray", on_rank_failure="shrink",
                 **SETTINGS) as llm:  # fmt: skip
            outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            assert {o.dp_rank for o in outputs} == {0, 1, 2, 3}
            reference = [o.output_token_ids for o in outputs]
            pids = dict(llm.client.pids)
            _stream_and_kill(llm, reference, pids[2])
            assert llm.client.live_ranks == [0, 1, 3]
            with _serving(llm) as (client, url):
                # Two more streams open while the group re-forms, pinned to the rank it
                # loses: they are held until it has, then go to a live rank.
                try:
                    health, results = _serve_round(
                        client, url, 8, lambda: os.kill(pids[3], signal.SIGSTOP), num_ranks=4,
                        during={8: 3, 9: 3},
                    )  # fmt: skip
                finally:
                    if psutil.pid_exists(pids[3]):
                        os.kill(pids[3], signal.SIGCONT)
                assert (200, "degraded") in health
                assert health <= {(200, "degraded"), (200, "ok")}
                for index in range(10):
                    assert results[index] == (reference[index], ["length"]), index
                assert llm.client.live_ranks == [0, 1]
                assert {r: llm.client.pids[r] for r in (0, 1)} == {0: pids[0], 1: pids[1]}
                status, body = _get(f"{url}/health")
                assert status == 200 and "serving on DP ranks [0, 1] of 4" in body, body
                for index in range(4):  # pinned to each DP rank: the two left serve them
                    reply = _complete(client, index, index)
                    assert reply.choices[0].token_ids == reference[index], index
    finally:
        ray.shutdown()


def _stream_and_kill(llm, reference, pid: int) -> None:
    """Stream PROMPTS; SIGKILL ``pid`` once a request has 6 tokens."""
    killed: list[int] = []
    streamed: list[list[int]] = [[] for _ in PROMPTS]
    ends: list[list] = [[] for _ in PROMPTS]
    for completion in llm.generate_stream(PROMPTS, PARAMS):
        index = PROMPT_INDEX[tuple(completion.prompt_token_ids)]
        streamed[index] += completion.new_token_ids
        if completion.finished:
            ends[index].append(completion)
        if not killed and len(completion.output_token_ids) >= 6:
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)
    assert killed, "every request ended before the kill"
    assert [len(e) for e in ends] == [1] * len(PROMPTS)
    assert [e[0].finish_reason for e in ends] == ["length"] * len(PROMPTS)
    assert streamed == reference  # no token missing or repeated
    assert [e[0].output_token_ids for e in ends] == reference


@contextlib.contextmanager
def _serving(llm):
    """`lockstep serve`'s server over the LLM's group; yields an `openai` client and its URL."""
    server = LockstepServer(llm.client, llm.config, ServerConfig(port=0, served_model_name="t"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
    url = f"http://127.0.0.1:{port}"
    try:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), url
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(5.0), loop).result(120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


# -- a node lost, then a node back, under the server -----------------------------------------
@pytest.fixture(scope="module")
def two_nodes():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    assert not ray.is_initialized()
    small = dict(num_cpus=1, object_store_memory=100 * 1024 * 1024)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**small, "resources": {"node_a": 1}, "include_dashboard": False},
    )
    try:
        cluster.add_node(**small, resources={"node_b": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster, small
    finally:
        ray.shutdown()
        cluster.shutdown()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_serve_shrinks_onto_the_survivor_of_a_lost_node_and_grows_back(model_dir, two_nodes):
    """Six streams over both ranks; the node of one rank is removed once every stream has
    tokens. No node has room for a replacement, so after `replacement_wait_s` the survivor
    takes over every expert and every stream ends unchanged; /health says degraded during
    the heal and ok (naming the ranks it serves on) after. A new node then joins: the group
    grows back (the survivor keeps its process) and both ranks serve the fault-free tokens."""
    cluster, small = two_nodes
    settings = {**SETTINGS, "replacement_wait_s": 2, "placement_strategy": "STRICT_SPREAD"}
    count = 6
    with LLM(model=model_dir, dp_size=2, launcher="ray", **settings) as llm:
        # Before the server starts: its poller and `generate`'s would share the outputs.
        reference = [o.output_token_ids for o in llm.generate(PROMPTS[:count], PARAMS[:count])]
        with _serving(llm) as (client, url):
            _lose_a_node_and_grow_back(llm, cluster, small, client, url, reference, count)


def _lose_a_node_and_grow_back(llm, cluster, small, client, url, reference, count) -> None:
    head = ray.get_runtime_context().get_node_id()
    (lost,) = [r for r, node in llm.client.node_ids.items() if node != head]
    survivor = 1 - lost
    kept_pid = llm.client.pids[survivor]
    node = next(n for n in cluster.worker_nodes if n.node_id == llm.client.node_ids[lost])
    health, results = _serve_round(client, url, count, lambda: cluster.remove_node(node))
    assert (200, "degraded") in health and health <= {(200, "degraded"), (200, "ok")}
    for index in range(count):
        assert results[index] == (reference[index], ["length"]), (index, results[index])
    assert llm.client.live_ranks == [survivor]
    assert llm.client.pids[survivor] == kept_pid
    status, body = _get(f"{url}/health")
    assert status == 200 and f"serving on DP ranks [{survivor}] of 2" in body, body
    _, metrics = _get(f"{url}/metrics")
    for series, value in (("recoveries_total", 1), ("resumed_requests_total", count // 2),
                          ("live_ranks", 1)):  # fmt: skip
        assert f'lockstep:{series}{{model_name="t"}} {value:.1f}' in metrics, series
    # A request pinned to the lost rank is served by the survivor meanwhile.
    assert _complete(client, lost, lost).choices[0].token_ids == reference[lost]

    cluster.add_node(**small, resources={"node_b": 1})
    deadline = time.monotonic() + 120
    while llm.client.live_ranks != [0, 1] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert llm.client.live_ranks == [0, 1]
    assert llm.client.pids[survivor] == kept_pid
    for rank in (0, 1):  # both ranks serve again
        assert _complete(client, rank, rank).choices[0].token_ids == reference[rank]
    _, metrics = _get(f"{url}/metrics")
    assert 'lockstep:live_ranks{model_name="t"} 2.0' in metrics


def _complete(client, index: int, rank: int):
    return client.completions.create(
        model="t", prompt=PROMPTS[index], max_tokens=PARAMS[index].max_tokens,
        temperature=PARAMS[index].temperature, seed=PARAMS[index].seed,
        extra_body={"ignore_eos": True, "return_token_ids": True, "dp_rank": rank},
    )  # fmt: skip


def _serve_round(
    client, url: str, count: int, fault, num_ranks: int = 2, during: dict[int, int] | None = None
):
    """Stream PROMPTS[:count] (prompt i on rank i % num_ranks), call ``fault()`` once every
    stream has had tokens; once /health first says degraded, stream the prompts of
    ``during`` (index -> the DP rank it is pinned to) too. Returns the /health answers seen
    meanwhile and each stream's (tokens, finish reasons) or error."""
    started = threading.Barrier(count + 1)
    results: dict[int, object] = {}

    def stream(index: int, rank: int, wait: bool) -> None:
        tokens, reasons = [], []
        try:
            chunks = client.completions.create(
                model="t", prompt=PROMPTS[index], max_tokens=PARAMS[index].max_tokens,
                stream=True, temperature=PARAMS[index].temperature, seed=PARAMS[index].seed,
                extra_body={"ignore_eos": True, "return_token_ids": True, "dp_rank": rank},
            )  # fmt: skip
            for number, chunk in enumerate(chunks):
                tokens += chunk.choices[0].token_ids
                reasons.append(chunk.choices[0].finish_reason)
                if number == 1 and wait:
                    started.wait(60)
            results[index] = (tokens, [r for r in reasons if r])
        except Exception as error:  # reported by the caller, naming the stream
            results[index] = error

    threads = [
        threading.Thread(target=stream, args=(i, i % num_ranks, True), daemon=True)
        for i in range(count)
    ]
    for worker in threads:
        worker.start()
    started.wait(60)  # every stream has had tokens, none has ended
    fault()
    health = set()
    late = dict(during or {})
    while any(worker.is_alive() for worker in threads):
        status, body = _get(f"{url}/health")
        health.add((status, re.search(r'"status": "(\w+)"', body).group(1)))
        if late and (200, "degraded") in health:  # opened while the group re-forms
            for index, rank in late.items():
                threads.append(threading.Thread(target=stream, args=(index, rank, False)))
                threads[-1].start()
            late = {}
        time.sleep(0.05)
    return health, results
