#!/usr/bin/env bash
# Creates .venv (if missing) and installs the package with the given extras.
# torch is pinned on every pip line: 2.13.0 is the CPU wheel on the project's machines; an
# unpinned torch (or a newer range pulled in by another package) downloads a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1-test}"   # "" installs the package alone
TORCH_PIN="torch==2.13.0"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_PIN"
target="."
[ -n "$extras" ] && target=".[${extras}]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e "$target" "$TORCH_PIN"
