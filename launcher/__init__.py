"""Starting and feeding Lockstep's DP ranks: Ray, torchrun, the offline LLM API and the CLI."""

from dist_engine.errors import LockstepError
from launcher.llm import LLM, Completion
from scheduler import SamplingParams

__all__ = ["LLM", "Completion", "LockstepError", "SamplingParams"]
