"""Errors a DP group raises instead of hanging."""

from __future__ import annotations


class LockstepError(RuntimeError):
    """The ranks of a group disagreed, or a peer failed: continuing would hang or corrupt."""


class SettingsMismatchError(LockstepError):
    """Ranks started with settings that must agree (intervals, block size, model, ...)."""


class RankFailureError(LockstepError):
    """A collective failed because a peer died or stopped answering."""

    def __init__(self, message: str, failed_ranks: list[int]) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks
