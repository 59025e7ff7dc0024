import sys
from pathlib import Path

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
