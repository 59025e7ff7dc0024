"""The fused CPU decode-attention kernel (csrc/paged_decode_attention.cpp), built on first use.

`decode_kernel()` returns the compiled function, or None when it cannot be used: the switch
`LOCKSTEP_FUSED_ATTENTION=0` is set, or the build failed (no C++ compiler or ninja, say — then
one warning names the cause). Callers fall back to the plain PyTorch path, which computes the
same thing (tests/test_kv_cache.py runs both against a dense reference).

The build goes through `torch.utils.cpp_extension.load` into torch's extension cache
(`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`), once per machine and source
version; processes that start together wait on torch's build lock and then load the cached
library. A first build takes tens of seconds, so `DPEngine` asks for the kernel before its first
collective (a rank compiling inside a collective would hold up its peers); a later call is a
dictionary lookup.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
ENV_SWITCH = "LOCKSTEP_FUSED_ATTENTION"

_lock = threading.Lock()
_state: dict[str, Callable[..., torch.Tensor] | None] = {}


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def decode_kernel() -> Callable[..., torch.Tensor] | None:
    """`paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens,
    scale)`, or None (see the module docstring). Builds on the first call in a process."""
    if not enabled():
        return None
    with _lock:
        if "kernel" not in _state:
            _state["kernel"] = _build()
        return _state["kernel"]


# -march=native: the build runs on the machine that uses it (see _module_name). -fopenmp makes
# at::parallel_for use torch's own OpenMP pool: the library's libgomp.so.1 resolves to the copy
# torch already loaded (same soname), so there is one pool and torch.set_num_threads governs it.
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)


# A build normally takes ~25 s. torch's build lock waits forever for a lock file left behind by
# a process killed mid-build; past this limit the engine starts on the PyTorch path instead.
BUILD_TIMEOUT_S = 600.0


def _build() -> Callable[..., torch.Tensor] | None:
    result: dict[str, object] = {}

    def build() -> None:
        try:
            from torch.utils import cpp_extension

            result["module"] = cpp_extension.load(
                name=_module_name(),
                sources=[str(SOURCE)],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                verbose=False,
            )
        except Exception as exc:  # any build problem means "use the PyTorch path"
            result["error"] = exc

    builder = threading.Thread(target=build, name="lockstep-kernel-build", daemon=True)
    builder.start()
    builder.join(BUILD_TIMEOUT_S)
    if "module" in result:
        return result["module"].paged_decode_attention  # type: ignore[attr-defined]
    if builder.is_alive():
        cause = (
            f"no result after {BUILD_TIMEOUT_S:.0f} s; the usual cause is a stale `lock` file "
            f"left by a killed build in torch's extension directory (TORCH_EXTENSIONS_DIR, "
            f"default ~/.cache/torch_extensions)"
        )
    else:
        cause = repr(result.get("error"))[:300]
    warnings.warn(
        f"lockstep: the fused CPU decode-attention kernel could not be built ({cause}); using "
        f"the PyTorch path (set {ENV_SWITCH}=0 to skip the attempt)",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


def _module_name() -> str:
    """Distinct per source version and per CPU, because the build targets the CPU it runs on
    (-march=native) and the cache directory may be shared between machines."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(platform.machine().encode())
    digest.update(_cpu_flags().encode())
    digest.update(torch.__version__.encode())
    return f"lockstep_paged_decode_{digest.hexdigest()[:16]}"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
