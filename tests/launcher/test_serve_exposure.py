"""`lockstep serve` on its embedded Ray, tried from outside: a stranger's driver, job submission
and a stopped rank, with real processes on loopback.

One server (DP=2 on the Ray it starts itself, collective timeout 5 s) serves the module; the
tests run in file order and the later ones break it on purpose: a stranger first (the server
must keep serving), then SIGSTOP of a rank (bounded failure, a server that keeps answering),
then SIGTERM of the failed server (a clean stop).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import psutil
import pytest

pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 5  # parallel.collective_timeout_s
# The client declares a silent rank failed after the timeout plus RANK_SILENCE_MARGIN_S (10 s).
SILENCE_LIMIT_S = TIMEOUT_S + 10
SCHEDULER = {"max_num_seqs": 32, "max_model_len": 512, "num_blocks": 512, "block_size": 8}


class Serve:
    """A `lockstep serve` process, its log, and its stdout lines."""

    def __init__(self, model_dir: str, tmp_path: Path) -> None:
        config = tmp_path / "serve.yaml"
        config.write_text(
            f"model: {model_dir}\ndtype: float32\n"
            f"parallel: {{dp_size: 2, launcher: ray, threads_per_rank: 1, "
            f"collective_timeout_s: {TIMEOUT_S}, on_rank_failure: fail}}\n"
            f"scheduler: {json.dumps(SCHEDULER)}\n"
            "server: {port: 0, served_model_name: tiny, drain_timeout_s: 5}\n"
        )
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
            env.pop(name, None)
        self.log_path = tmp_path / "serve.log"
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "serve", "--config", str(config)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(
            target=lambda: [self.lines.put(x) for x in self.process.stdout], daemon=True
        ).start()
        first = self.lines.get(timeout=180)
        assert first.startswith("lockstep serve: listening on http://127.0.0.1:"), first
        self.url = first.split()[-1].strip()
        log = self.log_path.read_text()
        self.rank_pids = {int(r): int(p) for r, p in re.findall(r"DP rank (\d): pid (\d+)", log)}
        assert sorted(self.rank_pids) == [0, 1], log

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)

    def listeners(self, name: str) -> list[tuple[str, int]]:
        """(address, port) of every socket a descendant whose name contains ``name`` listens on."""
        found = []
        for child in self.descendants():
            try:
                if name not in child.name() and name not in " ".join(child.cmdline()):
                    continue
                found += [
                    (c.laddr.ip, c.laddr.port)
                    for c in child.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN
                ]
            except psutil.Error:
                continue
        return found

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log.close()


def get(url: str, timeout_s: float = 30) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read()
            return response.status, json.loads(body) if body.startswith(b"{") else {}
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def serve(model_dir, tmp_path_factory):
    instance = Serve(model_dir, tmp_path_factory.mktemp("serve"))
    yield instance
    instance.close()


def stranger(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Python run as a process that is not part of the job: no token, its own environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return subprocess.run(
        [sys.executable, "-c", script],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


# Joining is the breach (a joined driver can run anything once resources free up); the task
# takes no CPU, so it runs at once beside the ranks' placement group.
STRANGER_DRIVER = """
import os, ray
try:
    ray.init(address=os.environ["TARGET"], log_to_driver=False)
    print("JOINED")
    print("RAN", ray.get(ray.remote(num_cpus=0)(os.getpid).remote(), timeout=30))
except Exception as error:
    print("REFUSED", type(error).__name__)
