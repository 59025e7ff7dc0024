"""Linear layers with Hugging Face's parameter names, and the oneDNN path for them.

Parameters are created empty (no initialisation work) because the checkpoint loader overwrites
every one of them; the loader checks that none is left unfilled.

`torch.nn.functional.linear` on a CPU runs float32 through the BLAS torch was built with
(MKL in the project's wheel). oneDNN, which the same wheel carries, has GEMMs of its own
generated for the processor at hand; on some hosts they are several times faster for float32
(MKL takes a generic path on processors it does not recognise as Intel's). Which one serves is
`linear_backend` (dist_engine/backends.py), measured per host, never assumed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN_DTYPES = (torch.float32, torch.bfloat16)  # what oneDNN's linear can take, on some CPUs


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def onednn_available() -> bool:
    """Whether this torch carries oneDNN (mkldnn) with its linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def onednn_serves(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear runs ``dtype`` on this processor: tried once on a small input.
    Its bfloat16 GEMMs need AVX-512 (or AMX); on an AVX2-only host it has no primitive for
    them and raises ("could not create a primitive descriptor")."""
    if dtype not in ONEDNN_DTYPES or not onednn_available():
        return False
    x = torch.ones(2, 16, dtype=dtype)
    try:
        y = onednn_linear(x, torch.ones(8, 16, dtype=dtype))
    except RuntimeError:
        return False
    return bool(torch.equal(y, torch.full((2, 8), 16.0, dtype=dtype)))


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through oneDNN's matmul (PyTorch's own `mkldnn` op, the one
    Inductor's CPU fusions call), on CPU tensors of one dtype in ONEDNN_DTYPES. `weight` may
    be a transposed view: oneDNN reads either layout."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def packing_serves(dtype: torch.dtype) -> bool:
    """Whether oneDNN can keep a ``dtype`` weight packed (`pack_weight`) on this processor.
    bfloat16 only: packing is what lets oneDNN skip re-laying a weight out for its bf16
    GEMMs (AMX tiles, AVX-512 BF16) at every call; float32 gained nothing where measured."""
    if dtype != torch.bfloat16 or not onednn_serves(dtype):
        return False
    weight = torch.ones(8, 16, dtype=dtype)
    try:
        y = torch.ops.mkldnn._linear_pointwise(
            torch.ones(2, 16, dtype=dtype), pack_weight(weight), None, "none", [], ""
        )
    except RuntimeError:
        return False
    return bool(torch.equal(y, torch.full((2, 8), 16.0, dtype=dtype)))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] laid out once in oneDNN's own blocked format for its matmul (an
    opaque mkldnn tensor: PyTorch's `_reorder_linear_weight`, as Inductor's CPU freezing
    does). The plain weight stays the layer's parameter; the packed one is a copy."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


@dataclass(frozen=True)
class LinearKernel:
    """Which implementation runs a linear, per regime, told apart by rows: steps of at most
    `max_decode_tokens` rows are decode-sized and run `decode`, larger ones `prefill`
    (`linear_backend`: torch | onednn | onednn_t | onednn_packed). Set on every `Linear` and
    the LM head (`MoECausalLM.use_linear_kernel`); anything but CPU tensors of a dtype oneDNN
    serves here runs `F.linear`."""

    decode: str = "torch"
    prefill: str = "torch"
    max_decode_tokens: int = 256

    @property
    def weights_in_out(self) -> bool:
        """Whether the model's linears keep their weights stored transposed, [in, out] (each
        still seen as [out, in]: `Linear.store_in_out`). oneDNN reads that layout faster on
        some hosts (a decode step's LM head 0.69-0.84x the time on a Zen 4 EPYC), and
        F.linear reads it too."""
        return "onednn_t" in (self.decode, self.prefill)

    @property
    def packs(self) -> bool:
        """Whether the model's linears keep a packed copy of their weights (`pack_weight`)."""
        return "onednn_packed" in (self.decode, self.prefill)

    def choice(self, x: torch.Tensor, weight: torch.Tensor) -> str:
        """x: [T, ..., in]. The implementation that runs these rows."""
        tokens = x.shape[0] if x.dim() > 1 else 1
        name = self.decode if tokens <= self.max_decode_tokens else self.prefill
        if name == "torch" or x.device.type != "cpu" or x.dtype != weight.dtype:
            return "torch"
        return name if onednn_serves(x.dtype) else "torch"


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernel: LinearKernel | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x W^T (+ b)` by `kernel`'s choice for these rows, else by PyTorch's `F.linear`.
    `packed`: `pack_weight(weight)`, read where the choice is `onednn_packed`."""
    name = kernel.choice(x, weight) if kernel is not None else "torch"
    if name == "torch":
        return F.linear(x, weight, bias)
    if name == "onednn_packed" and packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return onednn_linear(x, weight, bias)


class Linear(nn.Module):
    """`y = x W^T (+ b)` with HF's parameter names (`weight [out, in]`, `bias [out]`).
    `kernel`: set after the model is built (`MoECausalLM.use_linear_kernel`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.weight = empty_parameter(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None
        self.kernel: LinearKernel | None = None
        self.packed: torch.Tensor | None = None  # pack(): the weight in oneDNN's layout
        # True where a layer reads `weight` as a tensor of its own (MLA's kv_b_proj, viewed per
        # head): its layout never changes.
        self.keep_layout = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernel, self.packed)

    def pack(self) -> None:
        """Keep a copy of the (loaded) weight packed for oneDNN (`pack_weight`); a layer that
        reads its weight itself (`keep_layout`) or a weight not on the CPU is left alone."""
        if not self.keep_layout and self.weight.device.type == "cpu":
            self.packed = pack_weight(self.weight)

    def store_in_out(self) -> None:
        """Keep the weight stored [in, out], seen as [out, in] (a transposed view): its
        values, shape and name stay; a checkpoint loaded later writes through the view."""
        if not self.keep_layout and self.weight.stride() != (1, self.weight.shape[0]):
            stored = self.weight.detach().t().contiguous()
            self.weight = nn.Parameter(stored.t(), requires_grad=False)
