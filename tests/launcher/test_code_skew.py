"""A rank on other Lockstep code than its front end is refused before it loads anything.

The front end (a driver process importing this checkout) starts a DP=1 group on an embedded
Ray whose workers import a copy of the packages with one line added: as a node left on
another version would. Without the check the group started, and every request failed on
the rank with an error about a missing attribute (met when a driver and its workers came
from two checkouts)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from dist_engine.engine.config import CODE_PACKAGES, code_digest, code_identity, code_root

pytestmark = pytest.mark.multirank

DRIVER = """
import sys
sys.path.insert(0, sys.argv[1])  # this checkout, ahead of the copy on PYTHONPATH
from dist_engine.errors import LockstepError
from launcher import LLM
try:
    LLM(model=sys.argv[2], dp_size=1, launcher="ray", dtype="float64", max_model_len=64,
        num_blocks=32, block_size=4)
except LockstepError as error:
    print("REFUSED", error)
    sys.exit(0)
print("STARTED")
sys.exit(1)
"""


def test_ranks_on_other_code_are_refused_naming_where_they_import_it(model_dir, tmp_path):
    checkout = code_root("launcher").parent
    copy = tmp_path / "other"
    for package in CODE_PACKAGES:
        shutil.copytree(
            code_root(package), copy / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    with open(copy / "scheduler" / "sampling_params.py", "a") as source:
        source.write("# one more line: another version\n")
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(copy)  # the embedded Ray's workers import the copy
    done = subprocess.run(
        [sys.executable, str(tmp_path / "driver.py"), str(checkout), str(model_dir)],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    message = done.stdout
    assert message.startswith("REFUSED ranks run other Lockstep code than this front end")
    assert f"({code_identity()} from {checkout} on" in message
    assert "DP rank 0 runs " in message and f"from {copy} on" in message
    assert "Install the same version" in message


def test_a_wheel_of_this_checkout_has_its_code_identity(tmp_path):
    """Nodes that installed the project's wheel and a front end on its checkout agree: the
    wheel carries every file the hash reads (kernel sources included)."""
    checkout = code_root("launcher").parent
    source = tmp_path / "source"
    for package in CODE_PACKAGES:
        shutil.copytree(
            code_root(package), source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(checkout / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path / "wheel")],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("lockstep-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "installed")
    installed = {package: tmp_path / "installed" / package for package in CODE_PACKAGES}
    assert code_digest(installed) == code_identity()
