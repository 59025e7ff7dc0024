"""The CPU engine's malloc setting (dist_engine/engine/host_memory.py): freed tensors' memory is
reused without page faults, and the opt-out leaves glibc's behaviour (every large tensor
faulting its pages in again). Each case runs in a fresh interpreter: the setting is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dist_engine.engine import host_memory

_PROBE = """
import json, resource, torch
from dist_engine.engine.host_memory import retain_freed_memory
applied = retain_freed_memory()
torch.set_num_threads(1)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
pages = {}
for mib in (8, 64):
    n = mib << 18  # float32 entries
    for _ in range(16):  # let the heap settle
        x = torch.ones(n); y = torch.ones(n); del x, y
    before = faults()
    for _ in range(4):
        x = torch.ones(n); y = torch.ones(n); del x, y
    pages[mib] = (faults() - before) / (4 * 2 * mib * 256)
print(json.dumps({"applied": applied, "faults_per_page": pages}))
"""


def _probe(setting: str | None) -> dict:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    if setting is not None:
        env[host_memory.ENV] = setting
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_are_reused_without_page_faults():
    retained = _probe(None)
    assert retained["applied"] is True
    assert all(share < 0.05 for share in retained["faults_per_page"].values()), retained
    system = _probe("system")
    assert system["applied"] is False
    # glibc raises its own mmap threshold to the largest block freed, up to 32 MiB, so whether an
    # 8 MiB block faults again under the system setting depends on its heap's history; a 64 MiB
    # block is past that ceiling and is always a fresh mapping.
    assert system["faults_per_page"]["64"] > 0.9, system


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setenv(host_memory.ENV, "tcmalloc")
    with pytest.raises(ValueError, match="LOCKSTEP_HOST_ALLOCATOR must be 'retain' or 'system'"):
        host_memory.retain_freed_memory()
