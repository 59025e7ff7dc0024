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
from collections.abc import Callable
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


@dataclass(frozen=True)
class LinearKernel:
    """Where a linear's other implementation (`onednn_linear`) runs: CPU tensors of a dtype
    it serves here (`onednn_serves`), for steps of `min_tokens` to `max_tokens` rows (None:
    no upper bound), e.g. only decode-sized steps when only those are faster with it. Chosen
    by `linear_backend`."""

    kernel: Callable[..., torch.Tensor]
    min_tokens: int = 0
    max_tokens: int | None = None
    # Whether the model's linears keep their weights stored transposed, [in, out] (each still
    # seen as [out, in]: `Linear.store_in_out`). oneDNN reads that layout faster on some hosts
    # (a decode step's LM head 0.69-0.84x the time on a Zen 4 EPYC), and F.linear reads it too.
    weights_in_out: bool = False

    def serves(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """x: [T, ..., in]."""
        if x.device.type != "cpu" or x.dtype != weight.dtype or not onednn_serves(x.dtype):
            return False
        tokens = x.shape[0] if x.dim() > 1 else 1
        return tokens >= self.min_tokens and (self.max_tokens is None or tokens <= self.max_tokens)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernel: LinearKernel | None = None,
) -> torch.Tensor:
    """`x W^T (+ b)` by `kernel` where it serves these rows, else by PyTorch's `F.linear`."""
    if kernel is not None and kernel.serves(x, weight):
        return kernel.kernel(x, weight, bias)
    return F.linear(x, weight, bias)


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
        # True where a layer reads `weight` as a tensor of its own (MLA's kv_b_proj, viewed per
        # head): its layout never changes.
        self.keep_layout = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernel)

    def store_in_out(self) -> None:
        """Keep the weight stored [in, out], seen as [out, in] (a transposed view): its
        values, shape and name stay; a checkpoint loaded later writes through the view."""
        if not self.keep_layout and self.weight.stride() != (1, self.weight.shape[0]):
            stored = self.weight.detach().t().contiguous()
            self.weight = nn.Parameter(stored.t(), requires_grad=False)
