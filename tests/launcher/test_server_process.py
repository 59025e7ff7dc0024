"""`lockstep serve` as its users run it: the command in a process of its own, stopped with
SIGTERM; and a DP=2 Ray group that loses a rank while it serves."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import ray
from server_harness import ServerThread

from dist_engine.engine.config import EngineConfig
from launcher import LLM, SamplingParams
from launcher.server.config import ServerConfig

pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[2]
SCHEDULER = {"max_num_seqs": 8, "max_model_len": 512, "num_blocks": 256, "block_size": 8}
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def wait_until(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_serve_drains_in_flight_requests_on_sigterm(model_dir, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model: {model_dir}\ndtype: float64\n"
        "parallel: {dp_size: 1, launcher: local, threads_per_rank: 1}\n"
        f"scheduler: {json.dumps(SCHEDULER)}\n"
        "server: {port: 0, drain_timeout_s: 60, served_model_name: tiny}\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "serve", "--config", str(config)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout], daemon=True).start()
    try:
        first = lines.get(timeout=120)
        assert first.startswith("lockstep serve: listening on http://127.0.0.1:"), first
        url = first.split()[-1]
        assert get(f"{url}/health") == (200, {"status": "ok", "reason": "ok"})
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(
            model="tiny", prompt=[1, 2, 3], max_tokens=400, stream=True, **GREEDY
        )
        chunks = iter(stream)
        tokens = list(next(chunks).choices[0].token_ids)
        process.send_signal(signal.SIGTERM)
        # Draining: unhealthy, new requests refused, the open stream carries on to its end.
        _, health = wait_until(
            lambda: (lambda got: got if got[0] == 503 else None)(get(f"{url}/health")),
            30,
            "/health to turn unhealthy",
        )
        assert health["reason"] == "draining: the server is shutting down"
        with pytest.raises(openai.InternalServerError, match="shutting down") as refused:
            client.completions.create(model="tiny", prompt=[4, 5], max_tokens=2)
        assert refused.value.status_code == 503
        reasons = []
        for chunk in chunks:
            tokens += chunk.choices[0].token_ids
            reasons.append(chunk.choices[0].finish_reason)
        assert len(tokens) == 400 and reasons[-1] == "length"
        assert process.wait(timeout=60) == 0
        assert lines.get(timeout=5).strip() == "lockstep serve: stopped"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
    # What start-up built is left out of later collections (launcher/server/serve.py).
    assert "start-up heap frozen" in (tmp_path / "serve.log").read_text()
    settings = {"dtype": "float64", "threads_per_rank": 1, **SCHEDULER}
    with LLM(model=model_dir, launcher="local", **settings) as llm:
        (expected,) = llm.generate(
            [[1, 2, 3]], SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False
        )
    assert tokens == expected.output_token_ids


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=200 * 2**20)
    yield
    ray.shutdown()


def test_a_dead_rank_fails_its_requests_and_health(model_dir, ray_cluster):
    settings = {"dtype": "float64", "threads_per_rank": 1, **SCHEDULER}
    with LLM(model=model_dir, launcher="local", **settings) as llm:
        (expected,) = llm.generate(
            [[7, 8, 9]], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False
        )
    config = EngineConfig(model=model_dir).with_overrides(
        dp_size=2, launcher="ray", on_rank_failure="fail", **settings
    )
    server = ServerThread(config, ServerConfig(port=0))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        for rank in (0, 1):  # both ranks serve, with the single rank's results
            extra = {**GREEDY["extra_body"], "dp_rank": rank}
            reply = client.completions.create(
                model=server.model, prompt=[7, 8, 9], max_tokens=6, temperature=0, extra_body=extra
            )
            assert reply.choices[0].token_ids == expected.output_token_ids
        long = {"model": server.model, "prompt": [1, 2], "max_tokens": 500, "temperature": 0}
        stream = client.completions.create(
            **long, stream=True, extra_body={"ignore_eos": True, "dp_rank": 1}
        )
        chunks = iter(stream)
        next(chunks)
        errors: list[BaseException] = []

        def whole_on_rank_0() -> None:
            try:
                client.completions.create(**long, extra_body={"ignore_eos": True, "dp_rank": 0})
            except openai.APIStatusError as error:
                errors.append(error)

        waiter = threading.Thread(target=whole_on_rank_0)
        waiter.start()
        wait_until(lambda: server.stats()[0].num_running == 1, 30, "rank 0 to run its request")
        start = time.monotonic()
        os.kill(server.client.pids[1], signal.SIGKILL)
        with pytest.raises(openai.APIError, match="rank 1"):
            for _ in chunks:
                pass
        waiter.join(60)
        assert len(errors) == 1 and errors[0].status_code == 503
        assert "rank 1" in errors[0].body["message"]
        status, health = get(f"{server.url}/health")
        assert status == 503 and "DP rank 1" in health["reason"]
        assert time.monotonic() - start < 30
        with pytest.raises(openai.InternalServerError, match="DP rank 1") as refused:
            client.completions.create(model=server.model, prompt=[1], max_tokens=2)
        assert refused.value.status_code == 503
    finally:
        server.stop()
