#!/usr/bin/env bash
# The main job, from nothing: creates .venv (pinned CPU torch), installs Lockstep, and runs the
# built-in job — the tiny Qwen3-MoE, DP=2 on a local Ray — printing results and throughput.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh ""
.venv/bin/lockstep run "$@"
