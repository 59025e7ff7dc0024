"""`lockstep serve` against hostile clients: raw sockets and floods on loopback.

Two servers (launcher local, DP=1, in this process): one with no API key, as the default
serves, with short read and keep-alive timeouts so the timeout tests stay short; one with a
key, for the Authorization header. Each test names the finding it guards against.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from server_harness import ServerThread

from dist_engine.engine.config import EngineConfig
from launcher.server.config import ServerConfig

ENGINE = {
    "dtype": "float32",
    "parallel": {"dp_size": 1, "launcher": "local", "threads_per_rank": 1},
    "scheduler": {"max_num_seqs": 16, "max_model_len": 1024, "num_blocks": 512, "block_size": 8},
}
READ_TIMEOUT_S = 1.0
KEEPALIVE_TIMEOUT_S = 1.0
API_KEY = "test-key"


@pytest.fixture(scope="module")
def server(model_dir):
    config = ServerConfig(
        port=0,
        served_model_name="tiny",
        read_timeout_s=READ_TIMEOUT_S,
        keepalive_timeout_s=KEEPALIVE_TIMEOUT_S,
        max_body_bytes=2 << 20,
    )
    instance = ServerThread(EngineConfig.from_dict({"model": model_dir, **ENGINE}), config)
    yield instance
    instance.stop()


@pytest.fixture(scope="module")
def keyed_server(model_dir):
    config = ServerConfig(port=0, served_model_name="tiny", api_key=API_KEY)
    instance = ServerThread(EngineConfig.from_dict({"model": model_dir, **ENGINE}), config)
    yield instance
    instance.stop()


class Reply:
    def __init__(self, raw: bytes, elapsed_s: float) -> None:
        self.raw = raw
        self.elapsed_s = elapsed_s
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1]) if lines[0].startswith("HTTP/") else None
        self.headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()

    def json(self) -> dict:
        return json.loads(self.body)


def raw_exchange(port: int, data: bytes, *, wait_s: float = 10.0) -> Reply:
    """Send ``data`` on a fresh connection and read until the server closes it or a whole
    reply (by its Content-Length) has come."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(data)
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            received += chunk
            head, sep, body = received.partition(b"\r\n\r\n")
            if sep and b"\r\nContent-Length:" in head:
                length = int(head.split(b"\r\nContent-Length:")[1].split(b"\r\n")[0])
                if len(body) >= length and not head.startswith(b"HTTP/1.1 100"):
                    break
    return Reply(received, time.monotonic() - start)


def post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    fields = {
        "Host": f"127.0.0.1:{port}",
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        "Connection": "close",
        **(headers or {}),
    }
    head = "".join(f"{k}: {v}\r\n" for k, v in fields.items())
    return f"POST {path} HTTP/1.1\r\n{head}\r\n".encode("latin-1") + body


def completion(prompt, **fields) -> bytes:
    return json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2, **fields}).encode()


# -- item 3: tokenizing off the event loop ------------------------------------------------------
@pytest.mark.timing
def test_a_flood_of_huge_text_prompts_stalls_no_open_stream(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    arrivals: list[float] = []

    def stream() -> None:
        chunks = client.completions.create(
            model="tiny",
            prompt=[1, 2, 3],
            max_tokens=1000,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        for _ in chunks:
            arrivals.append(time.monotonic())

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    deadline = time.monotonic() + 30
    while len(arrivals) < 5:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    huge = completion("Once upon a time " * 60_000)  # ~1 MB of text
    statuses: list[int] = []

    def send() -> None:
        statuses.append(
            raw_exchange(server.port, post(server.port, "/v1/completions", huge)).status
        )

    flood_start = time.monotonic()
    senders = [threading.Thread(target=send) for _ in range(20)]
    for sender in senders:
        sender.start()
    health: list[float] = []
    while any(sender.is_alive() for sender in senders):
        start = time.monotonic()
        with urllib.request.urlopen(f"{server.url}/health", timeout=10) as response:
            assert response.status == 200
        health.append(time.monotonic() - start)
        time.sleep(0.05)
    flood_end = time.monotonic()
    streamer.join(120)
    assert statuses == [400] * 20
    assert arrivals[-1] > flood_end, "the stream ended before the flood did: make it longer"
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if flood_start < b <= flood_end + 1]
    assert gaps, "the stream sent nothing while the flood was served"
    assert max(gaps) < 1.0, f"the stream stalled {max(gaps):.2f} s during the flood"
    assert max(health) < 1.0, f"/health took {max(health):.2f} s during the flood"


def test_a_text_prompt_too_long_for_the_model_is_refused_without_encoding(server):
    tokenizer = server.server.limits.tokenizer
    text = "Once upon a time " * 60_000
    assert tokenizer.min_num_tokens(text) >= 1024
    reply = raw_exchange(server.port, post(server.port, "/v1/completions", completion(text)))
    assert reply.status == 400
    assert "max_model_len is 1024" in reply.json()["error"]["message"]


# -- item 4: 4xx, not 500 -----------------------------------------------------------------------
def test_json_nested_100000_deep_is_a_400(server):
    body = b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    reply = raw_exchange(server.port, post(server.port, "/v1/completions", body))
    assert reply.status == 400, reply.raw[:300]
    assert "nests deeper" in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800", "max_tokens": 2}'),
        (
            "/v1/chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\udfff b"}]}',
        ),
        ("/v1/completions", b'{"model": "tiny", "prompt": [1], "stop": ["\\ud800"]}'),
    ],
)
def test_a_lone_surrogate_is_a_400(server, path, body):
    reply = raw_exchange(server.port, post(server.port, path, body))
    assert reply.status == 400, reply.raw[:300]
    assert "not valid Unicode" in reply.json()["error"]["message"]


