"""Shared by every test area (scheduler/, moe/, models/, engine/, launcher/): the helpers'
place on sys.path, the native build done once up front, and the one tiny model."""

import os
import sys
from pathlib import Path

import pytest

# `auto` backends follow the rule (native where it applies) instead of timing the candidates
# at every engine start with a new shape: results are the same either way (the parity tests
# run every backend), and the timing is tested on its own (tests/engine/test_autotune.py).
# Inherited by every process the tests start (ranks, Ray actors, torchrun, the CLI).
os.environ["LOCKSTEP_AUTOTUNE"] = "0"

# Test helpers live beside the tests; the packages themselves are installed (pip install -e).
sys.path.insert(0, str(Path(__file__).parent))


def pytest_sessionstart(session) -> None:
    """Build the CPU kernels and the shared-memory library once, up front (tens of seconds on
    a fresh machine), so no test pays for it inside its own timeout; spawned ranks then load
    the cached build."""
    from dist_engine.distributed.shm_exchange import transport_library
    from dist_engine.kernels import compute

    compute.prepare()
    transport_library()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen3-MoE (model_fixtures.TINY_SIZES, 2 layers) every test that needs "a
    model" shares; tests of a particular architecture or size write their own."""
    from model_fixtures import TINY_SIZES

    from dist_engine.models.make_model import make_tiny_checkpoint

    out = tmp_path_factory.mktemp("tiny-qwen3-moe")
    return str(make_tiny_checkpoint("qwen3_moe", out, seed=5, num_layers=2, **TINY_SIZES))
