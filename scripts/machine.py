"""The processor a benchmark ran on, as every script records it: `/proc/cpuinfo`'s model name and
the vector and matrix extensions the kernels choose by (AVX2 and FMA, AVX-512's subsets, AMX).

A figure from one machine is not a property of the code, so each benchmark's JSON carries
`processor()` and its printed table ends with `describe(processor())`. Scripts run as
`python scripts/NAME.py`, which puts this folder first on `sys.path`: `from machine import ...`.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def processor() -> dict[str, Any]:
    """{model, cores, avx2, fma, avx512: [...], amx: [...]} of this host."""
    model, flags = platform.processor() or "unknown", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                break  # the model name comes first; one core's flags stand for all
    except OSError:
        pass
    return {
        "model": model,
        "cores": os.cpu_count(),
        "avx2": "avx2" in flags,
        "fma": "fma" in flags,
        "avx512": sorted(f for f in flags if f.startswith("avx512")),
        "amx": sorted(f for f in flags if f.startswith("amx")),
    }


def describe(cpu: dict[str, Any]) -> str:
    """One line for a table's foot: 'MODEL, N cores; AVX2; AVX-512 f bw ...; AMX bf16 int8 tile'."""
    parts = [f"{cpu['model']}, {cpu['cores']} cores", "AVX2" if cpu["avx2"] else "no AVX2"]
    avx512 = [f.removeprefix("avx512").lstrip("_") for f in cpu["avx512"]]
    parts.append("AVX-512 " + " ".join(avx512) if avx512 else "no AVX-512")
    amx = [f.removeprefix("amx_") for f in cpu.get("amx", [])]
    parts.append("AMX " + " ".join(amx) if amx else "no AMX")
    return "; ".join(parts)
