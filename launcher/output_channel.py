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
each connection first presents a key made for that actor, handed over by Ray. A frame is
JSON (outputs as `output_to_plain` makes them), never a pickle: nothing read from a socket
is unpickled. Whole outputs as JSON every step cost ~0.35 ms more a 32-output frame than
pickles, so a stream's deltas carry only its new tokens (`Encoder`).

The same connection carries the driver's commands the other way: ``("submit", submissions)``
and ``("abort", request_id)`` (`encode_command`), each what the actor call of that name
would have carried, read by a thread of the rank (`read_commands`). An actor call's hops (the
driver's Ray threads, the rank's IO and executor threads) each wait for a core the rank's
compute holds: at half load a submission took 3.0 ms p50 that way (docs/benchmark_notes.md,
"A prompt's way to its first token"). A command the rank cannot carry out shuts the
connection, so the driver sees its rank fail (as an actor call would have raised) and heals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hmac
import json
import os
import secrets
import select
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from dist_engine.engine.outputs import (
    RequestOutput,
    TokenSlice,
    logprobs_from_plain,
    logprobs_to_plain,
    output_from_plain,
    output_to_plain,
)
from dist_engine.errors import LockstepError
from dist_engine.log import get_logger
from launcher.clients import Submission
from scheduler.sampling_params import params_from_plain, params_to_plain

log = get_logger()

KEY_BYTES = 16
_HEADER = struct.Struct("<Q")  # payload bytes
_RECV_BYTES = 1 << 20


class MalformedFrame(LockstepError):
    """A frame that is not one a rank's writer makes."""


class Encoder:
    """The writer's end of the frame format. A request's first output and its terminal
    output go whole (`output_to_plain`); the outputs between, a stream's deltas, go as
    ``{"d": request id, "new": token ids, "n": output tokens so far, "ft": first token time,
    "lp": logprobs}``: its prompt and earlier tokens, sent once, are not sent again every step
    (JSON of every token so far was most of a streamed frame's cost)."""

    def __init__(self) -> None:
        self._open: set[str] = set()  # requests sent whole and not ended

    def encode(self, frame: tuple) -> bytes:
        """``("out", outputs)`` or ``("left", generation, reason)`` as length + JSON."""
        return _framed(self._plain_frame(frame))

    def payload(self, frame: tuple) -> bytes:
        """The same frame's JSON alone (`Decoder.decode` takes it): a take's answer, where
        the actor call carries its length."""
        return _json(self._plain_frame(frame))

    def _plain_frame(self, frame: tuple) -> tuple:
        if frame[0] == "out":
            return ("out", [self._plain(output) for output in frame[1]])
        return frame

    def _plain(self, output: RequestOutput) -> dict:
        request_id = output.request_id
        if output.finished:
            self._open.discard(request_id)
        elif request_id not in self._open:
            self._open.add(request_id)
        else:
            delta: dict = {
                "d": request_id,
                "new": output.new_token_ids,
                "n": len(output.output_token_ids),
                "ft": output.first_token_time,
            }
            if output.new_logprobs is not None:
                delta["lp"] = logprobs_to_plain(output.new_logprobs)
            return delta
        return output_to_plain(output)


