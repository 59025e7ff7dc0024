"""Starting and feeding Lockstep's DP ranks: Ray, torchrun, the offline LLM API and the CLI.

The names below are imported on first use, so `lockstep --help` (which imports this package)
does not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dist_engine.errors import LockstepError
    from launcher.llm import LLM, Completion
    from scheduler import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "Completion", "LockstepError", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "Completion"):
        from launcher import llm

        return getattr(llm, name)
    if name == "LockstepError":
        from dist_engine.errors import LockstepError

        return LockstepError
    if name in ("SamplingParams", "StructuredOutputsParams"):
        import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module 'launcher' has no attribute {name!r}")
