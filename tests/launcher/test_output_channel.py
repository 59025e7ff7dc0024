"""The socket a Ray rank's outputs travel by on the driver's host (launcher/output_channel.py):
frames, their loader, the key, the writer's loop, and the driver's commands the other way.
Real sockets and threads."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from dist_engine.engine.outputs import ErrorKind, RequestOutput, TokenLogprob, TokenSlice
from launcher import output_channel
from launcher.clients import Submission
from scheduler import SamplingParams, StructuredOutputsParams
from scheduler.sampling_params import params_from_plain, params_to_plain


def _output(request_id: str, **changes) -> RequestOutput:
    fields = dict(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        output_token_ids=[4, 5],
        new_token_ids=[5],
        finished=False,
        finish_reason=None,
        dp_rank=1,
        arrival_time=1.5,
        new_logprobs=[TokenLogprob(5, -0.25, 1, ((5, -0.25), (7, -2.0)))],
    )
    return RequestOutput(**{**fields, **changes})


@pytest.fixture
def listener():
    made = output_channel.Listener()
    yield made
    made.close()


def test_frames_arrive_whole_in_order_and_the_end_is_seen(listener):
    key = output_channel.new_key()
    rank_end = output_channel.connect(listener.path, key)
    channel = listener.accept(key, timeout_s=10)
    kind = ErrorKind.GROUP_FAILED
    failed = _output("b", finished=True, finish_reason="error: x", error_kind=kind)
    frames = [("out", [_output("a"), failed]), ("out", []), ("left", 3, "its group failed")]
    encoder = output_channel.Encoder()
    data = b"".join(encoder.encode(frame) for frame in frames)
    rank_end.sendall(data[:7])  # a frame in pieces: nothing until it is whole
    time.sleep(0.05)
    assert channel.read() == []
    rank_end.sendall(data[7:])
    got: list[tuple] = []
    deadline = time.monotonic() + 10
    while len(got) < 3 and time.monotonic() < deadline:
        got += channel.read()
    assert got == frames and not channel.closed
    rank_end.close()
    deadline = time.monotonic() + 10
    while not channel.closed and time.monotonic() < deadline:
        assert channel.read() == []
    assert channel.closed
    channel.close()


def test_a_frame_is_json_and_anything_else_is_refused():
    """Nothing read from the socket is unpickled: a frame is JSON, and a pickle, an unknown
    field or a frame of another kind is refused with MalformedFrame."""

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    frame = output_channel.Encoder().encode(("out", [_output("a")]))
    assert frame[8:].startswith(b'["out",[{"request_id":"a"')
    refused = [
        pickle.dumps(("out", [Evil()])),
        json.dumps(["out", [{"d": "never-sent-whole", "new": [1], "n": 1, "ft": 1.0}]]).encode(),
        json.dumps(["out", [{"request_id": "a", "shell": "rm"}]]).encode(),
        json.dumps(["left", "3", "x"]).encode(),
        json.dumps(["exec", "x"]).encode(),
        json.dumps({"out": []}).encode(),
    ]
    for payload in refused:
        with pytest.raises(output_channel.MalformedFrame):
            output_channel.Decoder().decode(payload)


def test_a_killed_drivers_directory_is_removed_by_the_next_and_a_live_ones_kept():
    """A driver killed with SIGKILL leaves its listener's directory behind; a later listener
    on the host removes it (its socket refuses connections) and one that never got a socket,
    once they are older than a driver takes to start listening, and keeps a live driver's
    (whose socket still accepts) and a young one (a driver between making it and listening)."""
    base = tempfile.mkdtemp(prefix="ls-", dir="/tmp")  # short: a socket path has 108 bytes
    env = {**os.environ, "TMPDIR": base}
    code = (
        "import time; from launcher import output_channel; "
        "listener = output_channel.Listener(); print(listener.path, flush=True); time.sleep(600)"
    )
    drivers = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        killed, live = (os.path.dirname(d.stdout.readline().strip()) for d in drivers)
        drivers[0].send_signal(signal.SIGKILL)
        drivers[0].wait(timeout=30)
        unbound, young = (os.path.join(base, f"lockstep-outputs-{n}") for n in ("x", "y"))
        for path in (unbound, young):
            os.mkdir(path, 0o700)
        assert output_channel.sweep_stale(base) == []  # all young
        long_ago = time.time() - 3600
        for path in (killed, live, unbound):
            os.utime(path, (long_ago, long_ago))
        removed = output_channel.sweep_stale(base)
        assert sorted(removed) == sorted([killed, unbound])
        assert sorted(os.listdir(base)) == sorted(os.path.basename(p) for p in (live, young))
        assert os.path.exists(os.path.join(live, "outputs.sock"))
    finally:
        for driver in drivers:
            driver.kill()
            driver.wait(timeout=30)
        shutil.rmtree(base, ignore_errors=True)


def test_a_temp_directory_too_long_for_a_socket_path_falls_back_to_tmp(monkeypatch):
    """Under a TMPDIR too long for a socket path the listener goes to /tmp rather than
    failing (which would send the group back to takes); under a short one it stays there."""
    short = tempfile.mkdtemp(prefix="ls-", dir="/tmp")
    long = os.path.join(short, "d" * 90)
    os.mkdir(long)
    try:
        for parent, expected in ((short, short), (long, "/tmp")):
            monkeypatch.setattr(tempfile, "tempdir", parent)
            listener = output_channel.Listener()
            try:
                assert os.path.dirname(os.path.dirname(listener.path)) == expected
                key = output_channel.new_key()
                rank_end = output_channel.connect(listener.path, key)
                listener.accept(key, timeout_s=10).close()
                rank_end.close()
            finally:
                listener.close()
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_only_the_keyed_connection_is_taken_and_the_socket_is_private(listener):
    mode = stat.S_IMODE(os.stat(os.path.dirname(listener.path)).st_mode)
    assert mode == 0o700
    key = output_channel.new_key()
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stranger.connect(listener.path)
    stranger.sendall(b"x" * output_channel.KEY_BYTES)
    rank_end = output_channel.connect(listener.path, key)
    channel = listener.accept(key, timeout_s=10)
    rank_end.sendall(output_channel.Encoder().encode(("out", [])))
    assert stranger.recv(1) == b""  # the stranger was hung up on
    deadline = time.monotonic() + 10
    frames: list[tuple] = []
    while not frames and time.monotonic() < deadline:
        frames = channel.read()
    assert frames == [("out", [])]
    with pytest.raises(TimeoutError):
        listener.accept(output_channel.new_key(), timeout_s=0.1)
    for end in (stranger, rank_end, channel):
        end.close()


def test_the_writer_stamps_a_departure_with_the_group_it_left_and_repeats_it(listener):
    """A take that finds the engine waiting for a new group becomes a "left" frame stamped
    with the generation read before the take (a rejoin during it does not restamp it), sent
    again after each pause while the engine still waits; outputs follow once it rejoined."""

    class Left(Exception):
        pass

    generation = [4]
    x, y = _output("x"), _output("y", finished=True, finish_reason="length")
    answers = iter([[x], Left("gone"), Left("gone"), [y]])

    def take():
        answer = next(answers, None)
        if answer is None:  # nothing more: idle heartbeats until the driver hangs up
            time.sleep(0.01)
            return []
        if isinstance(answer, Exception):
            generation[0] = 5  # the engine moved on meanwhile: not this frame's stamp
            raise answer
        return answer

    key = output_channel.new_key()
    rank_end = output_channel.connect(listener.path, key)
    channel = listener.accept(key, timeout_s=10)
    pauses: list[float] = []
    writer = threading.Thread(
        target=output_channel.write_takes,
        args=(rank_end, take, lambda: generation[0], pauses.append, Left, 0.5),
        daemon=True,
    )
    writer.start()
    frames: list[tuple] = []
    deadline = time.monotonic() + 10
    while len(frames) < 5 and time.monotonic() < deadline:
        frames += channel.read()
    assert frames[:4] == [("out", [x]), ("left", 4, "gone"), ("left", 5, "gone"), ("out", [y])]
    assert frames[4] == ("out", [])
    assert pauses == [0.5, 0.5]
    channel.close()  # the driver's end goes: the writer's next write fails and it ends
    writer.join(10)
    assert not writer.is_alive()


def test_a_stream_goes_as_deltas_and_comes_back_whole():
    """Between a request's first and terminal outputs only its new tokens travel; the
    driver rebuilds each output as the rank made it (prompt, every token so far, logprobs),
    for each of several interleaved requests; a delta that does not add up is refused."""
    lp = [TokenLogprob(9, -0.5, 2, ((3, -0.1),))]
    prompt = [1, 2, 3]

    def step(rid: str, tokens: list[int], new: int, **changes) -> RequestOutput:
        return _output(
            rid,
            prompt_token_ids=prompt,
            output_token_ids=tokens,
            new_token_ids=tokens[len(tokens) - new :],
            first_token_time=2.0,
            new_logprobs=lp * new,
            **changes,
        )

    outputs = [
        step("a", [7], 1, prompt_logprobs=[None, *lp, *lp]),
        step("b", [4, 4], 2),  # resumed: its first output has tokens from before
        step("a", [7, 8], 1),
        step("b", [4, 4, 5], 1),
        step("a", [7, 8, 9, 9], 2),
        step("a", [7, 8, 9, 9, 6], 1, finished=True, finish_reason="length", token_times=[1.0]),
        step("b", [4, 4, 5, 5], 1),
    ]
    encoder, decoder = output_channel.Encoder(), output_channel.Decoder()
    payloads = [encoder.encode(("out", [o]))[8:] for o in outputs]
    assert [b'"d":' in p for p in payloads] == [False, False, True, True, True, False, True]
    assert all(b'"prompt_token_ids"' not in p for p in payloads if b'"d":' in p)
    decoded = [decoder.decode(p) for p in payloads]
    assert decoded == [("out", [o]) for o in outputs]
    # A running output's tokens are a slice of one list per request (no copy per delta);
    # the outputs decoded before later deltas still read as they were sent; a terminal's
    # tokens are a list.
    tokens = [frame[1][0].output_token_ids for frame in decoded]
    assert [type(t) is TokenSlice for t in tokens] == [True] * 5 + [False, True]
    assert [list(t) for t in tokens] == [o.output_token_ids for o in outputs]
    bad = json.dumps(["out", [{"d": "b", "new": [6], "n": 9, "ft": 2.0}]]).encode()
    with pytest.raises(
        output_channel.MalformedFrame, match=r"^request .b.: a delta to 9 output tokens"
    ):
        decoder.decode(bad)


# -- the driver's commands ----------------------------------------------------------------------
EVERY_FIELD = SamplingParams(
    max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, seed=2**64 - 1, stop_token_ids=[3, 1],
    ignore_eos=True, min_p=0.1, min_tokens=2, presence_penalty=0.5, frequency_penalty=-0.5,
    repetition_penalty=1.2, logit_bias={5: -1.5, 2: 3}, logprobs=2, prompt_logprobs=-1,
    grammar='{"grammars": []}', grammar_after=[9, 8], allowed_token_ids=[1, 2, 3],
    bad_words_token_ids=[[1, 2], [3]], cache_salt="tenant", n=2, stop=["x", "yz"],
    include_stop_str_in_output=True, bad_words=["w"], skip_special_tokens=False,
    spaces_between_special_tokens=False,
)  # fmt: skip
STRUCTURED = SamplingParams(
    structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "string"}}},
        disable_any_whitespace=True,
    ),
    detokenize=False,
)


def test_every_sampling_field_is_set_in_the_round_trip_case():
    default = SamplingParams()
    unset = {
        f.name
        for f in dataclasses.fields(SamplingParams)
        if getattr(EVERY_FIELD, f.name) == getattr(default, f.name)
    }
    # structured_outputs excludes grammar (STRUCTURED has it), detokenize=False excludes stop.
    assert unset == {"structured_outputs", "detokenize"}


@pytest.mark.parametrize("params", [SamplingParams(), EVERY_FIELD, STRUCTURED])
def test_a_submission_goes_as_json_and_comes_back_equal(params):
    """A submission crosses as JSON (nothing unpickled on the rank either) and comes back
    equal, each field of its params in the type the params' checks give it."""
    item = Submission("r1", [1, 2, 3], params, True, 5, (4,), "group", True)
    payload = output_channel.encode_command(("submit", [item]))[8:]
    assert json.loads(payload)[0] == "submit"
    kind, [back] = output_channel.decode_command(payload)
    assert kind == "submit" and back == item
    for field in dataclasses.fields(SamplingParams):
        got, want = getattr(back.params, field.name), getattr(params, field.name)
        assert type(got) is type(want), field.name
    assert back.params.adjusts_logits == params.adjusts_logits
    abort = output_channel.encode_command(("abort", "r1"))[8:]
    assert output_channel.decode_command(abort) == ("abort", "r1")


