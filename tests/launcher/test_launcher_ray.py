"""The Ray launcher and the LLM API: a DP=2 group of Ray actors on an embedded Ray."""

from __future__ import annotations

import os
import time

import pytest
import ray

import launcher.ray_launcher as ray_launcher
from dist_engine.errors import LockstepError
from launcher import LLM, SamplingParams

pytestmark = pytest.mark.multirank

PROMPTS = [[(7 * i + 3 * j) % 383 + 1 for j in range(3 + 2 * i)] for i in range(8)]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
SETTINGS = dict(dtype="float64", max_num_seqs=8, max_model_len=128, num_blocks=128, block_size=4)


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=200 * 1024 * 1024,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    with LLM(model=model_dir, dp_size=1, launcher="local", **SETTINGS) as llm:
        return [o.output_token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm(model_dir, ray_cluster):
    with LLM(model=model_dir, dp_size=2, launcher="ray", **SETTINGS) as instance:
        yield instance


def test_dp2_equals_the_single_rank_reference(llm, reference):
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.output_token_ids for o in outputs] == reference
    assert {o.dp_rank for o in outputs} == {0, 1}  # round robin used both ranks
    assert all(o.finish_reason == "length" and o.ttft_s is not None for o in outputs)
    assert llm.moe_exchange == "shared memory"  # both actors on this host (moe_exchange: auto)


def test_ranks_on_this_host_send_their_outputs_over_sockets(llm, reference, monkeypatch):
    """Every rank on the driver's node: each writes its takes to a socket of its own
    (launcher/output_channel.py) and the driver makes no `take` call; streams and whole
    results come through it alike. The driver's submissions go the other way on the same
    sockets, none by an actor call."""
    group = llm.client._group
    assert group.channeled and sorted(group.channels) == [0, 1]
    sent: list[tuple[str, int, bool]] = []
    command = ray_launcher.RayClient._command

    def recorded(self, group, rank, actor, what):
        sent.append((what[0], rank, command(self, group, rank, actor, what)))
        return sent[-1][2]

    monkeypatch.setattr(ray_launcher.RayClient, "_command", recorded)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    streamed = list(llm.generate_stream(PROMPTS[:2], PARAMS))
    assert [o.output_token_ids for o in outputs] == reference
    assert streamed[-1].finished and len(streamed) >= 12
    assert group.takes == {}  # no actor call carried outputs
    assert {rank for _, rank, _ in sent} == {0, 1} and all(over for _, _, over in sent)


def test_a_channel_that_does_not_open_leaves_the_group_on_takes(
    model_dir, ray_cluster, reference, monkeypatch
):
    """One rank's output channel fails to open after another's did: the group goes back to
    takes for every rank, and the writer already started is stopped before any request, so
    no output is taken by it and lost."""
    opened: list[int] = []
    original = ray_launcher.RayClient._open_channels

    def one_then_fail(self, group, ranks):
        original(self, group, [0])
        opened.append(0)
        raise OSError("no socket for rank 1")

    monkeypatch.setattr(ray_launcher.RayClient, "_open_channels", one_then_fail)
    with LLM(model=model_dir, dp_size=2, launcher="ray", **SETTINGS) as llm:
        group = llm.client._group
        assert opened == [0] and not group.channeled and group.channels == {}
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        streamed = list(llm.generate_stream(PROMPTS[:1], PARAMS))
        stopped = ray.get(group.actors[0].stop_outputs.remote(1.0))
    assert [o.output_token_ids for o in outputs] == reference
    assert streamed[-1].output_token_ids == reference[0]
    assert stopped  # its writer had ended


def test_each_rank_gets_its_share_of_the_cores(llm):
    """threads_per_rank unset: the host's cores split evenly over the 2 ranks, at least 1 each:
    together they take no more cores than the host has (it has at least 2), and one thread
    more each would."""
    num_cores = os.cpu_count() or 1
    threads = ray.get([actor.num_threads.remote() for actor in llm.client.actors])
    assert threads[0] == threads[1] >= 1, threads
    if num_cores >= 2:
        assert 2 * threads[0] <= num_cores < 2 * (threads[0] + 1), (threads, num_cores)


