"""Faults with real processes: a killed rank, a stopped rank, a killed driver, an outside
client on the store, Ctrl-C; each test is named after what it checks.

Every request must keep exactly one terminal result, finished ones included; nothing hangs;
nothing outside the job can reach in.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from dist_engine.errors import LockstepError
from launcher import LLM, SamplingParams

pytestmark = pytest.mark.multirank

GROUP = dict(max_model_len=128, num_blocks=256, block_size=4, max_num_seqs=8)
# These tests show what a failure does when the group does not heal (test_heal.py: when it does).
FAIL = dict(on_rank_failure="fail")
LOCKSTEP = str(Path(sys.executable).parent / "lockstep")


def prompts(count: int, length: int = 6) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 380 + 1 for j in range(length)] for i in range(count)]


def _listening_address(port: int) -> str | None:
    """The local address a socket listening on `port` is bound to (/proc/net/tcp)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                if len(address) == 8:  # IPv4, little-endian
                    return ".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0))
                return address
    return None


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[int, list[int]]:
    """Greedy tokens of the prompts below from one local rank (DP does not change results)."""
    with LLM(model=model_dir, launcher="local", dp_size=1, **GROUP) as llm:
        outs = llm.generate(prompts(6), SamplingParams(max_tokens=6, ignore_eos=True))
    return {i: o.output_token_ids for i, o in enumerate(outs)}


def test_a_dp2_group_contains_bad_requests_keeps_results_and_hides_its_store(model_dir, reference):
    llm = LLM(model=model_dir, dp_size=2, launcher="ray", collective_timeout_s=20, **FAIL, **GROUP)
    try:
        # 6: the store listens on loopback (every rank is on this host), and the group's keys
        # are under a random namespace: an outside client finds none of them.
        host, port = llm.client.store_address
        assert host == "127.0.0.1" and _listening_address(port) == "127.0.0.1"
        outsider = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=5))
        assert not outsider.check(["lockstep/engine_generation"])
        assert outsider.num_keys() > 1  # the group's own keys are there, under the namespace

        # 1: a request that fails inside a step (a seed forced past the door's check) ends
        # alone; the other requests, on both ranks, get the reference tokens.
        good = SamplingParams(max_tokens=6, ignore_eos=True)
        bad = SamplingParams(max_tokens=6, temperature=0.7, ignore_eos=True)
        object.__setattr__(bad, "seed", 2**64)
        outs = llm.generate(prompts(6) + [[4, 5, 6]], [good] * 6 + [bad], dp_rank=[None] * 6 + [1])
        assert outs[6].finish_reason.startswith("error: sampling settings rejected")
        assert {i: o.output_token_ids for i, o in enumerate(outs[:6])} == reference
        assert {o.dp_rank for o in outs[:6]} == {0, 1}
        again = llm.generate(prompts(6), good, use_tqdm=False)  # the group still serves
        assert {i: o.output_token_ids for i, o in enumerate(again)} == reference

        # 4: SIGKILL rank 1 in the middle of a long job: every request keeps exactly one
        # terminal result, the finished ones with their tokens.
        count = 160
        long = SamplingParams(max_tokens=24, ignore_eos=True)
        seen: dict[int, object] = {}
        start = time.monotonic()
        with pytest.raises(LockstepError) as raised:
            for index, completion in llm.generate_as_completed(prompts(count, 12), long):
                assert index not in seen, f"prompt {index} reported twice"
                seen[index] = completion
                if len(seen) == 20:
                    os.kill(llm.client.pids[1], signal.SIGKILL)
        elapsed = time.monotonic() - start
        error = raised.value
        assert error.failed_rank == 1 and "DP rank 1 died" in str(error)
        assert len(seen) == count and sorted(seen) == list(range(count))
        assert [o.request_id for o in error.outputs] == [seen[i].request_id for i in range(count)]
        finished = [o for o in error.outputs if o.finish_reason == "length"]
        failed = [o for o in error.outputs if o.finish_reason.startswith("error")]
        assert len(finished) >= 20 and len(finished) + len(failed) == count
        assert all(len(o.output_token_ids) == 24 for o in finished)
        assert all("rank 1" in o.finish_reason for o in failed)
        assert elapsed < 60
    finally:
        llm.shutdown()


