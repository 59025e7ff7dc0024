"""Building Lockstep's native code on the machine that runs it, once, into a cache.

Two independent builds, so a failure of one never costs the other:

- `torch_extension` builds a PyTorch C++ extension (the compute kernels, `kernels.compute`)
  with `torch.utils.cpp_extension.load` and ninja: tens of seconds the first time.
- `shared_library` builds a plain C++ library with the system compiler and loads it with
  ctypes (the shared-memory transport, `distributed.shm_exchange`): about a second, no torch
  headers, no ninja.

Both land under `cache_root()/kernels/<name>`, where `<name>` carries a hash of everything
that changes the binary: the sources and headers, the flags, the compiler, this CPU's
instruction-set flags (the code is built with -march=native), the torch build the extension
links against (its version and where it is installed, so two virtual environments on one host
do not keep rebuilding each other's module) and the Python ABI. The build compiles a copy of
the sources kept in that directory, not the checkout's files: the build rules name the
sources' paths, so two checkouts of the same code building from their own paths would each
see the other's rules as stale and rebuild. A first build says so on the log and reports its
progress; a later start loads the cached file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dist_engine.log import get_logger

CSRC = Path(__file__).parent / "csrc"
# Far longer than a normal ninja build (docs/benchmark_notes.md, "Start-up and failure
# detection"). torch's build lock waits forever for a lock file left behind by a process killed
# mid-build; past this limit the caller gets None (and falls back).
BUILD_TIMEOUT_S = 600.0
# Part of every cache key: bumped when the way things are built changes (not their sources).
BUILD_LAYOUT = "copied-sources-1"
_PROGRESS_EVERY_S = 15.0


def cache_root() -> Path:
    """Lockstep's cache: `$LOCKSTEP_CACHE/lockstep`, else `$XDG_CACHE_HOME/lockstep`, else
    `~/.cache/lockstep` (built kernels, the built-in model)."""
    base = os.environ.get("LOCKSTEP_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(base) / "lockstep" if base else Path.home() / ".cache" / "lockstep"


def binary_name(prefix: str, sources: Sequence[Path], flags: Sequence[str]) -> str:
    """`prefix_<hash>`: the hash covers everything that changes the built file."""
    digest = hashlib.sha256()
    for source in (*sources, *sorted(CSRC.glob("*.h"))):
        digest.update(source.read_bytes())
    for part in (
        BUILD_LAYOUT,
        " ".join(flags),
        _compiler_version(),
        platform.machine(),
        cpu_flags(),
        torch.__version__,
        str(Path(torch.__file__).parent),
        sys.implementation.cache_tag or "",
    ):
        digest.update(part.encode())
    return f"{prefix}_{digest.hexdigest()[:16]}"


def torch_extension(
    prefix: str, sources: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str]
) -> tuple[Any, str]:
    """Build (or load) a torch extension module. Returns (module, "") or (None, why not)."""
    name = binary_name(prefix, sources, (*cflags, *ldflags))
    directory = cache_root() / "kernels" / name
    copies = _copy_sources(sources, directory / "src")

    def build() -> Any:
        from torch.utils import cpp_extension

        return cpp_extension.load(
            name=name,
            sources=[str(source) for source in copies],
            extra_cflags=list(cflags),
            extra_ldflags=list(ldflags),
            build_directory=str(directory),
            verbose=False,
        )

    first = not (directory / f"{name}.so").is_file()
    return _timed_build(f"CPU kernels ({prefix})", build, first, directory)


def shared_library(prefix: str, source: Path, cflags: Sequence[str]) -> tuple[Any, str]:
    """Build (or load) a plain C++ shared library with a C interface, loaded through ctypes.
    Returns (ctypes.CDLL, "") or (None, why not)."""
    name = binary_name(prefix, [source], cflags)
    directory = cache_root() / "kernels" / name
    target = directory / f"{name}.so"

    def build() -> Any:
        if not target.is_file():
            copy = _copy_sources([source], directory / "src")[0]
            compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
            if compiler is None:
                raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
            directory.mkdir(parents=True, exist_ok=True)
            partial = directory / f"{name}.{os.getpid()}.partial.so"
            command = [compiler, *cflags, "-shared", "-fPIC", str(copy), "-o", str(partial)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-800:]}")
            partial.replace(target)  # atomic: a concurrent build keeps one complete file
        return ctypes.CDLL(str(target))

    return _timed_build(f"{prefix} library", build, not target.is_file(), directory)


def _timed_build(what: str, build: Callable[[], Any], first: bool, where: Path) -> tuple[Any, str]:
    """Run `build` on a thread with a time limit; log a first build and its progress."""
    log = get_logger()
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = build()
        except Exception as error:  # any build problem means "not available"
            result["error"] = error

    if first:
        log.info("building %s (first start on this machine only) in %s", what, where)
    start = time.monotonic()
    builder = threading.Thread(target=run, name="lockstep-build", daemon=True)
    builder.start()
    while builder.is_alive() and (left := start + BUILD_TIMEOUT_S - time.monotonic()) > 0:
        builder.join(min(_PROGRESS_EVERY_S, left))
        if first and builder.is_alive() and time.monotonic() - start < BUILD_TIMEOUT_S:
            log.info("still building %s: %.0f s so far", what, time.monotonic() - start)
    if "value" in result:
        if first:
            log.info("built %s in %.1f s", what, time.monotonic() - start)
        return result["value"], ""
    if builder.is_alive():
        return None, (
            f"no result after {BUILD_TIMEOUT_S:.0f} s; the usual cause is a stale `lock` file "
            f"left by a killed build in {where}"
        )
    return None, repr(result.get("error"))[:500]


def _copy_sources(sources: Sequence[Path], into: Path) -> list[Path]:
    """The sources and every header beside them, copied into `into` (their content is what the
    directory's name hashes, so a copy already there is the same); returns the copies."""
    into.mkdir(parents=True, exist_ok=True)
    for path in (*sources, *CSRC.glob("*.h")):
        target = into / path.name
        if not target.is_file() or target.read_bytes() != path.read_bytes():
            partial = into / f".{path.name}.{os.getpid()}"
            shutil.copyfile(path, partial)
            partial.replace(target)  # atomic: a concurrent reader sees one whole file
    return [into / source.name for source in sources]


def cpu_flags() -> str:
    """This CPU's instruction-set flags (/proc/cpuinfo), for cache keys and benchmark tables."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler_version() -> str:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return "none"
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return compiler
    return done.stdout.splitlines()[0] if done.stdout else compiler
