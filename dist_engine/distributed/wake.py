"""Waking a sleeping DP group: a monotonically increasing wake epoch.

Whoever hands a rank work (a request, an abort, a shutdown) first puts it in the rank's inbox,
then bumps the epoch. A rank reads the highest epoch it has bumped *before* draining its inbox
and carries it in the vote. The group sleeps only when no rank has work and no rank has seen an
epoch newer than the one the group last agreed on; it then waits for the next epoch to appear.

Why nothing is stranded: a request that missed its rank's drain was bumped after that drain,
hence after every vote the group already took, so its epoch is beyond the agreed one and the
key the group waits for exists (or is about to). A bump whose request was already served costs
at most one extra vote.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist


class StoreWake:
    """The epoch lives in the group's TCPStore, so every rank's sleep sees every rank's bump.

    Sleeping blocks on a client connection of its own: a TCPStore client serves one request at
    a time, so a bump from a submitting thread must not queue behind the sleeper's wait.
    """

    def __init__(
        self, store: dist.Store, namespace: str, connect: Callable[[], dist.Store]
    ) -> None:
        """``namespace`` must be the same on every rank and new for every engine the group
        starts: epochs count from 0 under it. ``connect`` opens another connection to the
        same store (and key namespace), for the sleeper."""
        self.store = store
        self._counter = f"{namespace}/wake_epoch"
        self._prefix = f"{namespace}/wake/"
        self._sleeper = connect()
        self._lock = threading.Lock()
        self._seen = 0
        self._deleted_upto = 0

    @property
    def seen_epoch(self) -> int:
        return self._seen

    def bump(self) -> int:
        epoch = self.store.add(self._counter, 1)
        self.store.set(self._key(epoch), b"1")
        with self._lock:
            self._seen = max(self._seen, epoch)
        return epoch

    def wait_beyond(self, epoch: int, timeout_s: float) -> bool:
        """Block until an epoch after ``epoch`` exists; False on timeout."""
        try:
            self._sleeper.wait([self._key(epoch + 1)], timedelta(seconds=timeout_s))
        except dist.DistStoreError as error:
            if "timeout" in str(error).lower():
                return False
            raise
        return True

    def forget_through(self, epoch: int) -> None:
        """Delete the keys of epochs up to ``epoch``; nobody waits on them any more."""
        for old in range(self._deleted_upto + 1, epoch + 1):
            self.store.delete_key(self._key(old))
        self._deleted_upto = max(self._deleted_upto, epoch)

    def _key(self, epoch: int) -> str:
        return f"{self._prefix}{epoch}"


class LocalWake:
    """The same contract for a group of one: a condition variable instead of the store."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._seen = 0

    @property
    def seen_epoch(self) -> int:
        return self._seen

    def bump(self) -> int:
        with self._cond:
            self._seen += 1
            self._cond.notify_all()
            return self._seen

    def wait_beyond(self, epoch: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._seen > epoch, timeout_s)

    def forget_through(self, epoch: int) -> None:
        return None
