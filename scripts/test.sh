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
if [ "$#" -gt 0 ]; then  # a selection of tests: run it as given
  exec .venv/bin/python -m pytest -q --timeout=300 "$@"
fi
# Two phases. The tests that start no process and assert no latency are single-threaded Python
# and torch work for the most part: xdist workers (`-n auto`, one per core), one torch thread
# each, keep every core busy. Then the tests that start processes (rank groups, Ray, torchrun,
# the CLI; they size their own threads) or assert a latency bound (marked `timing`) run one at
# a time, with the machine to themselves: run beside the first phase they took longer than the
# two phases one after the other. Both phases run whatever the first gives; the script fails
# if either did.
status=0
OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q --timeout=300 -n auto \
  -m "not multirank and not timing" || status=$?
.venv/bin/python -m pytest -q --timeout=300 -m "multirank or timing" || status=$?
exit "$status"
