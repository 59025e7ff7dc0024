#!/usr/bin/env bash
# The project's test command: sets everything up from nothing, lints, runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The native kernels are built once per machine (1-2 minutes on 2 cores): build them here, as
# set-up, so that the suite's time is the tests' own. Without a compiler this builds nothing
# and the engine falls back to PyTorch's paths, as it would at run time.
.venv/bin/python -c "from dist_engine.kernels.compute import prepare
from dist_engine.distributed.shm_exchange import transport_library
prepare(); transport_library()"
.venv/bin/python -m pytest -q --timeout=300 "$@"
