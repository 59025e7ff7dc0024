"""The MoE all-to-all through shared memory, for an EP group whose ranks share one host.

On one host, gloo sends each all-to-all over loopback TCP through its worker threads; for the
tens to hundreds of KB of an MoE dispatch that is latency (system calls, thread hand-offs,
wake-ups), not bandwidth. `SharedMemoryExchange` (kernels/csrc/shm_exchange.cpp) has each rank
copy its rows into the receiver's mailbox in a segment every rank maps, and the receiver copy
them out: two memcpys and a few atomic counters per pair, no thread, no system call while data
flows. It implements `moe.exchange.Exchange`, so the MoE layer uses it like a process group,
and the engine's votes use its `allreduce_min` (distributed/step_sync.py). The C++ side is a
small library of its own, built in about a second and loaded with ctypes (`kernels.build`), so
it does not depend on the compute kernels' build.

`open_shared_memory_exchange` sets it up, collectively, over the (gloo) vote group. Every rank
takes the same decision: the exchange is used only if every rank reports the same host (host
name, boot id and /dev/shm device), the kernel module built, each rank mapped the segment and
can see every peer's process. Rank 0 creates the file under /dev/shm and removes its name as
soon as every rank has mapped it (a few milliseconds after creating it), so no file outlives
the group even if its ranks are killed later.

Failure rules, as for a process group's collective: a call that waits past the collective
timeout raises and names the ranks it still waits for; so does a call whose peer's process has
exited (checked every 20 ms while waiting); a rank that gives up marks the segment so its peers
raise at once instead of waiting for their own timeouts (the engine also marks it, `abort`,
when its loop fails for any other reason); ranks whose calls diverged (another call number or
size on a pair) raise with both views instead of mixing data. A failed segment stays failed.
"""

from __future__ import annotations

import ctypes
import math
import os
import socket
import threading
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dist_engine.distributed.plain_data import all_gather_json, broadcast_json

# `parallel.moe_exchange`: how the MoE all-to-alls travel (see open_shared_memory_exchange);
# its values live with the setting, in the torch-free engine config.
from dist_engine.engine.config import MOE_EXCHANGES
from dist_engine.kernels.build import CSRC, shared_library

SHM_DIR = Path("/dev/shm")
# Bytes per mailbox slot; each (receiver, sender) pair has two. A larger message goes in
# chunks, pipelined over the two slots. 2 ranks: 4 MiB of shared memory; 8 ranks: 64 MiB.
DEFAULT_SLOT_BYTES = 512 * 1024
_ERROR_BYTES = 1024
_library_lock = threading.Lock()
_library: dict[str, Any] = {}


def transport_library() -> tuple[Any, str]:
    """The transport's ctypes library, built on the first call in a process: (library, "")
    or (None, why not)."""
    with _library_lock:
        if "lib" not in _library:
            lib, problem = shared_library(
                "lockstep_shm", CSRC / "shm_exchange.cpp", ("-O2", "-std=c++17")
            )
            if lib is not None:
                _declare(lib)
            _library["lib"], _library["problem"] = lib, problem
        return _library["lib"], _library["problem"]


def _declare(lib: Any) -> None:
    i64, ptr, size = ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t
    lib.lockstep_shm_open.argtypes = [
        ctypes.c_char_p, ctypes.c_int, i64, i64, i64, ctypes.c_double,
        ctypes.POINTER(ptr), ctypes.c_char_p, size,
    ]  # fmt: skip
    lib.lockstep_shm_all_to_all.argtypes = [
        ptr, ptr, i64, ptr, i64, i64, ctypes.POINTER(i64), i64, ctypes.POINTER(i64), i64,
        ctypes.c_char_p, size,
    ]  # fmt: skip
    for name in ("close", "free", "unlink", "abort", "aborted_by"):
        getattr(lib, f"lockstep_shm_{name}").argtypes = [ptr]
    for name in ("close", "free", "unlink", "abort"):
        getattr(lib, f"lockstep_shm_{name}").restype = None
    lib.lockstep_shm_aborted_by.restype = i64
    lib.lockstep_shm_pids.argtypes = [ptr, ctypes.POINTER(i64)]
    lib.lockstep_shm_pids.restype = None


