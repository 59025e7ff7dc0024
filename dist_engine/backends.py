"""Which implementation runs each kind of op: config keys, resolved once at start-up.

    attention_backend: auto | native | torch                paged attention, rotary + KV write
    expert_backend:    auto | native | torch | grouped_mm   the expert side of an MoE layer
    norm_backend:      auto | native | torch                RMSNorm
    linear_backend:    auto | torch | onednn | onednn_t | onednn_packed
                                                            the dense linears and the LM head
    sampler_backend:   auto | native | torch                the draw of unfiltered random rows

`torch` is PyTorch's own ops: every device and dtype, and the reference the others are tested
against. `native` is Lockstep's compiled CPU kernels (kernels/compute.py), which apply to
float32 on the CPU (decode attention to every float dtype, the experts and norm to bfloat16);
elsewhere a `native` layer falls back to `torch` call by call. `grouped_mm` runs the experts
as one `torch.nn.functional.grouped_mm` per projection (float32 and half types, CPU and GPU).
`onednn` runs the dense linears through oneDNN's matmul instead of the BLAS behind `F.linear`
(float32 and bfloat16 on the CPU; layers/linear.py); `onednn_t` does too, over weights stored
transposed ([in, out]), which oneDNN streams faster on some processors. The layout is one per
model: where either regime takes `onednn_t`, every `Linear` keeps that layout, and the other
regime's implementation reads it (both read either layout). `onednn_packed` (bfloat16, where
oneDNN runs it) keeps a second copy of each dense weight in oneDNN's blocked layout, made once
after loading, so its bf16 GEMMs (AMX tiles, AVX-512 BF16) stop re-laying the weight out at
every call: on an AMX host 0.53-0.71x the time of a decode-sized bf16 linear; the copy doubles
the dense weights' memory (not the experts').

`native` for the sampler draws the rows that sample without top_k, top_p or min_p (vLLM's
default sampling) by one compiled pass per row, where PyTorch's path runs a softmax, a
threshold and block sums as passes over the whole [rows, vocab] (engine/sampler.py); other rows,
and logits not on the CPU, take PyTorch's path call by call.

`auto` measures: each rank times the implementations that can serve its model, on its real
shapes at its steps' sizes, and takes the fastest per regime (dist_engine/autotune.py; cached
per host). Without those shapes (a model built outside an engine), on a GPU, or with
`LOCKSTEP_AUTOTUNE=0` in the environment (short jobs, tests), `auto` is a rule: `native` where
it applies and built, else `grouped_mm` for the experts on a GPU, else `torch` (the linears:
always `torch` — oneDNN is faster on some processors only, so it is never assumed).

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
from typing import TYPE_CHECKING

import torch

from dist_engine.attention import (
    AttentionBackend,
    MLABackend,
    PerRegime,
    attention_backend,
    has_backend,
)
from dist_engine.engine.config import BACKEND_CHOICES
from dist_engine.layers.linear import LinearKernel, onednn_serves, packing_serves
from dist_engine.layers.moe import expert_impl
from dist_engine.layers.norm import NormKernel
from dist_engine.log import get_logger
from moe import DispatchMode, ExpertImpl

if TYPE_CHECKING:
    from dist_engine.autotune import TuneShapes

BACKEND_KEYS = tuple(BACKEND_CHOICES)
_OPS = {
    "attention_backend": "attention",
    "expert_backend": "experts",
    "norm_backend": "norm",
    "linear_backend": "linear",
    "sampler_backend": "sampler",
}
# the linear_backend implementations
LINEAR_NAMES = ("torch", "onednn", "onednn_t", "onednn_packed")
_REGIMES = ("decode", "prefill")
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
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
    linear: RegimeChoice = RegimeChoice("torch", "torch")
    sampler: RegimeChoice = RegimeChoice("torch", "torch")
    attention_kind: str = "gqa"  # the model's attention (gqa | mla): whose backends these are

    @classmethod
    def all(cls, name: str, attention_kind: str = "gqa") -> Backends:
        """The same implementation everywhere (tests and references); the linears run `name`
        where it is one of theirs, else `torch`."""
        choice = RegimeChoice(name, name)
        linear = choice if name in LINEAR_NAMES else RegimeChoice("torch", "torch")
        sampler = choice if name == "native" else RegimeChoice("torch", "torch")
        return cls(choice, choice, choice, linear, sampler).for_attention_kind(attention_kind)

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
        return (
            f"attention {self.attention}; experts {self.experts}; norm {self.norm}; "
            f"linear {self.linear}; sampler {self.sampler}"
        )


@dataclass(frozen=True)
class LayerOps:
    """The implementations the layers call, built once from a `Backends`."""

    attention: AttentionBackend | MLABackend  # as the model's attention kind needs
    experts: dict[DispatchMode, ExpertImpl | None]  # None: PyTorch's path
    norm: NormKernel | None  # None: PyTorch's F.rms_norm
    linear: LinearKernel | None = None  # None: PyTorch's F.linear

    @classmethod
    def build(cls, backends: Backends, max_decode_tokens: int) -> LayerOps:
        """`max_decode_tokens`: the most tokens a decode step holds (max_num_seqs): the norm,
        which has no step kind to look at, tells decode steps from prefill steps by size."""
        from dist_engine.kernels import compute

        attention, kind = backends.attention, backends.attention_kind
        decode = attention_backend(attention.decode, kind)
        prefill = decode if attention.prefill == attention.decode else None
        prefill = prefill or attention_backend(attention.prefill, kind)
        experts = {
            DispatchMode.LOW_LATENCY: backends.experts.decode,
            DispatchMode.NORMAL: backends.experts.prefill,
        }
        impls = {mode: expert_impl(name) for mode, name in experts.items()}
        norm = None
        if "native" in (backends.norm.decode, backends.norm.prefill):
            kernel = compute.rms_norm()
            if backends.norm.decode == backends.norm.prefill:
                norm = NormKernel(kernel)
            elif backends.norm.decode == "native":
                norm = NormKernel(kernel, max_tokens=max_decode_tokens)
            else:
                norm = NormKernel(kernel, min_tokens=max_decode_tokens + 1)
        linear = None
        regimes = (backends.linear.decode, backends.linear.prefill)
        if regimes != ("torch", "torch"):  # oneDNN serves the regimes that took it, by rows
            linear = LinearKernel(*regimes, max_decode_tokens=max_decode_tokens)
        if decode is not prefill:
            assert isinstance(decode, AttentionBackend) and isinstance(prefill, AttentionBackend)
            decode = PerRegime(decode, prefill)
        return cls(decode, impls, norm, linear)


def may_use_native(settings: dict[str, str]) -> bool:
    """Whether any backend setting could pick the native kernels (so they are worth building
    before a rank pins itself or joins a collective)."""
    keys = (key for key in BACKEND_KEYS if key != "linear_backend")  # no native linears
    return any(settings.get(key, "auto") != "torch" for key in keys)


def native_applies(
    key: str, regime: str, dtype: torch.dtype, device: torch.device | str | None
) -> bool:
    """Whether the compiled CPU kernels serve `key`'s ops in `regime` (decode | prefill) for
    this model: on the CPU, float32 (decode attention: any float dtype; prefill attention, the
    experts and the norm: bfloat16 too)."""
    on_cpu = device is None or torch.device(device).type == "cpu"
    if key == "sampler_backend":  # the sampler draws from float32 logits whatever the model's
        return on_cpu
    every_dtype = key == "attention_backend" and regime == "decode"
    bf16_too = key in ("attention_backend", "expert_backend", "norm_backend") and (
        dtype == torch.bfloat16
    )
    return on_cpu and (dtype == torch.float32 or every_dtype or bf16_too)


def autotune_enabled() -> bool:
    """`auto` backends are timed at start-up unless LOCKSTEP_AUTOTUNE is 0/false/off."""
    return os.environ.get("LOCKSTEP_AUTOTUNE", "1").strip().lower() not in ("0", "false", "off")


def candidates(
    key: str,
    regime: str,
    dtype: torch.dtype,
    device: torch.device | str | None,
    attention_kind: str = "gqa",
) -> list[str]:
    """The implementations that can serve `key`'s ops in `regime` for this model."""
    from dist_engine.kernels import compute

    names = ["torch"]
    if key == "linear_backend":
        on_cpu = device is None or torch.device(device).type == "cpu"
        if on_cpu and onednn_serves(dtype):
            names += ["onednn", "onednn_t"]
        if on_cpu and packing_serves(dtype):
            names.append("onednn_packed")
        return names
    if key == "attention_backend" and not has_backend(attention_kind, "native"):
        return names
    if native_applies(key, regime, dtype, device) and compute.prepare():
        names.insert(0, "native")
    if key == "expert_backend" and dtype in GROUPED_MM_DTYPES:
        names.append("grouped_mm")
    return names


