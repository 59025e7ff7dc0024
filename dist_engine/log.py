"""Lockstep's log: the standard `logging` logger "lockstep", with the rank in every line.

Start-up decisions (backends, how the MoE rows travel, the KV pool, threads, pinning) and
failures go here; `print` is kept for output the user asked for (the CLI's results and
summary). Unless the application configured the "lockstep" logger itself, it writes to stderr
at INFO (`LOCKSTEP_LOG_LEVEL` changes the level; `LOCKSTEP_CONFIGURE_LOGGING=0` leaves the
logger alone, for applications that route it themselves).
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "lockstep"


class _RankAdapter(logging.LoggerAdapter):
    def process(self, msg: object, kwargs: dict) -> tuple[str, dict]:
        return f"[rank {self.extra['rank']}] {msg}", kwargs


def get_logger(rank: int | None = None) -> logging.Logger | logging.LoggerAdapter:
    """The "lockstep" logger; with `rank`, one that starts every message with it."""
    logger = logging.getLogger(LOGGER_NAME)
    _configure(logger)
    return logger if rank is None else _RankAdapter(logger, {"rank": rank})


def _configure(logger: logging.Logger) -> None:
    if logger.handlers or os.environ.get("LOCKSTEP_CONFIGURE_LOGGING", "1") == "0":
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s lockstep %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("LOCKSTEP_LOG_LEVEL", "INFO").upper())
    logger.propagate = False
