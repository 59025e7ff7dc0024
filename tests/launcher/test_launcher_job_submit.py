"""`ray job submit ... -- lockstep run`: the CLI as the driver of a Ray job on an existing cluster.

A one-node Ray head with its job server (dashboard) runs on loopback; the job's driver gets
RAY_ADDRESS from Ray and must join that cluster (not start a Ray of its own). Its output file
must equal a single-rank local reference. Every port is picked free: other Ray clusters may run
on this machine (the default agent port 52365 is often taken), and we must not touch them.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import ray

import launcher.ray_launcher as ray_launcher
from launcher import LLM, SamplingParams

pytestmark = pytest.mark.multirank

BIN = Path(sys.executable).parent
JOB_TIMEOUT_S = 240
TOKEN = secrets.token_hex(32)  # the test cluster's

PROMPTS = [
    {"prompt_token_ids": [(3 * i + 7 * j) % 383 + 1 for j in range(2 + 2 * i)], "max_tokens": 3 + i}
    for i in range(5)
] + [{"prompt": "one rank per bundle", "max_tokens": 6}]
for _line in PROMPTS:
    # Greedy, as the reference: a line without temperature samples at the model's default.
    _line.update(ignore_eos=True, temperature=0)


# -- connect_ray, without starting anything -----------------------------------------------------
class _FakeInit:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, *args, **kwargs) -> None:
        assert not args
        self.calls.append(kwargs)


def test_connect_ray_joins_the_cluster_in_ray_address(monkeypatch):
    fake = _FakeInit()
    monkeypatch.setattr(ray_launcher.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_launcher.ray, "init", fake)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert ray_launcher.connect_ray(num_cpus=8) is False  # not ours to shut down
    # Under a job: connect only; resources, object store and dashboard are the cluster's.
    assert len(fake.calls) == 1
    assert not {"num_cpus", "object_store_memory", "include_dashboard"} & set(fake.calls[0])
    assert fake.calls[0].get("address") in (None, "auto", "127.0.0.1:6379")
    monkeypatch.delenv("RAY_ADDRESS")
    assert ray_launcher.connect_ray(num_cpus=8) is True  # an embedded Ray: ours to shut down
    assert fake.calls[1]["num_cpus"] == 8 and fake.calls[1]["include_dashboard"] is False
    monkeypatch.setattr(ray_launcher.ray, "is_initialized", lambda: True)
    assert ray_launcher.connect_ray(num_cpus=8) is False  # already connected: nothing to do
    assert len(fake.calls) == 2


# -- a real job ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.fixture(scope="module")
def job_files(tmp_path_factory, model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("job_submit")
    model = model_dir
    config = root / "job.yaml"
    config.write_text(
        f"model: {model}\n"
        "dtype: float64\n"
        "parallel: {dp_size: 2, launcher: ray, backend: gloo, collective_timeout_s: 30}\n"
        "scheduler: {max_num_seqs: 8, max_model_len: 128, num_blocks: 128, block_size: 4}\n"
    )
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in PROMPTS))
    return {"root": root, "config": config, "prompts": prompts}


@pytest.fixture(scope="module")
def reference(job_files) -> list[dict]:
    prompts = [line.get("prompt", line.get("prompt_token_ids")) for line in PROMPTS]
    params = [SamplingParams(max_tokens=x["max_tokens"], ignore_eos=True) for x in PROMPTS]
    with LLM(config=job_files["config"], launcher="local", dp_size=1) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return [
        {"index": i, "prompt_token_ids": o.prompt_token_ids, "output_token_ids": o.output_token_ids,
         "text": o.text, "finish_reason": o.finish_reason, "detail": o.detail}
        for i, o in enumerate(outputs)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def head():
    """A Ray head with the job server on free loopback ports, with token authentication as
    the README sets a cluster up (every process of the cluster and every client gets the
    token through its environment); torn down and checked gone."""
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    saved = {name: os.environ.get(name) for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)
    ray_launcher._reload_auth_settings()
    port = _free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "object_store_memory": 150 * 1024 * 1024,
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": port,
            "dashboard_agent_listen_port": _free_port(),
        },
    )
    pids = [
        info.process.pid
        for infos in cluster.head_node.all_processes.values()
        for info in infos
        if info.process is not None
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_job_server(url, cluster)
        yield {"url": url, "address": cluster.address}
    finally:
        cluster.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        ray_launcher._reload_auth_settings()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pids and not [pid for pid in pids if _alive(pid)], "head processes outlived shutdown"
    with pytest.raises(OSError):  # the job server is gone
        urllib.request.urlopen(f"{url}/api/version", timeout=2)


def _wait_for_job_server(url: str, cluster) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            request = urllib.request.Request(
                f"{url}/api/version", headers={"Authorization": f"Bearer {TOKEN}"}
            )
            with urllib.request.urlopen(request, timeout=2) as reply:
                assert json.load(reply)["ray_version"] == ray.__version__
            return
        except OSError as error:
            if time.monotonic() > deadline:
                logs = Path(cluster.head_node.get_session_dir_path()) / "logs" / "dashboard.log"
                tail = logs.read_text()[-3000:] if logs.is_file() else "(no dashboard.log)"
                pytest.fail(f"the job server at {url} did not answer: {error}\n{tail}")
            time.sleep(0.5)


def _ray_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)
    return subprocess.run(
        [str(BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_lockstep_run_as_a_ray_job_matches_the_local_reference(head, job_files, reference):
    from ray.job_submission import JobStatus, JobSubmissionClient
    from ray.util.state import list_actors, list_placement_groups

    output = job_files["root"] / "out_job.jsonl"
    job_id = f"lockstep-test-{uuid.uuid4().hex[:8]}"
    submitted = _ray_cli(
        "job", "submit", "--address", head["url"], "--submission-id", job_id, "--no-wait", "--",
        str(BIN / "lockstep"), "run", "--config", str(job_files["config"]),
        "--prompts", str(job_files["prompts"]), "--output", str(output), "--quiet",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    client = JobSubmissionClient(head["url"])
    TERMINAL = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (status := client.get_job_status(job_id)) not in TERMINAL:
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            pytest.fail(f"job {job_id} still {status} after {JOB_TIMEOUT_S}s:\n"
                        f"{client.get_job_logs(job_id)[-6000:]}")  # fmt: skip
        time.sleep(0.5)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, f"job {job_id} {status}:\n{logs[-8000:]}"

    # The driver joined our cluster through RAY_ADDRESS rather than starting a Ray of its own.
    assert f"Connecting to existing Ray cluster at address: {head['address']}" in logs
    assert "launcher / DP          ray / 2" in logs
    assert "MoE exchange           shared memory" in logs  # a local cluster: one host
    actors = list_actors(address=head["url"], filters=[("class_name", "=", "RankActor")])
    assert len(actors) == 2 and all(actor.state == "DEAD" for actor in actors)
    groups = list_placement_groups(address=head["url"])
    assert groups and all(group.state == "REMOVED" for group in groups)

    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k != "dp_rank"} for r in records] == reference
    assert [r["dp_rank"] for r in records] == [i % 2 for i in range(len(PROMPTS))]

    # The CLI reports the job as succeeded too.
    status_cli = _ray_cli("job", "status", "--address", head["url"], job_id)
    assert status_cli.returncode == 0
    assert f"{job_id}' succeeded" in status_cli.stdout + status_cli.stderr


def test_a_failing_job_is_reported_failed_with_the_cli_message(head, job_files):
    # A bad setting: the driver exits 2 at start-up, before it connects; Ray marks the job failed.
    result = _ray_cli(
        "job", "submit", "--address", head["url"], "--",
        str(BIN / "lockstep"), "run", "--config", str(job_files["config"]),
        "--set", "scheduler.block_size=0",
        timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    combined = result.stdout + result.stderr
    assert result.returncode != 0, combined
    assert "scheduler.block_size must be an int >= 1, got 0" in combined
    assert "FAILED" in combined or "failed" in combined
