"""Errors a DP group raises instead of hanging."""

from __future__ import annotations

from typing import Any


class LockstepError(RuntimeError):
    """The ranks of a group disagreed, or a peer failed: continuing would hang or corrupt."""


class SettingsMismatchError(LockstepError):
    """Ranks started with settings that must agree (intervals, block size, model, ...)."""


class GroupFailedError(LockstepError):
    """The DP group failed: a peer died or stopped answering (`failed_ranks`, possibly empty
    when no rank could be named). Raised by a rank's loop; `LLM.generate` raises it too, once
    every request has its terminal output, with those in `outputs` (input order)."""

    def __init__(
        self, message: str, failed_ranks: list[int], outputs: list[Any] | None = None
    ) -> None:
        super().__init__(message)
        self.failed_ranks = sorted(failed_ranks)
        self.outputs: list[Any] = outputs if outputs is not None else []

    @property
    def failed_rank(self) -> int | None:
        """The lowest failed rank, if any was named."""
        return self.failed_ranks[0] if self.failed_ranks else None
