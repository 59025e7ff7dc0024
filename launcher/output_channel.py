"""A Ray rank's outputs to the driver over a Unix socket, for ranks on the driver's host.

Every step of a stream has outputs, and each `take` of them from a Ray rank is an actor call:
~0.4-0.5 ms of CPU in the driver and as much in the actor, and several threads woken in both
processes while the engine's own threads want the cores. A DP=1 group under Ray streamed at
3,741-4,711 tok/s where the same engine in-process did 5,679-5,915 (docs/benchmark_notes.md,
"A Ray rank against the same engine in-process"). Here a thread in the rank's process makes
the same takes (`EngineHost.take`) and writes each result to a socket the driver reads: one
frame, ~0.1 ms over both ends.

What a frame says is what a take would have answered, so the driver keeps the failure model
of takes (launcher/ray_launcher.py):
- ``("out", outputs)``: a take's outputs; an empty list is the rank's heartbeat, every
  `_TAKE_S` at least while its engine is idle.
- ``("left", generation, reason)``: the engine left its group (a take's `GroupLeft`),
  stamped with the group generation the rank had joined when the take began, so that the
  driver tells a departure from the group it runs from one it has already healed. Sent again
  every `_TAKE_S` while the engine waits for a re-formed group, as a take would raise again.
- end of file: the rank's process is gone (or the thread died: either way the rank failed).

Who can write: the socket lives in a directory only this user can enter (``mkdtemp``), and
each connection first presents a key made for that actor, handed over by Ray; the driver
unpickles a frame with a loader that admits only the output types (`RequestOutput`,
`TokenLogprob`, `ErrorKind`), never code.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import os
import pickle
import secrets
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

KEY_BYTES = 16
_HEADER = struct.Struct("<Q")  # payload bytes
_RECV_BYTES = 1 << 20


class _OutputUnpickler(pickle.Unpickler):
    """Loads lists, tuples, dicts, numbers, strings and the output types only."""

    _ALLOWED = frozenset(
        {
            ("dist_engine.engine.outputs", "RequestOutput"),
            ("dist_engine.engine.outputs", "TokenLogprob"),
            ("dist_engine.engine.outputs", "ErrorKind"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"an output frame names {module}.{name}")
        return super().find_class(module, name)


def encode(frame: tuple) -> bytes:
    payload = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def decode(payload: bytes) -> tuple:
    frame = _OutputUnpickler(io.BytesIO(payload)).load()
    if not isinstance(frame, tuple) or not frame or frame[0] not in ("out", "left"):
        raise pickle.UnpicklingError(f"not an output frame: {str(frame)[:80]}")
    return frame


class Listener:
    """The driver's end: a listening socket in a private directory."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="lockstep-outputs-")  # mode 0700
        self.path = os.path.join(self._dir, "outputs.sock")
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(self.path)
        self._socket.listen(64)

    def accept(self, key: bytes, timeout_s: float) -> Channel:
        """The connection that presents ``key``, waiting up to ``timeout_s``; others are
        closed. Raises TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self._socket.settimeout(left)
            try:
                conn, _ = self._socket.accept()
            except TimeoutError:
                break
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                presented = _read_exactly(conn, KEY_BYTES)
            except OSError:
                conn.close()
                continue
            if hmac.compare_digest(presented, key):
                conn.setblocking(False)
                return Channel(conn)
            conn.close()
        raise TimeoutError(f"no rank connected to {self.path} with its key in {timeout_s:g} s")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._socket.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class Channel:
    """The driver's end of one rank's connection: frames as they arrive, end of file once."""

    def __init__(self, conn: socket.socket) -> None:
        self.socket = conn
        self._buffer = bytearray()
        self.closed = False  # the rank's end closed (its process is gone)

    def fileno(self) -> int:
        return self.socket.fileno()

    def read(self) -> list[tuple]:
        """Every complete frame that has arrived (non-blocking); sets `closed` at end of
        file. Raises pickle.UnpicklingError for a frame that is not an output frame."""
        while not self.closed:
            try:
                data = self.socket.recv(_RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.closed = True
                break
            if not data:
                self.closed = True
                break
            self._buffer += data
        frames = []
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            end = _HEADER.size + size
            if len(self._buffer) < end:
                break
            frames.append(decode(bytes(self._buffer[_HEADER.size : end])))
            del self._buffer[:end]
        return frames

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.socket.close()


def connect(path: str, key: bytes) -> socket.socket:
    """The rank's end: connected to the driver's `Listener`, its key presented."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(10.0)
        conn.connect(path)
        conn.sendall(key)
        conn.settimeout(None)
    except BaseException:
        conn.close()
        raise
    return conn


def write_takes(
    conn: socket.socket,
    take: Callable[[], list],
    generation: Callable[[], int],
    wait_rejoined: Callable[[float], None],
    left_error: type[BaseException],
    pause_s: float,
) -> None:
    """The rank's writer loop (on a thread of its own): each take's result as a frame, until
    the driver closes its end. ``take`` raises ``left_error`` while the engine waits for a
    re-formed group; the frame then says so, and the loop waits ``pause_s`` (or until the
    engine has joined a group) before it asks again."""
    try:
        while True:
            joined = generation()
            try:
                frame: tuple = ("out", take())
            except left_error as error:
                conn.sendall(encode(("left", joined, str(error))))
                wait_rejoined(pause_s)
                continue
            conn.sendall(encode(frame))
    except OSError:  # the driver closed its end (a shutdown, or this rank was replaced)
        pass
    finally:
        with contextlib.suppress(OSError):
            conn.close()


def start_writer(name: str, *args: Any) -> threading.Thread:
    thread = threading.Thread(target=write_takes, args=args, name=name, daemon=True)
    thread.start()
    return thread


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed before the key")
        data += chunk
    return data


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)