def test_a_non_utf8_authorization_header_is_a_401(keyed_server):
    port = keyed_server.port
    request = post(port, "/v1/completions", completion([1, 2]))
    request = request.replace(
        b"Connection:", b"Authorization: Bearer \xff\xfe\x80key\r\nConnection:"
    )
    reply = raw_exchange(port, request)
    assert reply.status == 401, reply.raw[:300]


def test_rejected_requests_log_one_line_each_at_most(server, keyed_server):
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect()
    loggers = [logging.getLogger(name) for name in ("lockstep", "aiohttp.server", "aiohttp")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        bad = [
            (server.port, post(server.port, "/v1/completions", b"[" * 100_000)),
            (server.port, post(server.port, "/v1/completions", b'{"prompt": "\\ud800"}')),
            (server.port, b"NOT HTTP AT ALL\r\n\r\n"),
            (server.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + b"a" * 70_000),
            (
                keyed_server.port,
                post(keyed_server.port, "/v1/models", b"{}", {"Authorization": "Bearer \xff"}),
            ),
        ]
        for port, data in bad * 4:
            raw_exchange(port, data)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert len(records) <= len(bad) * 4, [r.getMessage()[:120] for r in records]
    assert not [r for r in records if r.exc_info], [r.getMessage()[:120] for r in records]


# -- item 5: incomplete requests time out -------------------------------------------------------
def test_a_client_trickling_its_headers_is_cut_off(server):
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        closed = False
        for _ in range(20):
            try:
                sock.sendall(b"X")
                time.sleep(0.5)
                if sock.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed = True
                    break
            except BlockingIOError:
                continue
            except OSError:
                closed = True
                break
    assert closed, "the server kept a connection whose headers never ended"
    assert time.monotonic() - start < KEEPALIVE_TIMEOUT_S + 3


def test_an_oversized_content_length_is_refused_before_reading(server):
    head = post(server.port, "/v1/completions", b"").replace(
        b"Content-Length: 0", b"Content-Length: 100000000000"
    )
    reply = raw_exchange(server.port, head)
    assert reply.status == 413 and reply.elapsed_s < 2.0, reply.raw[:300]


def test_expect_continue_for_an_oversized_body_gets_413_not_continue(server):
    head = post(server.port, "/v1/completions", b"", {"Expect": "100-continue"}).replace(
        b"Content-Length: 0", f"Content-Length: {50 << 20}".encode()
    )
    reply = raw_exchange(server.port, head)
    assert reply.status == 413, reply.raw[:300]
    assert b"100 Continue" not in reply.raw


def test_a_body_that_never_arrives_times_out_with_408(server):
    head = post(server.port, "/v1/completions", b"").replace(
        b"Content-Length: 0", b"Content-Length: 100"
    )
    reply = raw_exchange(server.port, head + b'{"model":')
    assert reply.status == 408, reply.raw[:300]
    assert reply.elapsed_s < READ_TIMEOUT_S + 3


# -- item 7: DNS rebinding and content types ----------------------------------------------------
def test_a_request_for_a_foreign_host_is_refused_on_loopback(server):
    port = server.port
    request = post(port, "/v1/completions", completion([1, 2]))
    foreign = request.replace(f"Host: 127.0.0.1:{port}".encode(), b"Host: rebind.example:80")
    assert raw_exchange(port, foreign).status == 421
    origin = post(port, "/v1/completions", completion([1, 2]), {"Origin": "http://evil.example"})
    assert raw_exchange(port, origin).status == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        named = request.replace(f"Host: 127.0.0.1:{port}".encode(), f"Host: {host}".encode())
        assert raw_exchange(port, named).status == 200, host
    local = post(
        port, "/v1/completions", completion([1, 2]), {"Origin": f"http://localhost:{port}"}
    )
    assert raw_exchange(port, local).status == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_that_is_not_declared_json_is_a_415(server, content_type):
    request = post(server.port, "/v1/completions", completion([1, 2]))
    if content_type is None:
        request = request.replace(b"Content-Type: application/json\r\n", b"")
    else:
        request = request.replace(b"application/json", content_type.encode())
    assert raw_exchange(server.port, request).status == 415


# -- item 8: what error replies say -------------------------------------------------------------
def test_error_replies_cut_what_they_echo(server):
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(
            {"model": "m" * 1_000_000, "prompt": [1], "temperature": "x" * 10**5}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    body = refused.value.read()
    assert refused.value.code in (400, 404) and len(body) < 2000, len(body)


def test_replies_to_unparsable_requests_name_no_library(server):
    for data in (b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n"):
        reply = raw_exchange(server.port, data)
        assert reply.status == 400, reply.raw[:300]
        assert reply.headers.get("server") == "lockstep", reply.headers
        assert b"aiohttp" not in reply.raw and b"Python" not in reply.raw
    reply = raw_exchange(server.port, post(server.port, "/v1/completions", b"{"))
    assert reply.headers.get("server") == "lockstep"