def test_a_stopped_rank_ends_its_requests_within_the_bound(model_dir):
    """SIGSTOP rank 1: its requests end with an error naming it once it has been silent for
    the collective timeout plus RANK_SILENCE_MARGIN_S; rank 0's fail when its collectives time
    out; the stopped process is killed; generate returns."""
    from launcher.ray_launcher import RANK_SILENCE_MARGIN_S

    timeout_s = 4.0
    llm = LLM(
        model=model_dir, dp_size=2, launcher="ray", collective_timeout_s=timeout_s, **FAIL, **GROUP
    )
    try:
        stopped = llm.client.pids[1]
        count = 120
        seen = {}
        with pytest.raises(LockstepError) as raised:
            for index, completion in llm.generate_as_completed(
                prompts(count, 12), SamplingParams(max_tokens=24, ignore_eos=True)
            ):
                seen[index] = completion
                if len(seen) == 10:
                    os.kill(stopped, signal.SIGSTOP)
                    stopped_at = time.monotonic()
        waited = time.monotonic() - stopped_at
        bound = timeout_s + RANK_SILENCE_MARGIN_S
        assert waited < bound + 10, f"{waited:.1f} s after the stop (bound {bound} s)"
        assert len(seen) == count
        error = raised.value
        assert 1 in error.failed_ranks and "stopped answering" in str(error)
        rank1 = [o for o in error.outputs if o.dp_rank == 1 and o.finish_reason != "length"]
        assert rank1 and all("rank 1" in o.finish_reason for o in rank1)
        deadline = time.monotonic() + 20
        while not _gone(stopped) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(stopped), "the stopped rank was left alive"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGCONT)
        llm.shutdown()


