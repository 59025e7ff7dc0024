"""Keep freed host memory for the next step's tensors instead of handing it back to the kernel.

glibc's malloc serves a block above its mmap threshold (128 KiB at first, then raised to the
largest block freed, up to 32 MiB) with a fresh mapping, and returns the top of its heap to the
kernel once more than twice that is free. A CPU engine allocates and frees the same large
tensors every step (a [64, 32000] float32 sampling row block is 8 MiB; a prefill step's expert
activations are tens of MiB), so without this each step's first write to them page-faults again,
4 KiB at a time: temperature 1.0 sampling at batch 64, vocabulary 32k, took 12.9-38.7 ms on
an AMD EPYC with two threads, and 4.4 ms once the memory was kept (docs/benchmark_notes.md,
"Sampler cost per step"). vLLM's CPU backend preloads tcmalloc for the same reason.

`retain_freed_memory` raises both thresholds to 1 GiB with `mallopt`: blocks below it come
from the heap, and freed ones stay there for reuse. The price is resident memory: a process
keeps its peak heap. It is applied by every engine whose device is the CPU (a GPU engine's large
tensors live in the device's caching allocator already), once per process, on glibc only; a
preloaded tcmalloc or jemalloc answers `mallopt` itself. `LOCKSTEP_HOST_ALLOCATOR=system`
leaves malloc as it was.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
RETAIN_BYTES = 1 << 30
ENV = "LOCKSTEP_HOST_ALLOCATOR"

_applied: bool | None = None


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to RETAIN_BYTES, once per process. Returns whether
    they are raised (False: opted out, not Linux/glibc, or glibc refused)."""
    global _applied
    if _applied is not None:
        return _applied
    choice = os.environ.get(ENV, "retain").strip().lower()
    if choice not in ("retain", "system"):
        raise ValueError(f"{ENV} must be 'retain' or 'system', got {choice!r}")
    _applied = choice == "retain" and _mallopt_all()
    return _applied


def _mallopt_all() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # The mmap threshold first: setting either one fixes both (no more dynamic raising).
    return all(
        mallopt(option, RETAIN_BYTES) == 1 for option in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD)
    )
