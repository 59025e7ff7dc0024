"""`dtype: auto`: the checkpoint's own dtype where the device runs it well, else float32.

- On a GPU: the checkpoint's 16-bit dtype (bf16 or fp16); a float32 checkpoint runs in bf16,
  as serving engines run it; block-FP8 checkpoints dequantize to bf16.
- On a CPU: bf16 only where the processor has native bf16 arithmetic (AVX512_BF16 or AMX)
  *and* a bf16 matrix product of the model's decode shape measures faster than float32 there;
  otherwise float32 (AVX2-only processors emulate bf16, several times slower).

Every rank resolves it before loading and the group agrees on the result (a rank that
resolved otherwise refuses to start, naming the setting), so ranks on mixed hardware never
mix dtypes; the run summary says what was chosen and why.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from dist_engine.kernels.build import cpu_flags

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_SIXTEEN_BIT = {"bfloat16", "float16"}


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # torch's name
    reason: str

    def describe(self) -> str:
        return f"{self.dtype} ({self.reason})"


def checkpoint_dtype(hf_config: dict[str, Any]) -> str:
    """The dtype config.json says the weights are in (`torch_dtype`, or 5.x's `dtype`);
    FP8 block-quantized releases count as bf16 (what they dequantize to)."""
    if hf_config.get("quantization_config"):
        return "bfloat16"
    value = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    return value if value in ("float32", "bfloat16", "float16", "float64") else "float32"


def resolve_auto_dtype(
    stored: str,
    device: torch.device | str | None,
    hidden_size: int,
    intermediate_size: int,
    num_tokens: int,
    *,
    flags: frozenset[str] | None = None,
    time_matmul: Any = None,
) -> DtypeChoice:
    """What `dtype: auto` runs a checkpoint stored in ``stored`` as, on ``device``.

    ``flags`` (default: this host's CPU flags) and ``time_matmul(dtype) -> seconds`` (default:
    a [num_tokens, hidden] x [hidden, intermediate] product timed here) are for tests."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        if stored in _SIXTEEN_BIT:
            return DtypeChoice(stored, "the checkpoint's, on a GPU")
        return DtypeChoice("bfloat16", f"a {stored} checkpoint, run in bf16 on a GPU")
    if stored not in _SIXTEEN_BIT:
        return DtypeChoice("float32", f"the checkpoint's is {stored}")
    flags = cpu_flags() if flags is None else flags
    native = [flag for flag in NATIVE_BF16_FLAGS if flag in flags]
    if not native:
        return DtypeChoice("float32", "this CPU has no native bf16 (no AVX512_BF16 or AMX)")
    timer = time_matmul or (lambda dtype: _time_matmul(dtype, hidden_size, intermediate_size,
                                                       num_tokens))  # fmt: skip
    bf16, fp32 = timer(torch.bfloat16), timer(torch.float32)
    if bf16 < fp32:
        return DtypeChoice(
            "bfloat16", f"native bf16 ({', '.join(native)}), {fp32 / bf16:.2f}x faster measured"
        )
    return DtypeChoice("float32", f"native bf16 ({', '.join(native)}) measured no faster")


def _time_matmul(dtype: torch.dtype, hidden: int, intermediate: int, num_tokens: int) -> float:
    """Median of 7 runs (after 2) of a decode-sized matrix product in ``dtype``."""
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(max(num_tokens, 1), hidden, generator=generator).to(dtype)
    right = torch.randn(hidden, intermediate, generator=generator).to(dtype)
    times = []
    for index in range(9):
        start = time.perf_counter()
        for _ in range(8):
            torch.matmul(left, right)
        if index >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