def resolve_backends(
    settings: dict[str, str],
    dtype: torch.dtype,
    device: torch.device | str | None,
    rank: int | None = None,
    shapes: TuneShapes | None = None,
    attention_kind: str = "gqa",
) -> Backends:
    """`settings`: each of BACKEND_KEYS → one of its BACKEND_CHOICES, for a model whose
    attention is `attention_kind` (gqa | mla). `shapes`: the model's and the steps' sizes, for
    `auto` to time the candidates on (None: `auto` is a rule). Raises ValueError naming the key
    when an implementation is asked for where it cannot run; an attention kind without native
    kernels runs `torch` and the result says so."""
    log = get_logger(rank)
    for switch, keys in _RETIRED_SWITCHES.items():
        if switch in os.environ:
            log.warning("%s is no longer read; set %s (auto | native | torch)", switch, keys)
    on_cpu = device is None or torch.device(device).type == "cpu"
    kind = shapes.attention_kind if shapes is not None else attention_kind
    chosen: dict[str, dict[str, str]] = {}
    to_time: dict[str, dict[str, list[str]]] = {}
    for key in BACKEND_KEYS:
        value = settings.get(key, "auto")
        if value not in BACKEND_CHOICES[key]:
            raise ValueError(f"{key} must be one of {list(BACKEND_CHOICES[key])}, got {value!r}")
        if key == "attention_backend" and not has_backend(kind, "native"):
            note = f"no native {kind} kernels" if value != "torch" else ""
            chosen[key] = {"decode": "torch", "prefill": "torch", "note": note}
            continue
        # The sampler has one choice for both regimes (timed on decode-sized rows, which a
        # prefill step's sample never exceeds), so a request is drawn the same way in every
        # kind of step, a resumed one too.
        regimes = ("decode",) if key == "sampler_backend" else _REGIMES
        per_regime = {regime: candidates(key, regime, dtype, device, kind) for regime in regimes}
        if value not in ("auto", "torch") and not any(value in c for c in per_regime.values()):
            raise ValueError(
                f"{key} is {value!r}, which cannot run this model ({dtype} on "
                f"{device or 'cpu'}; the native kernels serve float32 on the CPU (the experts "
                f"and norm bfloat16 too) and need a C++ compiler, grouped_mm float32 and half "
                f"types, onednn and onednn_t float32 on the CPU, bfloat16 too where the "
                f"processor has AVX-512, onednn_packed bfloat16 there); use auto or torch"
            )
        chosen[key] = {}
        for regime, names in per_regime.items():
            if value != "auto":  # where the named one cannot serve a regime, PyTorch's does
                chosen[key][regime] = value if value in names else "torch"
            elif shapes is not None and on_cpu and len(names) > 1 and autotune_enabled():
                to_time.setdefault(_OPS[key], {})[regime] = names
            else:  # the rule: the native kernels on a CPU, the grouped GEMM on a GPU
                preferred = "native" if on_cpu else "grouped_mm"
                chosen[key][regime] = preferred if preferred in names else "torch"
    if to_time:
        from dist_engine.autotune import tune

        timed = tune(shapes, to_time, lambda message: log.info("%s", message))
        for key, op in _OPS.items():
            for regime, choice in timed.get(op, {}).items():
                chosen[key][regime] = choice
    chosen["sampler_backend"]["prefill"] = chosen["sampler_backend"]["decode"]
    backends = Backends(
        *(
            RegimeChoice(chosen[key]["decode"], chosen[key]["prefill"], chosen[key].get("note", ""))
            for key in BACKEND_KEYS
        ),
        attention_kind=kind,
    )
    log.info("backends: %s", backends.describe())
    return backends
