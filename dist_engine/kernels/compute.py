"""Lockstep's CPU compute kernels (csrc/), built on first use as one torch extension module.

- `decode_attention()`: decode attention straight from the paged KV cache, any float dtype
  (csrc/paged_decode_attention.cpp).
- `prefill_attention()`: float32 or bfloat16 causal prefill attention straight from the paged
  KV cache, no padding (csrc/paged_prefill_attention.cpp).
- `rope_write_kv()`: float32 or bfloat16 rotary q/k plus the paged KV cache write in one pass
  (csrc/rope_cache.cpp).
- `routed_swiglu()`: the expert side of an MoE layer, routed rows to their weighted sum of
  SwiGLU experts, without padding, float32 or bfloat16, the latter on AMX tiles where the
  processor has them (csrc/grouped_swiglu.cpp; `routed_swiglu_amx()` says whether it does).
- `rms_norm()`: RMSNorm in one pass, float32 or bfloat16 (csrc/rms_norm.cpp).
- `sample_rows()`: the sampler's draw for unfiltered rows, one pass per row
  (csrc/sample_rows.cpp).

Each returns the compiled function, or None when the module failed to build (no C++ compiler
or ninja, say; one warning names the cause). Nothing here decides whether a kernel is used:
the backends do (`attention_backend`, `expert_backend`, `norm_backend`; `dist_engine.backends`),
and the PyTorch path they fall back to computes the same thing.

A first build takes tens of seconds, so the engine and the launchers call `prepare()` before
their first collective (a rank compiling inside a collective would hold up its peers); a later
lookup is a dictionary access.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from dist_engine.kernels.build import CSRC, binary_name, torch_extension

SOURCES = tuple(
    CSRC / name
    for name in (
        "paged_decode_attention.cpp",  # also the module definition of all of them
        "paged_prefill_attention.cpp",
        "grouped_swiglu.cpp",
        "rms_norm.cpp",
        "rope_cache.cpp",
        "sample_rows.cpp",
    )
)
# -march=native: the build runs on the machine that uses it (the cache key holds the CPU's
# flags). -fopenmp makes at::parallel_for use torch's own OpenMP pool: the library's
# libgomp.so.1 resolves to the copy torch already loaded (same soname), so there is one pool
# and torch.set_num_threads governs it.
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_state: dict[str, Any] = {}

Kernel = Callable[..., torch.Tensor]


def decode_attention() -> Kernel | None:
    """`paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens,
    scale)`, or None."""
    return _kernel("paged_decode_attention")


def prefill_attention() -> Kernel | None:
    """`paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
    num_cached, scale)` for float32 or bfloat16 (computed in float32), or None."""
    return _kernel("paged_prefill_attention")


def rope_write_kv() -> Kernel | None:
    """`rope_write_kv(query, key, value, cos, sin, slot_mapping, key_cache, value_cache)` →
    rotated query, for float32 or bfloat16; `apply_rotary` + `write_kv` to float32 rounding
    (bit for bit in bfloat16). Or None."""
    return _kernel("rope_write_kv")


def routed_swiglu() -> Kernel | None:
    """`routed_swiglu(hidden, local_slots, weights, w13, w2)`: the contract of
    `moe.experts.LocalExperts.weighted_sum` on the CPU, float32 or bfloat16 (weights float32).
    Or None."""
    return _kernel("routed_swiglu")


def routed_swiglu_amx() -> bool:
    """Whether `routed_swiglu` multiplies bfloat16 on AMX tiles in this process: built for a
    processor with AMX-BF16, the tiles granted by Linux, and neither LOCKSTEP_BF16_DOT=0 nor
    LOCKSTEP_BF16_AMX=0 set (read at each call, as the kernel reads them). A slot's GEMMs run
    there when it has at least 5 rows and the shapes take 32-wide k steps and 64-wide column
    blocks; elsewhere, on the vector bf16 dot products."""
    module = _module()
    return module is not None and bool(module.routed_swiglu_amx())


def sample_rows() -> Kernel | None:
    """`sample_rows(logits, temperatures, uniforms, block)`: one token per row of float32
    logits from softmax(logits / t), unfiltered, by the sampler's inverse CDF over blocks of
    `block` tokens (`dist_engine.engine.sampler`); -1 for a row with a NaN or no finite
    maximum. Or None."""
    return _kernel("sample_rows")


def rms_norm() -> Kernel | None:
    """`rms_norm(x, weight, eps)` for float32 or bfloat16, `layers.norm.RMSNorm`'s result to
    float32 rounding (in bfloat16: HF's two roundings, after the float32 sum). Or None."""
    return _kernel("rms_norm")


def kernels_name() -> str:
    """The build's cache name: it changes whenever the kernels' binary would."""
    return binary_name("lockstep_kernels", SOURCES, (*CFLAGS, *LDFLAGS))


def prepare() -> bool:
    """Build (or load) the module now; True if it is available."""
    return _module() is not None


def _kernel(name: str) -> Kernel | None:
    module = _module()
    return None if module is None else getattr(module, name)


def _module() -> Any:
    """The extension module, built on the first call in a process; None if it failed."""
    with _lock:
        if "module" not in _state:
            module, problem = torch_extension("lockstep_kernels", SOURCES, CFLAGS, LDFLAGS)
            if module is None:
                warnings.warn(
                    f"lockstep: the CPU compute kernels (dist_engine/kernels/csrc) could not be "
                    f"built ({problem}); the backends use the PyTorch paths",
                    RuntimeWarning,
                    stacklevel=4,
                )
            _state["module"] = module
        return _state["module"]
