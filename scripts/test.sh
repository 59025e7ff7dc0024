#!/usr/bin/env bash
# The project's test command: sets everything up from nothing, lints, runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q --timeout=300 "$@"
