"""The typed messages of an engine's inbox: what other threads may ask of the step loop.

Callers on any thread post them (`DPEngine.submit`, `abort`, `set_schedulable`, `shutdown`);
the loop takes them in at the start of a step. Anything else is refused when posted.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler import Sequence


@dataclass(frozen=True, slots=True)
class AddRequest:
    seq: Sequence
    stream: bool  # report new tokens as they come, not only the terminal result
    seed: int | None = None  # fixed by the caller for a request whose params give none


@dataclass(frozen=True, slots=True)
class SetSchedulable:
    request_id: str
    schedulable: bool


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str
    reason: str | None  # None: aborted by the caller; else failed with this reason


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Ask the group to stop; every rank leaves its loop at the same step."""


@dataclass(frozen=True, slots=True)
class Regroup:
    """Ask the group to leave its process groups at the same step, keeping every request and
    its KV, and wait to be taken into a re-formed one (a planned re-form)."""


InboxMessage = AddRequest | SetSchedulable | AbortRequest | Shutdown | Regroup
INBOX_MESSAGES = (AddRequest, SetSchedulable, AbortRequest, Shutdown, Regroup)
