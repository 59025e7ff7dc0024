"""Default sampling from the model's `generation_config.json`, the way vLLM's
`--generation-config` takes it.

    generation_config: auto     # the model directory's generation_config.json (the default)
    generation_config: vllm     # no model defaults: temperature 1.0, top_p 1.0, top_k off
    generation_config: DIR      # DIR/generation_config.json instead of the model's

The defaults apply only where a request sets nothing: `LLM.generate(prompts)` with no sampling
params, and a `lockstep run` prompt line or a server request without `temperature`, `top_p` or
`top_k` (each field falls back on its own). `SamplingParams()` itself stays greedy: code that
builds its params keeps exactly what it asked for. The file's `eos_token_id` (an id or a list)
becomes stop ids of every request, defaulted or given, unless it sets `ignore_eos`
(`with_eos_ids`; the front ends add the tokenizer's eos_token too); as in vLLM it is read
under `vllm` too, which ignores only the sampling values. Chat models list their end-of-turn
token there, which config.json (the engine's own EOS ids) often lacks.

Only the keys vLLM reads that Lockstep's sampler implements are taken: `temperature`, `top_p`,
`top_k`. `max_new_tokens`, `repetition_penalty` and `min_p` are not (`describe()`, which the
front ends log at start-up, names them); `do_sample` is ignored, as vLLM ignores it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler import SamplingParams

FILE_NAME = "generation_config.json"
# vLLM's defaults where the file says nothing (its SamplingParams: temperature 1.0, no filters).
VLLM_TEMPERATURE = 1.0
VLLM_TOP_P = 1.0
VLLM_TOP_K = 0  # off (vLLM spells it -1 or 0)
_NOT_TAKEN = ("max_new_tokens", "repetition_penalty", "min_p")


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request that sets no sampling gets."""

    temperature: float = VLLM_TEMPERATURE
    top_p: float = VLLM_TOP_P
    top_k: int = VLLM_TOP_K
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    source: str | None = None  # the generation_config.json the values came from, if any
    taken: tuple[str, ...] = ()  # the sampling keys the file set
    not_applied: tuple[str, ...] = ()  # keys vLLM would take that Lockstep has no setting for

    def describe(self) -> str:
        """One line for the log: where the defaults come from, and what they are."""
        values = f"temperature {self.temperature}, top_p {self.top_p}, top_k {self.top_k}"
        origin = (
            f"{self.source} (--generation-config vllm turns it off)"
            if self.taken
            else "vLLM's defaults"
        )
        text = f"default sampling, {origin}: {values}; EOS stop ids {sorted(self.eos_token_ids)}"
        if self.not_applied:
            text += f"; not applied (no such setting): {list(self.not_applied)}"
        return text

    def sampling_params(self, max_tokens: int = 16, **given: Any) -> SamplingParams:
        """`SamplingParams` with ``given`` settings, the defaults for temperature, top_p and
        top_k that ``given`` leaves out (or sets to None), and the EOS ids as stop ids unless
        ``given`` asks for ``ignore_eos``. ValueError names a bad given value."""
        values = {k: v for k, v in given.items() if v is not None}
        values.setdefault("temperature", self.temperature)
        values.setdefault("top_p", self.top_p)
        values.setdefault("top_k", self.top_k)
        if not values.get("ignore_eos", False):
            extra = frozenset(values.get("stop_token_ids", ()))
            values["stop_token_ids"] = self.eos_token_ids | extra
        return SamplingParams(max_tokens=max_tokens, **values)


def with_eos_ids(params: SamplingParams, eos_token_ids: frozenset[int]) -> SamplingParams:
    """``params`` stopping also at ``eos_token_ids``, unless it sets ``ignore_eos``: vLLM adds
    its generation config's EOS ids to the stop ids of every request, given or defaulted."""
    if params.ignore_eos or eos_token_ids <= params.stop_token_ids:
        return params
    return dataclasses.replace(params, stop_token_ids=params.stop_token_ids | eos_token_ids)


def load_generation_defaults(setting: str, model_dir: str | Path) -> GenerationDefaults:
    """The defaults ``generation_config`` (``auto``, ``vllm`` or a directory) gives for the
    model in ``model_dir``. Raises ValueError naming the setting for a directory without the
    file, and naming the file for a value the sampler cannot take."""
    if setting in ("auto", "vllm"):
        path = Path(model_dir) / FILE_NAME
        if not path.is_file():
            return GenerationDefaults()
    else:
        path = Path(setting) / FILE_NAME
        if not path.is_file():
            raise ValueError(
                f"generation_config {setting!r}: no {FILE_NAME} there; give 'auto' (the model's "
                f"own), 'vllm' (none) or a directory that holds one"
            )
    values = _read(path)
    eos = _token_ids(values.get("eos_token_id"), path)
    if setting == "vllm":
        return GenerationDefaults(eos_token_ids=eos, source=str(path))
    taken = {k: values[k] for k in ("temperature", "top_p", "top_k") if values.get(k) is not None}
    for key, value in taken.items():
        _check(path, key, value)
    if taken.get("top_k") == -1:
        taken["top_k"] = VLLM_TOP_K  # -1 is off, as 0 is
    return GenerationDefaults(
        eos_token_ids=eos,
        source=str(path),
        taken=tuple(taken),
        not_applied=tuple(k for k in _NOT_TAKEN if values.get(k) is not None),
        **taken,
    )


def _read(path: Path) -> dict[str, Any]:
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not readable JSON: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(values).__name__}")
    return values


def _check(path: Path, key: str, value: Any) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key == "top_k":
        if not isinstance(value, int) or isinstance(value, bool) or value < -1:
            raise ValueError(f"{path}: top_k must be an int >= 0 (or -1: off), got {value!r}")
    elif key == "top_p":
        if not number or not 0 < value <= 1:
            raise ValueError(f"{path}: top_p must be a number in (0, 1], got {value!r}")
    elif not number or not math.isfinite(value) or value < 0:
        raise ValueError(f"{path}: temperature must be a finite number >= 0, got {value!r}")


def _token_ids(value: Any, path: Path) -> frozenset[int]:
    if value is None:
        return frozenset()
    ids = [value] if not isinstance(value, list) else value
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(
            f"{path}: eos_token_id must be a token id or a list of them, got {value!r}"
        )
    return frozenset(ids)
