"""Lockstep's CPU kernels (csrc/), built on first use as one extension module.

- `decode_kernel()`: decode attention straight from the paged KV cache
  (csrc/paged_decode_attention.cpp; used by `dist_engine.attention.torch_backend`).
- `prefill_kernel()`: float32 causal prefill attention straight from the paged KV cache, no
  padding (csrc/paged_prefill_attention.cpp; used by `dist_engine.attention.torch_backend`).
- `swiglu_kernel()`: the float32 expert side of an MoE layer, routed rows to their weighted
  sum of SwiGLU experts, without padding (csrc/grouped_swiglu.cpp; `MoEBlock` hands it to its
  `LocalExperts`).
- `rms_norm_kernel()`: float32 RMSNorm in one pass (csrc/rms_norm.cpp; used by `RMSNorm`).
- `rope_kernel()`: float32 rotary q/k plus the paged KV cache write in one pass
  (csrc/rope_cache.cpp; used by `Attention`).
- `shm_exchange_type()`: the shared-memory all-to-all for ranks on one host
  (csrc/shm_exchange.cpp; used by `dist_engine.distributed.shm_exchange`). Not a kernel switch: the
  config's `parallel.moe_exchange` chooses it.

Each returns the compiled function, or None when it cannot be used: its switch is set to 0
(`LOCKSTEP_FUSED_ATTENTION=0`, `LOCKSTEP_FUSED_EXPERTS=0`, `LOCKSTEP_FUSED_NORM=0`), or the
build failed (no C++ compiler or ninja, say — then one warning names the cause). Callers fall
back to the plain PyTorch path, which computes the same thing (tests/test_kv_cache.py,
tests/test_moe_experts.py and tests/test_layers.py run both).

The build goes through `torch.utils.cpp_extension.load` into torch's extension cache
(`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`), once per machine and source
version; processes that start together wait on torch's build lock and then load the cached
library. A first build takes tens of seconds, so `DPEngine` calls `prepare()` before its
first collective (a rank compiling inside a collective would hold up its peers); a later
lookup is a dictionary access.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "paged_decode_attention.cpp",  # also the module definition of all of them
        "paged_prefill_attention.cpp",
        "grouped_swiglu.cpp",
        "rms_norm.cpp",
        "rope_cache.cpp",
        "shm_exchange.cpp",
    )
)
ENV_SWITCH = "LOCKSTEP_FUSED_ATTENTION"  # the decode and prefill attention kernels
EXPERTS_ENV_SWITCH = "LOCKSTEP_FUSED_EXPERTS"  # the SwiGLU expert kernel
NORM_ENV_SWITCH = "LOCKSTEP_FUSED_NORM"  # the RMSNorm and rotary/KV-write kernels

_lock = threading.Lock()
_state: dict[str, Any] = {}


def enabled(switch: str = ENV_SWITCH) -> bool:
    return os.environ.get(switch, "1").strip().lower() not in ("0", "false", "no", "off")


def decode_kernel() -> Callable[..., torch.Tensor] | None:
    """`paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens,
    scale)`, or None (see the module docstring). Builds on the first call in a process."""
    return _kernel(ENV_SWITCH, "paged_decode_attention")


def prefill_kernel() -> Callable[..., torch.Tensor] | None:
    """`paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
    num_cached, scale)`, or None (see the module docstring); float32 on the CPU, under the
    attention kernel's switch."""
    return _kernel(ENV_SWITCH, "paged_prefill_attention")


def swiglu_kernel() -> Callable[..., torch.Tensor] | None:
    """`routed_swiglu(hidden, local_slots, weights, w13, w2)`, or None (see the module
    docstring); the contract of `moe.experts.LocalExperts.weighted_sum` for float32 on the
    CPU."""
    return _kernel(EXPERTS_ENV_SWITCH, "routed_swiglu")


def rms_norm_kernel() -> Callable[..., torch.Tensor] | None:
    """`rms_norm(x, weight, eps)`, or None (see the module docstring); float32 on the CPU,
    `dist_engine.layers.RMSNorm`'s result to float32 rounding."""
    return _kernel(NORM_ENV_SWITCH, "rms_norm")


def rope_kernel() -> Callable[..., torch.Tensor] | None:
    """`rope_write_kv(query, key, value, cos, sin, slot_mapping, key_cache, value_cache)` →
    rotated query, or None (see the module docstring); float32 on the CPU, the result of
    `apply_rotary` + `write_kv` to float32 rounding. Shares the RMSNorm kernel's switch."""
    return _kernel(NORM_ENV_SWITCH, "rope_write_kv")


def shm_exchange_type() -> Any:
    """The `ShmExchange` class (csrc/shm_exchange.cpp), or None if the module failed to build."""
    module = _module()
    return None if module is None else module.ShmExchange


def prepare() -> None:
    """Build (or load) the module now. The launchers and `DPEngine` call this before their
    first collective; otherwise the first lookup builds."""
    _module()


def _kernel(switch: str, name: str) -> Callable[..., torch.Tensor] | None:
    if not enabled(switch):
        return None
    module = _module()
    return None if module is None else getattr(module, name)


def _module() -> Any:
    """The extension module, built on the first call in a process; None if it failed."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


# -march=native: the build runs on the machine that uses it (see _module_name). -fopenmp makes
# at::parallel_for use torch's own OpenMP pool: the library's libgomp.so.1 resolves to the copy
# torch already loaded (same soname), so there is one pool and torch.set_num_threads governs it.
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)


# A build normally takes ~25 s. torch's build lock waits forever for a lock file left behind by
# a process killed mid-build; past this limit the engine starts on the PyTorch path instead.
BUILD_TIMEOUT_S = 600.0


def _build() -> Any:
    result: dict[str, object] = {}

    def build() -> None:
        try:
            from torch.utils import cpp_extension

            result["module"] = cpp_extension.load(
                name=_module_name(),
                sources=[str(source) for source in SOURCES],
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
        return result["module"]
    if builder.is_alive():
        cause = (
            f"no result after {BUILD_TIMEOUT_S:.0f} s; the usual cause is a stale `lock` file "
            f"left by a killed build in torch's extension directory (TORCH_EXTENSIONS_DIR, "
            f"default ~/.cache/torch_extensions)"
        )
    else:
        cause = repr(result.get("error"))[:300]
    warnings.warn(
        f"lockstep: the CPU kernels (dist_engine/csrc) could not be built ({cause}); using "
        f"the PyTorch paths, and the process group for the MoE all-to-alls",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


def _module_name() -> str:
    """Distinct per source version and per CPU, because the build targets the CPU it runs on
    (-march=native) and the cache directory may be shared between machines."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *sorted(CSRC.glob("*.h"))):  # headers too: they change the build
        digest.update(source.read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(platform.machine().encode())
    digest.update(_cpu_flags().encode())
    digest.update(torch.__version__.encode())
    return f"lockstep_kernels_{digest.hexdigest()[:16]}"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