# -- the CLI ---------------------------------------------------------------------------------
def _wait_for_lines(path: Path, count: int, process: subprocess.Popen, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if path.is_file() and len(path.read_text().splitlines()) >= count:
            return
        if process.poll() is not None:
            pytest.fail(f"the job ended early ({process.returncode}): {process.stderr.read()}")
        time.sleep(0.1)
    process.kill()
    pytest.fail(f"{path} never reached {count} lines")


def _job_files(root: Path, model_dir: str, launcher: str, dp_size: int) -> tuple[Path, Path]:
    config = root / f"{launcher}.yaml"
    config.write_text(
        f"model: {model_dir}\n"
        f"parallel: {{dp_size: {dp_size}, launcher: {launcher}, collective_timeout_s: 20, "
        "on_rank_failure: fail}\n"
        "scheduler: {max_num_seqs: 8, max_model_len: 128, num_blocks: 256, block_size: 4}\n"
    )
    lines = [
        {"prompt_token_ids": p, "max_tokens": 24, "ignore_eos": True} for p in prompts(200, 12)
    ]
    jsonl = root / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return config, jsonl


def _check_records(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    indices = [r["index"] for r in records]
    assert len(indices) == len(set(indices)), "a result was written twice"
    return records


def test_the_cli_writes_results_as_they_finish_and_names_a_dead_rank(tmp_path, model_dir):
    config, jsonl = _job_files(tmp_path, model_dir, "ray", 2)
    out = tmp_path / "out.jsonl"
    job = subprocess.Popen(
        [LOCKSTEP, "run", "--config", str(config), "--prompts", str(jsonl), "--output", str(out),
         "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )  # fmt: skip
    try:
        _wait_for_lines(out, 10, job, limit_s=120)
        ranks = [
            p
            for p in psutil.Process(job.pid).children(recursive=True)
            if "RankActor" in " ".join(p.cmdline())
        ]
        assert len(ranks) == 2, [p.cmdline() for p in ranks]
        ranks[0].send_signal(signal.SIGKILL)
        _, err = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 1, err
    assert "the DP group failed" in err and "died" in err
    records = _check_records(out)
    assert len(records) == 200  # every request: finished, or failed naming the rank
    finished = [r for r in records if r["finish_reason"] == "length"]
    assert len(finished) >= 10 and all(len(r["output_token_ids"]) == 24 for r in finished)


def _sigint_at_default() -> None:
    """In the job's process before it starts: SIGINT at its default, as Ctrl-C in a terminal
    finds it. A suite started from a background shell has SIGINT ignored, and a child inherits
    that (Python then installs no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_keeps_the_results_finished_so_far(tmp_path, model_dir):
    config, jsonl = _job_files(tmp_path, model_dir, "local", 1)
    out = tmp_path / "out.jsonl"
    job = subprocess.Popen(
        [LOCKSTEP, "run", "--config", str(config), "--prompts", str(jsonl), "--output", str(out),
         "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_sigint_at_default,
    )  # fmt: skip
    try:
        _wait_for_lines(out, 5, job, limit_s=120)
        lines_at_signal = len(out.read_text().splitlines())
        job.send_signal(signal.SIGINT)
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 130, (lines_at_signal, err)
    assert "interrupted" in err
    records = _check_records(out)
    assert 5 <= len(records) < 200
    assert all(r["finish_reason"] == "length" for r in records)


# -- the driver ------------------------------------------------------------------------------
DRIVER = """
import sys, time
from launcher import LLM
llm = LLM(model=sys.argv[1], dp_size=2, launcher="ray", max_model_len=64, num_blocks=64,
          block_size=4, max_num_seqs=4)
print("READY", flush=True)
time.sleep(600)
"""


def test_a_killed_driver_leaves_no_ray_process_behind(model_dir):
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, model_dir],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )  # fmt: skip
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "READY" not in line and time.monotonic() < deadline:
            line = driver.stdout.readline()
        assert "READY" in line, "the driver never started"
        left = [p for p in psutil.Process(driver.pid).children(recursive=True)]
        assert any("raylet" in " ".join(p.cmdline()) for p in left)
        driver.kill()
        driver.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not all(_gone(p.pid) for p in left):
            time.sleep(0.25)
        alive = [" ".join(p.cmdline())[:60] for p in left if not _gone(p.pid)]
        assert not alive, f"still running after the driver died: {alive}"
    finally:
        if driver.poll() is None:
            driver.kill()


# -- torchrun ---------------------------------------------------------------------------------
class _Bomb:
    """Unpickling this creates a file: what an outside client could make rank 0 run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_torchrun_results_are_never_unpickled_from_the_store(tmp_path, model_dir):
    import pickle
    import socket

    config, _ = _job_files(tmp_path, model_dir, "torchrun", 2)
    jsonl = tmp_path / "few.jsonl"
    jsonl.write_text("".join(
        json.dumps({"prompt_token_ids": p, "max_tokens": 4, "ignore_eos": True}) + "\n"
        for p in prompts(6)
    ))  # fmt: skip
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Bomb(str(marker)))
    out = tmp_path / "out.jsonl"
    job = subprocess.Popen(
        [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "faults",
         "-m", "launcher.cli", "run", "--config", str(config), "--prompts", str(jsonl),
         "--output", str(out), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stop = threading.Event()

    def attack() -> None:
        """An outside client: finds every port torchrun's agent listens on (the store the
        ranks use among them) and keeps writing a pickle where results used to be read."""
        stores = {}
        while not stop.is_set():
            try:
                listening = {
                    c.laddr.port
                    for c in psutil.Process(job.pid).net_connections(kind="tcp")
                    if c.status == psutil.CONN_LISTEN
                }
            except psutil.Error:
                return
            for found in listening - set(stores):
                try:
                    stores[found] = dist.TCPStore(
                        "127.0.0.1", found, is_master=False, timeout=datetime.timedelta(seconds=2)
                    )
                except Exception:
                    stores[found] = None
            for store in filter(None, stores.values()):
                try:
                    for exchange in (1, 2):
                        for rank in (0, 1):
                            store.set(f"lockstep/results/{exchange}/{rank}", payload)
                except Exception:
                    continue
            time.sleep(0.02)

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    try:
        _, err = job.communicate(timeout=180)
    finally:
        stop.set()
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err[-4000:]
    assert not marker.exists(), "a value from the store was unpickled"
    records = _check_records(out)
    assert len(records) == 6 and all(r["finish_reason"] == "length" for r in records)
