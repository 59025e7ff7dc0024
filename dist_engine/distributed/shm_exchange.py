"""The MoE all-to-all through shared memory, for an EP group whose ranks share one host.

On one host, gloo sends each all-to-all over loopback TCP through its worker threads; for the
tens to hundreds of KB of an MoE dispatch that is latency (system calls, thread hand-offs,
wake-ups), not bandwidth. `SharedMemoryExchange` (csrc/shm_exchange.cpp) has each rank copy
its rows into the receiver's mailbox in a segment every rank maps, and the receiver copy them
out: two memcpys and a few atomic counters per pair, no thread, no system call while data
flows. It implements `moe.exchange.Exchange`, so the MoE layer uses it like a process group,
and the engine's votes use its `allreduce_min` (dist_engine/step_sync.py).

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

import os
import socket
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from dist_engine.engine.config import MOE_EXCHANGES
from dist_engine.kernels import build as native

SHM_DIR = Path("/dev/shm")
# Bytes per mailbox slot; each (receiver, sender) pair has two. A larger message goes in
# chunks, pipelined over the two slots. 2 ranks: 4 MiB of shared memory; 8 ranks: 64 MiB.
DEFAULT_SLOT_BYTES = 512 * 1024


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
        # The kernel releases the GIL while it copies and waits.
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
    exchange_type, problem = None, ""
    if mode != "process_group":
        exchange_type = native.shm_exchange_type()  # every rank builds it before the gather
        if exchange_type is None:
            problem = "the kernel module (dist_engine/csrc) did not build"
        elif not SHM_DIR.is_dir():
            problem = f"{SHM_DIR} does not exist"
    facts: list[object] = [None] * size
    dist.all_gather_object(facts, (mode, host_identity(), os.getpid(), problem), group=group)
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
    path = [str(SHM_DIR / f"lockstep-{uuid.uuid4().hex}") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0, group=group)
    handle, error = None, ""
    if rank == 0:
        try:
            handle = exchange_type(path[0], True, rank, size, slot_bytes, timeout_s)
        except Exception as exc:  # e.g. /dev/shm full
            error = str(exc)
    created = [error]
    dist.broadcast_object_list(created, src=0, group=group)
    if not created[0] and rank != 0:
        try:
            handle = exchange_type(path[0], False, rank, size, slot_bytes, timeout_s)
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
    errors: list[object] = [None] * size
    dist.all_gather_object(errors, error or created[0], group=group)
    if rank == 0 and handle is not None:
        handle.unlink()  # every rank has mapped it, or failed and will not try again
    problems = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if problems:
        if handle is not None:
            handle.close()
        return _give_up(problems, required)
    return SharedMemoryExchange(handle, rank, size, path[0])


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
