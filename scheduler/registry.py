"""The one registry idiom: a name chosen in the settings -> the thing it names.

Model architectures, attention backends, step policies and routing policies are each a
`Registry`. An entry is the thing itself, or `Lazy("module:attribute")` for one whose module
should load only when it is chosen (an architecture a process does not serve never imports).
Looking up an unknown name is a ValueError ("unsupported ...") that names the setting, the
value and every name it could have been. It lives in `scheduler/`, the bottom of the import
order, so that every package may use it; it imports nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Lazy:
    """An entry imported on first use: ``"package.module:attribute"``."""

    target: str

    def load(self) -> object:
        module, _, attribute = self.target.partition(":")
        return getattr(importlib.import_module(module), attribute)


class Registry(Generic[T]):
    def __init__(self, setting: str, entries: Mapping[str, T | Lazy]) -> None:
        """``setting``: how users name the choice (``model_type``, ``sync_policy``, ...)."""
        self.setting = setting
        self._entries: dict[str, T | Lazy] = dict(entries)

    def get(self, name: object) -> T:
        """The entry called ``name``; ValueError naming the known ones if there is none."""
        if not isinstance(name, str) or name not in self._entries:
            raise ValueError(
                f"unsupported {self.setting} {name!r}; supported: {list(self._entries)}"
            )
        entry = self._entries[name]
        if isinstance(entry, Lazy):
            entry = self._entries[name] = entry.load()  # type: ignore[assignment]
        return entry  # type: ignore[return-value]

    def check(self, key: str, name: object) -> None:
        """Refuse a setting ``key`` whose value is not one of the names (config checks)."""
        if not isinstance(name, str) or name not in self._entries:
            raise ValueError(f"{key} must be one of {list(self._entries)}, got {name!r}")

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)