def test_ranks_are_pinned_to_disjoint_cores(llm):
    """parallel.cpu_binding (on by default): each CPU rank runs on its own cores."""
    available = sorted(os.sched_getaffinity(0))
    threads = ray.get(llm.client.actors[0].num_threads.remote())
    cores = ray.get([actor.cpu_cores.remote() for actor in llm.client.actors])
    if 2 * threads > len(available):
        assert cores == [available, available]  # would not fit: left unpinned
        return
    assert cores == [available[:threads], available[threads : 2 * threads]]


def test_dp_rank_pinning_is_honoured(llm, reference):
    outputs = llm.generate(PROMPTS, PARAMS, dp_rank=1, use_tqdm=False)
    assert [o.dp_rank for o in outputs] == [1] * len(PROMPTS)
    pins = [0, 1, 1, 0, None, None, 1, 0]
    outputs = llm.generate(PROMPTS, PARAMS, dp_rank=pins, use_tqdm=False)
    assert all(pin is None or o.dp_rank == pin for o, pin in zip(outputs, pins, strict=True))
    assert [o.output_token_ids for o in outputs] == reference
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, 2\), got 2"):
        llm.generate(PROMPTS[:1], PARAMS, dp_rank=2, use_tqdm=False)


def test_streaming_yields_the_tokens_of_generate(llm, reference):
    streamed: dict[str, list[int]] = {}
    order: list[str] = []
    finals = {}
    for item in llm.generate_stream(PROMPTS, PARAMS):
        if item.request_id not in streamed:
            order.append(item.request_id)
            streamed[item.request_id] = []
        streamed[item.request_id] += item.new_token_ids
        if item.finished:
            finals[item.request_id] = item
    assert len(finals) == len(PROMPTS)
    assert all(streamed[rid] == finals[rid].output_token_ids for rid in finals)
    assert sorted(streamed.values()) == sorted(reference)


def test_text_prompts_and_per_prompt_params(llm):
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 5)]
    outputs = llm.generate(["hello world", "experts"], params, use_tqdm=False)
    assert [len(o.output_token_ids) for o in outputs] == [1, 5]
    assert all(isinstance(o.text, str) for o in outputs)


def test_bad_requests_end_with_a_reason(llm):
    outputs = llm.generate([[], [1, 2, 99999]], PARAMS, use_tqdm=False)
    assert outputs[0].finish_reason == "error: empty prompt"
    assert "outside the vocabulary" in outputs[1].finish_reason


def test_a_killed_actor_fails_generate_and_a_new_llm_starts(model_dir, ray_cluster, reference):
    llm = LLM(model=model_dir, dp_size=2, launcher="ray", on_rank_failure="fail", **SETTINGS)
    pids = dict(llm.client.pids)
    os.kill(pids[1], 9)
    start = time.monotonic()
    with pytest.raises(LockstepError, match="DP rank 1 died") as info:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert time.monotonic() - start < 60
    # Every request has its one result, failed: rank 1's by the driver ("DP rank 1 died"),
    # rank 0's by its own engine, whose first collective found rank 1 gone; both name it.
    failed = info.value.outputs
    assert len(failed) == len(PROMPTS)
    assert all(o.finish_reason.startswith("error") and "rank 1" in o.finish_reason for o in failed)
    assert all(
        o.finish_reason.startswith("error: DP rank 1 died") for o in failed if o.dp_rank == 1
    )
    # Nothing stays behind: both rank processes are gone.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids.values()):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids.values())
    with LLM(model=model_dir, dp_size=2, launcher="ray", **SETTINGS) as again:
        outputs = again.generate(PROMPTS[:2], PARAMS, use_tqdm=False)
    assert [o.output_token_ids for o in outputs] == reference[:2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