class Decoder:
    """The driver's end: the outputs an `Encoder` sent, rebuilt whole. A running request's
    output tokens are a `TokenSlice` of one list per request that each delta extends, so a
    delta costs O(its new tokens), not O(every token so far)."""

    def __init__(self) -> None:
        # The last output of each open request, and the list its outputs' tokens slice.
        self._open: dict[str, tuple[RequestOutput, list[int]]] = {}

    def decode(self, payload: bytes) -> tuple:
        """The frame `Encoder.encode` made; MalformedFrame for anything else."""
        try:
            frame = json.loads(payload)
            if frame[0] == "out" and len(frame) == 2 and isinstance(frame[1], list):
                return ("out", [self._output(plain) for plain in frame[1]])
            if frame[0] == "left" and len(frame) == 3 and isinstance(frame[1], int):
                return ("left", frame[1], str(frame[2]))
        except MalformedFrame:
            raise  # says what was wrong already
        except (ValueError, TypeError, KeyError, IndexError, LockstepError) as error:
            raise MalformedFrame(f"a malformed output frame: {error}") from None
        raise MalformedFrame(f"not an output frame: {str(frame)[:80]}")

    def _output(self, plain: dict) -> RequestOutput:
        if "d" not in plain:
            output = output_from_plain(plain)
            if output.finished:
                self._open.pop(output.request_id, None)
            else:
                tokens = list(output.output_token_ids)
                output = dataclasses.replace(output, output_token_ids=TokenSlice.whole(tokens))
                self._open[output.request_id] = (output, tokens)
            return output
        last, tokens = self._open[plain["d"]]  # KeyError: a delta of a request never sent whole
        new = [int(token) for token in plain["new"]]
        if len(tokens) + len(new) != plain["n"]:
            raise MalformedFrame(
                f"request {plain['d']!r}: a delta to {plain['n']} output tokens after "
                f"{len(tokens)} with {len(new)} new"
            )
        tokens.extend(new)
        lp = plain.get("lp")
        output = RequestOutput(
            request_id=last.request_id,
            prompt_token_ids=last.prompt_token_ids,
            output_token_ids=TokenSlice.whole(tokens),
            new_token_ids=new,
            finished=False,
            finish_reason=None,
            dp_rank=last.dp_rank,
            arrival_time=last.arrival_time,
            first_token_time=plain["ft"],
            new_logprobs=None if lp is None else logprobs_from_plain(lp),
        )
        self._open[output.request_id] = (output, tokens)
        return output


_LISTENER_PREFIX = "lockstep-outputs-"
_SOCKET_NAME = "outputs.sock"
# A driver makes its directory, binds its socket in it, then listens: until it listens the
# socket refuses connections too. Only directories older than this are judged.
_STALE_AFTER_S = 60.0


class Listener:
    """The driver's end: a listening socket in a private directory. A driver that is killed
    (SIGKILL) cannot remove its directory; the next one on the host does (`sweep_stale`)."""

    def __init__(self) -> None:
        parent = _listener_parent()
        sweep_stale(parent)
        self._dir = tempfile.mkdtemp(prefix=_LISTENER_PREFIX, dir=parent)  # mode 0700
        self.path = os.path.join(self._dir, _SOCKET_NAME)
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


_SOCKET_PATH_BYTES = 107  # sun_path's 108 bytes, less the terminating NUL


def _listener_parent() -> str:
    """The temp directory, or /tmp where a socket path under it would be too long (a long
    TMPDIR, as some batch systems set, would otherwise send every group back to takes)."""
    parent = tempfile.gettempdir()
    longest = os.path.join(parent, _LISTENER_PREFIX + "x" * 8, _SOCKET_NAME)
    if len(os.fsencode(longest)) <= _SOCKET_PATH_BYTES or not os.access("/tmp", os.W_OK):
        return parent
    return "/tmp"


