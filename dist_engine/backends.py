"""Which implementation runs each kind of op: config keys, resolved once at start-up.

    attention_backend: auto | native | torch     paged attention, rotary + KV write
    expert_backend:    auto | native | torch     the expert side of an MoE layer
    norm_backend:      auto | native | torch     RMSNorm

`torch` is PyTorch's own ops: every device and dtype, and the reference the others are tested
against. `native` is Lockstep's compiled CPU kernels (kernels/compute.py), which apply to
float32 on the CPU (decode attention to every float dtype); elsewhere a `native` layer falls
back to `torch` call by call. `auto` takes `native` where it applies and the kernels built,
`torch` otherwise.

Attention backends exist per attention kind (`attention.ATTENTION_BACKENDS`: GQA has both,
MLA only `torch`); for a kind without `native` the attention resolves to `torch` and the
resolution says why.

The choice is made per regime (decode steps and prefill steps), so a kernel that is faster
for a handful of rows and slower for thousands can serve only the regime where it wins;
`Backends.describe()` is what the run summary prints.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from dist_engine.attention import (
    AttentionBackend,
    MLABackend,
    PerRegime,
    attention_backend,
    has_backend,
)
from dist_engine.layers.norm import NormKernel
from dist_engine.log import get_logger
from moe import DispatchMode, ExpertImpl

BACKEND_CHOICES = ("auto", "native", "torch")
BACKEND_KEYS = ("attention_backend", "expert_backend", "norm_backend")
# Environment switches of earlier versions, no longer read: say so rather than ignore them.
_RETIRED_SWITCHES = {
    "LOCKSTEP_FUSED_ATTENTION": "attention_backend",
    "LOCKSTEP_FUSED_EXPERTS": "expert_backend",
    "LOCKSTEP_FUSED_NORM": "attention_backend and norm_backend",
}


@dataclass(frozen=True)
class RegimeChoice:
    """The implementation used for decode steps and for prefill steps."""

    decode: str
    prefill: str
    note: str = ""  # why the choice differs from the setting, when it does

    def __str__(self) -> str:
        text = self.decode
        if self.decode != self.prefill:
            text = f"decode {self.decode}, prefill {self.prefill}"
        return f"{text} ({self.note})" if self.note else text


@dataclass(frozen=True)
class Backends:
    attention: RegimeChoice
    experts: RegimeChoice
    norm: RegimeChoice
    attention_kind: str = "gqa"  # the model's attention (gqa | mla): whose backends these are

    @classmethod
    def all(cls, name: str, attention_kind: str = "gqa") -> Backends:
        """The same implementation everywhere (tests and references)."""
        choice = RegimeChoice(name, name)
        return cls(choice, choice, choice).for_attention_kind(attention_kind)

    def for_attention_kind(self, kind: str) -> Backends:
        """These backends for a model whose attention is `kind`: a regime set to a backend
        the kind does not have runs `torch`, and says so."""
        names = (self.attention.decode, self.attention.prefill)
        missing = sorted({name for name in names if not has_backend(kind, name)})
        if not missing:
            return dataclasses.replace(self, attention_kind=kind)
        resolved = [name if has_backend(kind, name) else "torch" for name in names]
        note = f"no {' or '.join(missing)} {kind} kernels"
        attention = RegimeChoice(*resolved, note=note)
        return dataclasses.replace(self, attention=attention, attention_kind=kind)

    def describe(self) -> str:
        return f"attention {self.attention}; experts {self.experts}; norm {self.norm}"


@dataclass(frozen=True)
class LayerOps:
    """The implementations the layers call, built once from a `Backends`."""

    attention: AttentionBackend | MLABackend  # as the model's attention kind needs
    experts: dict[DispatchMode, ExpertImpl | None]  # None: PyTorch's path
    norm: NormKernel | None  # None: PyTorch's F.rms_norm

    @classmethod
    def build(cls, backends: Backends, max_decode_tokens: int) -> LayerOps:
        """`max_decode_tokens`: the most tokens a decode step holds (max_num_seqs): the norm,
        which has no step kind to look at, tells decode steps from prefill steps by size."""
        from dist_engine.kernels import compute
        from dist_engine.layers.moe import NativeExperts

        attention, kind = backends.attention, backends.attention_kind
        decode = attention_backend(attention.decode, kind)
        prefill = decode if attention.prefill == attention.decode else None
        prefill = prefill or attention_backend(attention.prefill, kind)
        experts = {
            DispatchMode.LOW_LATENCY: backends.experts.decode,
            DispatchMode.NORMAL: backends.experts.prefill,
        }
        impls: dict[DispatchMode, ExpertImpl | None] = {
            mode: NativeExperts(compute.routed_swiglu()) if name == "native" else None
            for mode, name in experts.items()
        }
        norm = None
        if "native" in (backends.norm.decode, backends.norm.prefill):
            kernel = compute.rms_norm()
            if backends.norm.decode == backends.norm.prefill:
                norm = NormKernel(kernel)
            elif backends.norm.decode == "native":
                norm = NormKernel(kernel, max_tokens=max_decode_tokens)
            else:
                norm = NormKernel(kernel, min_tokens=max_decode_tokens + 1)
        if decode is not prefill:
            assert isinstance(decode, AttentionBackend) and isinstance(prefill, AttentionBackend)
            decode = PerRegime(decode, prefill)
        return cls(decode, impls, norm)


def may_use_native(settings: dict[str, str]) -> bool:
    """Whether any backend setting could pick the native kernels (so they are worth building
    before a rank pins itself or joins a collective)."""
    return any(settings.get(key, "auto") != "torch" for key in BACKEND_KEYS)


def native_applies(
    key: str, regime: str, dtype: torch.dtype, device: torch.device | str | None
) -> bool:
    """Whether the compiled CPU kernels serve `key`'s ops in `regime` (decode | prefill) for
    this model: on the CPU, float32 (decode attention: any float dtype)."""
    on_cpu = device is None or torch.device(device).type == "cpu"
    every_dtype = key == "attention_backend" and regime == "decode"
    return on_cpu and (dtype == torch.float32 or every_dtype)


def resolve_backends(
    settings: dict[str, str],
    dtype: torch.dtype,
    device: torch.device | str | None,
    rank: int | None = None,
    attention_kind: str = "gqa",
) -> Backends:
    """`settings`: each of BACKEND_KEYS → one of BACKEND_CHOICES, for a model whose attention
    is `attention_kind` (gqa | mla). Raises ValueError naming the key when `native` is asked
    for where it cannot run; an attention kind without native kernels runs `torch` and the
    result says so."""
    from dist_engine.kernels import compute

    log = get_logger(rank)
    for switch, keys in _RETIRED_SWITCHES.items():
        if switch in os.environ:
            log.warning("%s is no longer read; set %s (auto | native | torch)", switch, keys)
    chosen: dict[str, RegimeChoice] = {}
    for key in BACKEND_KEYS:
        value = settings.get(key, "auto")
        if value not in BACKEND_CHOICES:
            raise ValueError(f"{key} must be one of {list(BACKEND_CHOICES)}, got {value!r}")
        if key == "attention_backend" and not has_backend(attention_kind, "native"):
            chosen[key] = RegimeChoice("torch", "torch")
            if value != "torch":
                chosen[key] = RegimeChoice("torch", "torch", f"no native {attention_kind} kernels")
            continue
        names = []
        for regime in ("decode", "prefill"):
            applies = native_applies(key, regime, dtype, device)
            built = applies and compute.prepare()
            if value == "native" and not any(
                native_applies(key, r, dtype, device) for r in ("decode", "prefill")
            ):
                raise ValueError(
                    f"{key} is 'native', but the native kernels serve float32 on the CPU and "
                    f"this model is {dtype} on {device or 'cpu'}; use auto or torch"
                )
            if value == "native" and applies and not built:
                raise ValueError(
                    f"{key} is 'native', but the CPU kernels did not build (see the warning "
                    f"above); use auto or torch"
                )
            # `native` where a kernel does not apply runs PyTorch's ops: say so.
            names.append("native" if value != "torch" and built else "torch")
        chosen[key] = RegimeChoice(*names)
    backends = Backends(
        chosen["attention_backend"],
        chosen["expert_backend"],
        chosen["norm_backend"],
        attention_kind,
    )
    log.info("backends: %s", backends.describe())
    return backends