def test_params_forced_past_their_checks_cross_as_they_were():
    """A caller may force a field past the checks (test_faults does, for a seed): the rank
    gets the params as they were, as a pickled copy would have been, so its own admission
    refuses that request alone instead of the channel failing the rank."""
    forced = SamplingParams(max_tokens=6, temperature=0.7, presence_penalty=0.5)
    object.__setattr__(forced, "seed", 2**64)
    plain = json.loads(json.dumps(params_to_plain(forced)))
    back = params_from_plain(plain)
    assert back == forced and back.seed == 2**64 and back.adjusts_logits
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(**plain)


def test_commands_reach_the_rank_in_order_and_a_bad_one_closes_the_channel(listener):
    key = output_channel.new_key()
    rank_end = output_channel.connect(listener.path, key)
    channel = listener.accept(key, timeout_s=10)
    got: list[tuple] = []
    reader = output_channel.start(
        "test-commands",
        output_channel.read_commands,
        rank_end,
        lambda batch: got.append(("submit", [item.request_id for item in batch])),
        lambda request_id: got.append(("abort", request_id)),
    )
    items = [Submission(f"r{i}", [1, 2], SamplingParams(), True) for i in range(3)]
    for command in (("submit", items[:2]), ("abort", "r0"), ("submit", items[2:])):
        channel.send(output_channel.encode_command(command), timeout_s=10)
    deadline = time.monotonic() + 10
    while len(got) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == [("submit", ["r0", "r1"]), ("abort", "r0"), ("submit", ["r2"])]
    # A pickle is no command: the rank takes nothing more and shuts the connection, which
    # the driver reads as its end (and fails the rank: a command was not carried out).
    evil = pickle.dumps(("submit", []))
    channel.send(struct.pack("<Q", len(evil)) + evil, timeout_s=10)
    _assert_the_rank_closed_it(reader, channel)
    assert len(got) == 3
    channel.close()
    rank_end.close()