"""


def test_embedded_ray_refuses_a_driver_without_the_jobs_token(serve):
    (gcs_port,) = {port for _, port in serve.listeners("gcs_server")}
    # The stranger gives up after 2 s of retries (Ray's default is 10 s): an open GCS lets a
    # driver in on its first try, so a short wait cannot hide a breach.
    base = {"TARGET": f"127.0.0.1:{gcs_port}", "RAY_gcs_server_port_wait_time_s": "2"}
    envs = [
        {"RAY_AUTH_MODE": "disabled"},  # what an unauthenticated cluster's driver sends
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},  # a wrong token
    ]
    with concurrent.futures.ThreadPoolExecutor(len(envs)) as pool:
        results = list(pool.map(lambda env: stranger(STRANGER_DRIVER, {**base, **env}), envs))
    for env, result in zip(envs, results, strict=True):
        assert "JOINED" not in result.stdout, (env, result.stdout, result.stderr[-2000:])
        assert "REFUSED" in result.stdout, (env, result.stdout, result.stderr[-2000:])
        assert "Unauthenticated" in result.stderr or "AuthenticationError" in result.stdout, (
            env,
            result.stdout,
            result.stderr[-2000:],
        )


def test_embedded_ray_refuses_job_submission_without_the_token(serve):
    # The dashboard agent's HTTP port takes job submissions (an entrypoint is a shell command).
    ports = {port for address, port in serve.listeners("DashboardAgent") if address == "127.0.0.1"}
    assert ports, serve.listeners("DashboardAgent")
    for port in ports:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/job_agent/jobs/",
            data=json.dumps({"entrypoint": "touch /tmp/lockstep-stranger-was-here"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 401


def test_embedded_ray_token_stays_out_of_the_drivers_environment(serve):
    driver = (Path("/proc") / str(serve.process.pid) / "environ").read_bytes().split(b"\0")
    assert not [v for v in driver if v.startswith(b"RAY_AUTH_TOKEN=")]
    # ...while the ranks have it (they talk to the GCS), and the server still serves.
    rank = (Path("/proc") / str(serve.rank_pids[1]) / "environ").read_bytes().split(b"\0")
    assert [v for v in rank if v.startswith(b"RAY_AUTH_TOKEN=")]
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="none", max_retries=0)
    reply = client.completions.create(
        model="tiny", prompt=[1, 2, 3], max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length"


def _timed_get(url: str) -> tuple[float, int, dict]:
    start = time.monotonic()
    status, body = get(url, timeout_s=10)
    return time.monotonic() - start, status, body


def test_ranks_run_at_the_servers_priority(serve):
    """The embedded Ray's workers are not put below the server (Ray's default worker
    niceness, 15): every thread of a rank, engine and OpenMP workers included, at the
    server's nice level."""
    server = os.getpriority(os.PRIO_PROCESS, serve.process.pid)
    for rank, pid in serve.rank_pids.items():
        levels = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                levels.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
        assert levels == {server}, (rank, levels, server)


def test_stopped_rank_ends_every_stream_within_the_silence_limit(serve):
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="none", max_retries=0)
    ends: queue.Queue[tuple[float, str]] = queue.Queue()
    started = threading.Barrier(21)

    def stream(index: int) -> None:
        chunks = client.completions.create(
            model="tiny",
            prompt=[index + 1, 2, 3],
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True, "dp_rank": index % 2},
        )
        first = True
        try:
            for _ in chunks:
                if first:
                    first = False
                    started.wait(60)
            ends.put((time.monotonic(), "finished"))
        except openai.APIError as error:
            ends.put((time.monotonic(), f"error: {error}"))

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(20)]
    for thread in threads:
        thread.start()
    started.wait(60)  # every stream has had a token
    stopped_at = time.monotonic()
    os.kill(serve.rank_pids[1], signal.SIGSTOP)
    try:
        slowest = 0.0
        while any(thread.is_alive() for thread in threads):
            assert time.monotonic() - stopped_at < SILENCE_LIMIT_S + 15, "streams still open"
            for path in ("/health", "/metrics"):
                took, status, _ = _timed_get(f"{serve.url}{path}")
                slowest = max(slowest, took)
                assert status in (200, 503), (path, status)
            time.sleep(0.3)
        assert slowest < 1.0, f"/health or /metrics took {slowest:.2f} s"
        results = [ends.get_nowait() for _ in range(20)]
        assert all(how.startswith("error") and "rank 1" in how for _, how in results), results
        last = max(at for at, _ in results) - stopped_at
        assert last < SILENCE_LIMIT_S + 10, last
        status, health = get(f"{serve.url}/health")
        assert status == 503 and "rank 1 stopped answering" in health["reason"], health
        start = time.monotonic()
        with pytest.raises(openai.InternalServerError, match="rank 1"):
            client.completions.create(model="tiny", prompt=[1], max_tokens=2)
        assert time.monotonic() - start < 1.0
        # The stopped rank was killed, not left stopped.
        deadline = time.monotonic() + 30
        while psutil.pid_exists(serve.rank_pids[1]):
            assert time.monotonic() < deadline, "the stopped rank is still there"
            time.sleep(0.2)
    finally:
        if psutil.pid_exists(serve.rank_pids[1]):
            os.kill(serve.rank_pids[1], signal.SIGCONT)


def test_sigterm_after_a_group_failure_stops_the_server_cleanly(serve):
    status, _ = get(f"{serve.url}/health")
    assert status == 503  # the group failed in the test before
    # Once the failure path has stopped the ranks (and whatever it does after), SIGTERM must
    # still drain and stop the server: Ray's shutdown there used to reset the handler.
    deadline = time.monotonic() + 60
    while any(psutil.pid_exists(pid) for pid in serve.rank_pids.values()):
        assert time.monotonic() < deadline, "the failed group's ranks are still running"
        time.sleep(0.2)
    time.sleep(3)
    serve.process.send_signal(signal.SIGTERM)
    assert serve.process.wait(timeout=60) == 0, serve.log_path.read_text()[-3000:]
    assert serve.lines.get(timeout=5).strip() == "lockstep serve: stopped"