class _Segment:
    """One rank's mapping of a segment, through the library's C interface."""

    def __init__(
        self, path: str, create: bool, rank: int, size: int, slot_bytes: int, timeout_s: float
    ) -> None:
        lib, problem = transport_library()
        if lib is None:
            raise RuntimeError(f"the shared-memory library did not build: {problem}")
        self._lib = lib
        self.size = size
        handle = ctypes.c_void_p()
        error = ctypes.create_string_buffer(_ERROR_BYTES)
        status = lib.lockstep_shm_open(
            path.encode(), int(create), rank, size, slot_bytes, timeout_s,
            ctypes.byref(handle), error, _ERROR_BYTES,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(error.value.decode(errors="replace"))
        self._handle = handle
        self._error = error

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
    ) -> None:
        row_bytes = math.prod(output.shape[1:]) * output.element_size()
        splits = ctypes.c_int64 * self.size
        status = self._lib.lockstep_shm_all_to_all(
            self._handle, output.data_ptr(), output.shape[0], input.data_ptr(), input.shape[0],
            row_bytes, splits(*output_splits) if output_splits else None, len(output_splits),
            splits(*input_splits) if input_splits else None, len(input_splits),
            self._error, _ERROR_BYTES,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(self._error.value.decode(errors="replace"))

    def pids(self) -> list[int]:
        out = (ctypes.c_int64 * self.size)()
        self._lib.lockstep_shm_pids(self._handle, out)
        return list(out)

    def abort(self) -> None:
        self._lib.lockstep_shm_abort(self._handle)

    def aborted_by(self) -> int:
        return self._lib.lockstep_shm_aborted_by(self._handle)

    def unlink(self) -> None:
        self._lib.lockstep_shm_unlink(self._handle)

    def close(self) -> None:
        self._lib.lockstep_shm_close(self._handle)

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle:
            self._lib.lockstep_shm_free(handle)
            self._handle = None


class SharedMemoryExchange:
    """`moe.exchange.Exchange` over a shared-memory segment; CPU tensors only."""

    def __init__(self, handle: object, rank: int, size: int, path: str) -> None:
        self._handle = handle
        self.rank = rank
        self.size = size
        self.path = path  # the segment's file name, removed once every rank mapped it

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        if output.device.type != "cpu" or input.device.type != "cpu":
            raise ValueError("the shared-memory exchange moves CPU tensors only")
        if not output.is_contiguous():
            raise ValueError("the output of an all-to-all must be contiguous")
        if output.dim() == 0 or output.dtype != input.dtype or output.shape[1:] != input.shape[1:]:
            raise ValueError(
                f"all-to-all rows differ: output {output.dtype} {tuple(output.shape)}, input "
                f"{input.dtype} {tuple(input.shape)}"
            )
        # ctypes releases the GIL while the library copies and waits.
        self._handle.all_to_all(
            output,
            input.contiguous(),
            list(output_split_sizes or ()),
            list(input_split_sizes or ()),
        )

    def allreduce_min(self, values: torch.Tensor) -> torch.Tensor:
        """MIN over ranks of a 1-D int64 tensor, as an all-gather through the mailboxes: every
        rank sends its vector to every rank and takes the minimum of what it gets."""
        gathered = values.new_empty(self.size * values.numel())
        self.all_to_all_single(gathered, values.repeat(self.size))
        return gathered.view(self.size, -1).amin(dim=0)

    def abort(self) -> None:
        """Tell the peers this rank has failed: their current or next call raises at once,
        naming this rank, instead of waiting for the collective timeout."""
        self._handle.abort()

    def close(self) -> None:
        """Unmap the segment; a later call raises."""
        self._handle.close()


def host_identity() -> str:
    """Equal on two processes iff they can share /dev/shm: same host, same boot, same mount."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = "?"
    try:
        shm_dev = str(os.stat(SHM_DIR).st_dev)
    except OSError:
        return "no /dev/shm"
    return f"{socket.gethostname()}|{boot_id}|{shm_dev}"


def open_shared_memory_exchange(
    group: dist.ProcessGroup,
    mode: str,
    *,
    timeout_s: float,
    slot_bytes: int = DEFAULT_SLOT_BYTES,
) -> SharedMemoryExchange | None:
    """Collective over `group` (gloo, all ranks of the EP group, rank order = EP rank order).

    mode: `parallel.moe_exchange`, which every rank must share (checked here: a rank that
    skipped this setup would leave its peers waiting in it). `process_group` returns None.
    `auto` returns the exchange on every rank, or None on every rank when it cannot be used
    (ranks on several hosts, no /dev/shm, the kernel module did not build, a rank could not map
    the segment; all but the first with a warning). `shared_memory` raises `RuntimeError`
    with the reason instead of returning None.
    """
    if mode not in MOE_EXCHANGES:
        raise ValueError(
            f"parallel.moe_exchange must be one of {list(MOE_EXCHANGES)}, got {mode!r}"
        )
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    problem = ""
    if mode != "process_group":
        library, why = transport_library()  # every rank builds it before the gather
        if library is None:
            problem = f"the shared-memory library did not build: {why}"
        elif not SHM_DIR.is_dir():
            problem = f"{SHM_DIR} does not exist"
    facts = all_gather_json((mode, host_identity(), os.getpid(), problem), group)
    modes = [m for m, _, _, _ in facts]
    if len(set(modes)) != 1:
        raise ValueError(
            "parallel.moe_exchange differs between ranks: "
            + ", ".join(f"rank {r}: {m}" for r, m in enumerate(modes))
        )
    required = mode == "shared_memory"
    if mode == "process_group":
        return None
    if len({identity for _, identity, _, _ in facts}) != 1:
        # The usual multi-node case: nothing to warn about unless it was asked for.
        return _give_up(["the ranks are not on one host"], required, warn=False)
    problems = [f"rank {r}: {p}" for r, (_, _, _, p) in enumerate(facts) if p]
    if problems:
        return _give_up(problems, required)

    # Rank 0 creates the segment; then every other rank maps it; then rank 0 removes the name.
    path = broadcast_json(str(SHM_DIR / f"lockstep-{uuid.uuid4().hex}"), src=0, group=group)
    handle, error = None, ""
    if rank == 0:
        try:
            handle = _Segment(path, True, rank, size, slot_bytes, timeout_s)
        except Exception as exc:  # e.g. /dev/shm full
            error = str(exc)
    created = broadcast_json(error, src=0, group=group)
    if not created and rank != 0:
        try:
            handle = _Segment(path, False, rank, size, slot_bytes, timeout_s)
        except Exception as exc:
            error = str(exc)
    # Each rank checks that it can see every peer's process: the exchange detects a dead peer
    # by its pid, which would be meaningless across pid namespaces.
    if handle is not None and not error:
        for peer_rank, (_, _, pid, _) in enumerate(facts):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                error = f"cannot see rank {peer_rank}'s process (pid {pid}; another pid namespace?)"
            except PermissionError:
                pass  # it exists
    errors = all_gather_json(error or created, group)
    if rank == 0 and handle is not None:
        handle.unlink()  # every rank has mapped it, or failed and will not try again
    problems = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if problems:
        if handle is not None:
            handle.close()
        return _give_up(problems, required)
    return SharedMemoryExchange(handle, rank, size, path)


def _give_up(problems: list[str], required: bool, warn: bool = True) -> None:
    reason = "; ".join(sorted(set(problems)))
    if required:
        raise RuntimeError(f"parallel.moe_exchange is shared_memory, but {reason}")
    if warn:
        warnings.warn(
            f"lockstep: the MoE all-to-all uses the process group, not shared memory ({reason})",
            RuntimeWarning,
            stacklevel=3,
        )
    return None