def sweep_stale(directory: str) -> list[str]:
    """Remove the listener directories in ``directory`` that this user's gone drivers left:
    those older than `_STALE_AFTER_S` whose socket refuses a connection (nothing listens on it
    any more) or that never got one. A live driver's socket accepts (its accept loop drops
    the keyless connection), so its directory is kept. Returns the removed."""
    removed = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(_LISTENER_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if time.time() - info.st_mtime > _STALE_AFTER_S and _gone(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _gone(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(os.path.join(path, _SOCKET_NAME))
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:  # timed out (a full backlog), or a path this probe cannot use: keep it
        return False
    finally:
        probe.close()
    return False


class Channel:
    """The driver's end of one rank's connection: frames as they arrive, end of file once."""

    def __init__(self, conn: socket.socket) -> None:
        self.socket = conn
        self._buffer = bytearray()
        self._decoder = Decoder()
        self._send_lock = threading.Lock()
        self.closed = False  # the rank's end closed (its process is gone)

    def fileno(self) -> int:
        return self.socket.fileno()

    def read(self) -> list[tuple]:
        """Every complete frame that has arrived (non-blocking); sets `closed` at end of
        file. Raises MalformedFrame for a frame that is not an output frame."""
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
        return [self._decoder.decode(payload) for payload in _split_frames(self._buffer)]

    def send(self, payload: bytes, timeout_s: float) -> None:
        """Write a frame (`encode_command`) to the rank, waiting at most ``timeout_s`` for
        room (a stopped rank reads nothing). Raises TimeoutError, or OSError once the
        connection is closed (its rank failed). One writer at a time."""
        deadline = time.monotonic() + timeout_s
        view = memoryview(payload)
        with self._send_lock:
            while view:
                try:
                    view = view[self.socket.send(view) :]
                except (BlockingIOError, InterruptedError):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"no room for a command in {timeout_s:g} s") from None
                    fd = self.socket.fileno()
                    if fd < 0:  # closed meanwhile (its rank failed)
                        raise OSError(errno.EBADF, "the channel closed") from None
                    room = select.poll()
                    room.register(fd, select.POLLOUT)
                    room.poll(max(1, int(left * 1000)))

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
    encoder = Encoder()
    try:
        while True:
            joined = generation()
            try:
                frame: tuple = ("out", take())
            except left_error as error:
                conn.sendall(encoder.encode(("left", joined, str(error))))
                wait_rejoined(pause_s)
                continue
            conn.sendall(encoder.encode(frame))
    except OSError:  # the driver closed its end (a shutdown, or this rank was replaced)
        pass
    finally:
        with contextlib.suppress(OSError):
            conn.close()


def start(name: str, target: Callable[..., None], *args: Any) -> threading.Thread:
    """``target(*args)`` on a daemon thread named ``name`` (`write_takes`, `read_commands`)."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread


# -- the driver's commands to the rank --------------------------------------------------------
def submission_to_plain(item: Submission) -> dict:
    return {
        "id": item.request_id,
        "prompt": item.prompt_token_ids,
        "params": params_to_plain(item.params),
        "stream": item.stream,
        "seed": item.seed,
        "resumed": list(item.resumed_token_ids),
        "group": item.sample_group,
        "deferred": item.deferred,
    }


def submission_from_plain(plain: dict) -> Submission:
    return Submission(
        request_id=str(plain["id"]),
        prompt_token_ids=[int(token) for token in plain["prompt"]],
        params=params_from_plain(plain["params"]),
        stream=bool(plain["stream"]),
        seed=plain["seed"],
        resumed_token_ids=tuple(int(token) for token in plain["resumed"]),
        sample_group=plain["group"],
        deferred=bool(plain["deferred"]),
    )


def encode_command(command: tuple) -> bytes:
    """``("submit", submissions)`` or ``("abort", request_id)`` as length + JSON."""
    if command[0] == "submit":
        command = ("submit", [submission_to_plain(item) for item in command[1]])
    return _framed(command)


def decode_command(payload: bytes) -> tuple:
    """The command `encode_command` made; MalformedFrame for anything else."""
    try:
        command = json.loads(payload)
        if command[0] == "submit" and len(command) == 2 and isinstance(command[1], list):
            return ("submit", [submission_from_plain(plain) for plain in command[1]])
        if command[0] == "abort" and len(command) == 2 and isinstance(command[1], str):
            return ("abort", command[1])
    except (ValueError, TypeError, KeyError, IndexError) as error:
        raise MalformedFrame(f"a malformed command: {error}") from None
    raise MalformedFrame(f"not a command: {str(command)[:80]}")


def read_commands(
    conn: socket.socket,
    submit: Callable[[list[Submission]], None],
    abort: Callable[[str], None],
) -> None:
    """The rank's reader loop (on a thread of its own): each command the driver sends,
    carried out in order, until the connection closes. A command that fails (a malformed
    one, or the engine refusing it) shuts the connection: the driver then fails this rank,
    as an actor call raising would have had it do, and nothing it sent is left unanswered."""
    buffer = bytearray()
    while True:
        try:
            data = conn.recv(_RECV_BYTES)
        except OSError:  # closed: the driver's end, or this rank's writer ended
            return
        if not data:
            return
        buffer += data
        try:
            for payload in _split_frames(buffer):
                kind, body = decode_command(payload)
                if kind == "submit":
                    submit(body)
                else:
                    abort(body)
        except Exception:
            log.exception("a command from the driver failed; this rank's channel closes")
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            return


def _json(value: tuple) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _framed(value: tuple) -> bytes:
    """``value`` as one frame: its JSON's length, then the JSON (`_split_frames` reads it)."""
    payload = _json(value)
    return _HEADER.pack(len(payload)) + payload


def _split_frames(buffer: bytearray) -> list[bytes]:
    """The complete frames at the front of ``buffer``, taken out of it."""
    frames = []
    while len(buffer) >= _HEADER.size:
        (size,) = _HEADER.unpack_from(buffer)
        end = _HEADER.size + size
        if len(buffer) < end:
            break
        frames.append(bytes(buffer[_HEADER.size : end]))
        del buffer[:end]
    return frames


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
