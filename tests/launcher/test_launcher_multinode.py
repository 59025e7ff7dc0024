"""Two simulated Ray nodes on this machine (``ray.cluster_utils.Cluster``), one DP rank on each.

STRICT_SPREAD must put the two rank actors on different nodes, the group must still generate
exactly the single-rank tokens, and an unplaceable group must fail at start-up with a message,
leaving nothing reserved behind. With no rank on the driver's node the outputs come by takes
(actor calls answered with output frames), not over the output channels' sockets: a rank
SIGKILLed and then one SIGSTOPped while streams are open must heal there as they do over
channels (tests/launcher/test_heal.py), with no token missing or repeated.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

import launcher.ray_launcher as ray_launcher
from dist_engine.errors import LockstepError
from launcher import LLM, SamplingParams

pytestmark = pytest.mark.multirank

PROMPTS = [[(11 * i + 5 * j) % 383 + 1 for j in range(2 + 3 * i)] for i in range(6)]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)
SETTINGS = dict(dtype="float64", max_num_seqs=8, max_model_len=128, num_blocks=128, block_size=4)


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    with LLM(model=model_dir, dp_size=1, launcher="local", **SETTINGS) as llm:
        return [o.output_token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


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
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2
        yield nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_strict_spread_puts_each_rank_on_its_own_node(model_dir, reference, two_nodes):
    with LLM(
        model=model_dir, dp_size=2, launcher="ray", placement_strategy="STRICT_SPREAD", **SETTINGS
    ) as llm:
        assert not llm.client.started_ray  # it joined our cluster rather than starting one
        node_ids = llm.client.node_ids
        cores = ray.get([actor.cpu_cores.remote() for actor in llm.client.actors])
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        # Streamed by takes: after a request's first output each take carries only its new
        # tokens (RankActor.take); every item must still read as every token so far.
        streamed: dict[int, list[int]] = {}
        for item in llm.generate_stream(PROMPTS, PARAMS):
            so_far = streamed.setdefault(PROMPTS.index(list(item.prompt_token_ids)), [])
            so_far += item.new_token_ids
            assert list(item.output_token_ids) == so_far
        # Not every rank on the driver's node: the outputs come by takes (actor calls), not
        # over sockets (launcher/output_channel.py).
        channeled = llm.client._group.channeled
    assert not channeled
    assert [streamed[index] for index in range(len(PROMPTS))] == reference
    # Two raylets, one machine: CPU binding must count both ranks as sharing its cores.
    available = sorted(os.sched_getaffinity(0))
    if 2 * max(1, len(available) // 2) <= len(available):
        assert not set(cores[0]) & set(cores[1]), cores
    assert set(node_ids.values()) == set(two_nodes)  # one rank on each node
    custom = {rank: {"node_a", "node_b"} & set(two_nodes[node]) for rank, node in node_ids.items()}
    assert sorted(map(sorted, custom.values())) == [["node_a"], ["node_b"]]
    assert [o.output_token_ids for o in outputs] == reference
    assert [o.dp_rank for o in outputs] == [i % 2 for i in range(len(PROMPTS))]


def test_strict_pack_cannot_fit_two_ranks_on_a_one_cpu_node(model_dir, two_nodes, monkeypatch):
    # Each node has one CPU: two ranks on one node can never be placed. Start-up must fail with
    # a message naming the strategy, and free the placement group it asked for.
    monkeypatch.setattr(ray_launcher, "_STARTUP_TIMEOUT_S", 3.0)
    before = set(ray.util.placement_group_table())
    with pytest.raises(LockstepError, match=r"could not place 2 rank\(s\).*STRICT_PACK.*2 node"):
        LLM(
            model=model_dir, dp_size=2, launcher="ray", placement_strategy="STRICT_PACK", **SETTINGS
        )
    table = ray.util.placement_group_table()
    new = [pg for pg_id, pg in table.items() if pg_id not in before]
    assert new and all(pg["state"] == "REMOVED" for pg in new)
    deadline = time.monotonic() + 10  # the resource view catches up asynchronously
    while ray.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 2.0


def test_the_cluster_still_serves_after_the_failed_start(model_dir, reference, two_nodes):
    with LLM(
        model=model_dir, dp_size=2, launcher="ray", placement_strategy="SPREAD", **SETTINGS
    ) as llm:
        outputs = llm.generate(PROMPTS[:3], PARAMS, dp_rank=1, use_tqdm=False)
    assert [o.output_token_ids for o in outputs] == reference[:3]
    assert all(o.dp_rank == 1 for o in outputs)


def test_a_kill_then_a_stop_heal_while_outputs_come_by_takes(model_dir, reference, two_nodes):
    """Rank 1 (on the other node) SIGKILLed when a stream has 6 tokens; once the healed group
    has given every unfinished request a token, rank 0 SIGSTOPped: its take stops coming back,
    its peer's collective times out, and the driver re-forms the group again. Every request
    ends once with the fault-free tokens (greedy and seeded sampling), each stream item reads
    as every token so far, and the healed group's takes serve those tokens again."""
    timeout_s = 4  # parallel.collective_timeout_s
    params = [
        SamplingParams(max_tokens=40, ignore_eos=True, temperature=float(i % 2), seed=70 + i)
        for i in range(len(PROMPTS))
    ]
    with LLM(
        model=model_dir, dp_size=2, launcher="ray", placement_strategy="STRICT_SPREAD",
        threads_per_rank=1, collective_timeout_s=timeout_s, max_recoveries_per_hour=20,
        **SETTINGS,
    ) as llm:  # fmt: skip
        fault_free = [o.output_token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        generation, before = llm.client.generation, dict(llm.client.pids)
        nodes_before = dict(llm.client.node_ids)
        faults: dict = {}
        since_heal: set[int] = set()
        streamed: list[list[int]] = [[] for _ in PROMPTS]
        ends: list[list] = [[] for _ in PROMPTS]
        try:
            for item in llm.generate_stream(PROMPTS, params):
                index = PROMPTS.index(list(item.prompt_token_ids))
                streamed[index] += item.new_token_ids
                assert list(item.output_token_ids) == streamed[index], index
                if item.finished:
                    ends[index].append(item)
                if not faults and len(item.output_token_ids) >= 6:
                    faults["killed"] = llm.client.pids[1]
                    os.kill(faults["killed"], signal.SIGKILL)
                elif "stopped" not in faults and llm.client.generation == generation + 1:
                    since_heal.add(index)
                    unfinished = {i for i in range(len(PROMPTS)) if not ends[i]}
                    if unfinished and unfinished <= since_heal:
                        faults["pids"] = dict(llm.client.pids)
                        faults["stopped"], faults["at"] = llm.client.pids[0], time.monotonic()
                        os.kill(faults["stopped"], signal.SIGSTOP)
                elif "healed_s" not in faults and llm.client.generation > generation + 1:
                    faults["healed_s"] = time.monotonic() - faults["at"]
        finally:
            if "stopped" in faults and psutil.pid_exists(faults["stopped"]):
                os.kill(faults["stopped"], signal.SIGCONT)
        assert "stopped" in faults and llm.client.generation == generation + 2
        assert not llm.client._group.channeled  # still by takes after both heals
        pids, nodes = dict(llm.client.pids), dict(llm.client.node_ids)
        # Healed in place: each heal replaced the faulted rank only, on its own node.
        assert [pids[r] == faults["pids"][r] for r in (0, 1)] == [False, True]
        assert [faults["pids"][r] == before[r] for r in (0, 1)] == [True, False]
        assert nodes == nodes_before
        again = llm.generate(PROMPTS, params, use_tqdm=False)  # the new ranks' takes
    assert faults["healed_s"] > timeout_s  # seen when the peer's collective timed out
    for index, expected in enumerate(fault_free):
        (final,) = ends[index]  # ended exactly once
        assert final.finish_reason == "length", final.finish_reason
        assert final.output_token_ids == expected, index
    assert streamed == fault_free
    assert [o.output_token_ids for o in again] == fault_free
    assert {o.dp_rank for o in again} == {0, 1}
    # The greedy requests' first tokens are the single-rank run's.
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    assert [fault_free[i][: PARAMS.max_tokens] for i in greedy] == [reference[i] for i in greedy]