def test_a_command_the_engine_refuses_closes_the_channel(listener):
    """The engine raising on a submission (as an actor call would have raised to the
    driver) shuts the connection: the driver reads its end and fails the rank, whose open
    requests the heal resubmits; nothing waits on a command nobody carried out."""
    key = output_channel.new_key()
    rank_end = output_channel.connect(listener.path, key)
    channel = listener.accept(key, timeout_s=10)

    def refuse(batch):
        raise RuntimeError("the group's store is gone")

    reader = output_channel.start(
        "test-commands", output_channel.read_commands, rank_end, refuse, lambda _: None
    )
    item = Submission("r0", [1, 2], SamplingParams(), True)
    channel.send(output_channel.encode_command(("submit", [item])), timeout_s=10)
    _assert_the_rank_closed_it(reader, channel)
    channel.close()
    rank_end.close()


def _assert_the_rank_closed_it(reader: threading.Thread, channel) -> None:
    """The rank's reader has ended and the driver's end reads the end of file."""
    reader.join(10)
    assert not reader.is_alive()
    deadline = time.monotonic() + 10
    while not channel.closed and time.monotonic() < deadline:
        assert channel.read() == []
    assert channel.closed


def test_a_rank_that_reads_no_command_fails_the_send_in_time(listener):
    """A stopped rank reads nothing: once the socket's buffers are full, the send gives up
    at its limit (the driver then fails the rank) rather than waiting for ever; and a send on
    a closed channel raises, so the driver falls back to the actor call."""
    key = output_channel.new_key()
    rank_end = output_channel.connect(listener.path, key)
    channel = listener.accept(key, timeout_s=10)
    command = output_channel.encode_command(("abort", "x" * (8 << 20)))
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        channel.send(command, timeout_s=0.3)
    assert time.monotonic() - start < 5
    channel.close()
    with pytest.raises(OSError):
        channel.send(output_channel.encode_command(("abort", "x")), timeout_s=1)
    rank_end.close()
