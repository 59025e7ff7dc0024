"""Per-request generation settings, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Seeds go to torch.Generator.manual_seed, which takes an unsigned 64-bit value; anything
# outside would raise inside a step, on the rank that serves the request.
MAX_SEED = 2**64 - 1
# Temperatures below this sample greedily: dividing logits by ~1e-38 overflows to inf and the
# softmax of infs is NaN (vLLM uses the same cut-off).
GREEDY_TEMPERATURE = 1e-5
# Token ids are int64 on every path (and a vocabulary is far smaller).
MAX_TOKEN_ID = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` (or below ``GREEDY_TEMPERATURE``) means greedy. ``top_k == 0`` and
    ``top_p == 1.0`` disable those filters. ``seed`` (0 to 2**64 - 1) makes sampling
    reproducible per request, whatever else shares its batch.

    Everything a tensor op could later reject is checked here, at the door: a request must never
    fail inside a step, where it would cost every other request of the group.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not 0 <= self.seed <= MAX_SEED
        ):
            raise ValueError(f"seed must be an int in [0, 2**64 - 1] or None, got {self.seed!r}")
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes)) or not hasattr(stop, "__iter__"):
            raise ValueError(f"stop_token_ids must be a collection of ints, got {stop!r}")
        stop = frozenset(stop)
        bad = [
            t
            for t in stop
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_TOKEN_ID
        ]
        if bad:
            raise ValueError(f"stop_token_ids must be ints >= 0, got {sorted(map(repr, bad))}")
        object.__setattr__(self, "stop_token_ids", stop)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _is_real(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )
