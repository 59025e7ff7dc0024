"""Block-quantized FP8 checkpoints, as DeepSeek-V3/R1 and the Qwen3 FP8 releases publish them.

A linear weight `W [O, I]` is stored as `name` in float8_e4m3fn plus `name + "_scale_inv"`
`[ceil(O/128), ceil(I/128)]`, one dequantization scale per 128x128 block (the last block of a
row or column is partial where a dimension is not a multiple of 128): `W = weight * scale_inv`
block by block. config.json says so in `quantization_config` (`quant_method: fp8`, `fmt: e4m3`,
`weight_block_size: [128, 128]`, `activation_scheme: dynamic`). The releases leave the
embeddings, norms, routers, `lm_head` and the selection bias unquantized; which tensors are
quantized is read from each tensor's dtype, never guessed from its name.

Execution path: this module dequantizes each weight once, at load, to the run dtype
(`dequantize`), so every backend runs unchanged. The other path (keep the FP8 weights and their
scales and run block-scaled GEMMs) would be a backend choice made when the model is built, fed
by the same `BlockFP8Format` and the same per-tensor checks; it is not built here.

Tensor dtypes are safetensors' names ("F8_E4M3", "BF16", ...): the checks read headers only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SCALE_SUFFIX = "_scale_inv"
SUPPORTED_BLOCK_SIZE = (128, 128)
# DeepSeek stores the scales in float32; Qwen3's dense FP8 releases in bfloat16, one in float16.
SCALE_DTYPES = ("F32", "BF16", "F16")
FLOAT8_DTYPES = ("F8_E4M3", "F8_E5M2")
# `scale_fmt: ue8m0` (DeepSeek-V3.1) rounds the scales to powers of two; stored as floats they
# dequantize alike. It also tells a GPU path how to quantize activations, which this one does not.
SCALE_FORMATS = (None, "ue8m0")
# Every float8_e4m3fn value by its byte (NaN at 0x7f and 0xff), as torch converts it.
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).to(torch.float32)
DTYPE_NAMES = {
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "U8": "uint8",
    "I8": "int8",
}


@dataclass(frozen=True)
class BlockFP8Format:
    """How a block-FP8 checkpoint stores its quantized weights (`quantization_config`)."""

    block_size: tuple[int, int] = SUPPORTED_BLOCK_SIZE
    # Modules the release says it left unquantized (Qwen3 lists them; DeepSeek does not).
    modules_to_not_convert: tuple[str, ...] = ()

    def scale_name(self, weight_name: str) -> str:
        return weight_name + SCALE_SUFFIX

    def scale_shape(self, weight_shape: Sequence[int]) -> tuple[int, int]:
        """[ceil(O / block_rows), ceil(I / block_cols)] for a weight [O, I]."""
        rows, cols = weight_shape
        return -(-rows // self.block_size[0]), -(-cols // self.block_size[1])

    def left_unquantized(self, name: str) -> bool:
        module = name.rsplit(".", 1)[0]
        return any(module == m or module.startswith(m + ".") for m in self.modules_to_not_convert)


def parse_quantization_config(value: object) -> BlockFP8Format:
    """config.json's `quantization_config` → the format; ValueError naming the key otherwise.

    `fmt` and `activation_scheme` may be absent (transformers' defaults, e4m3 and dynamic)."""
    if not isinstance(value, dict):
        raise ValueError(f"config key 'quantization_config' must be an object, got {value!r}")
    key = "config key 'quantization_config."
    method = value.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"{key}quant_method' is {method!r}; supported: 'fp8' (float8_e4m3fn weights with "
            "128x128 weight_scale_inv blocks); for other formats load a bfloat16 conversion"
        )
    fmt = value.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{key}fmt' is {fmt!r}; supported: 'e4m3' (float8_e4m3fn)")
    block = value.get("weight_block_size")
    if not isinstance(block, (list, tuple)) or tuple(block) != SUPPORTED_BLOCK_SIZE:
        raise ValueError(
            f"{key}weight_block_size' is {block!r}; supported: {list(SUPPORTED_BLOCK_SIZE)}"
        )
    scheme = value.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{key}activation_scheme' is {scheme!r}; supported: 'dynamic'")
    scale_fmt = value.get("scale_fmt")
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"{key}scale_fmt' is {scale_fmt!r}; supported: absent or 'ue8m0'")
    skipped = value.get("modules_to_not_convert") or []
    if not isinstance(skipped, list) or not all(isinstance(m, str) for m in skipped):
        raise ValueError(f"{key}modules_to_not_convert' must be a list of module names")
    return BlockFP8Format(tuple(block), tuple(skipped))


def is_quantized(
    fmt: BlockFP8Format | None,
    name: str,
    dtype: str,
    shape: Sequence[int],
    scale: tuple[str, Sequence[int]] | None,
) -> bool:
    """Whether checkpoint tensor `name` (safetensors `dtype`, `shape`) is a block-quantized
    weight, given its scale tensor's (dtype, shape) or None when the checkpoint has none.
    Raises ValueError, naming the tensor, for anything the format cannot read."""
    shown = DTYPE_NAMES.get(dtype, dtype)
    scale_name = name + SCALE_SUFFIX
    if fmt is None:
        if dtype in FLOAT8_DTYPES:
            raise ValueError(
                f"tensor {name!r} is {shown}, but config.json has no 'quantization_config'; "
                "a block-FP8 checkpoint states quant_method 'fp8' there"
            )
        return False
    if scale is None and dtype not in FLOAT8_DTYPES:
        return False
    if dtype != "F8_E4M3":
        raise ValueError(
            f"tensor {name!r} is {shown}"
            + (f" and has block scales {scale_name!r}" if scale is not None else "")
            + "; block-quantized weights must be float8_e4m3fn"
        )
    if len(shape) != 2:
        raise ValueError(
            f"tensor {name!r} is float8_e4m3fn with shape {list(shape)}; only 2-D weights "
            "[out, in] are block-quantized (fused expert tensors are not: the releases store "
            "experts one by one)"
        )
    if fmt.left_unquantized(name):
        raise ValueError(
            f"tensor {name!r} is float8_e4m3fn, but quantization_config.modules_to_not_convert "
            "lists its module"
        )
    expected = fmt.scale_shape(shape)
    if scale is None:
        raise ValueError(
            f"tensor {name!r} is float8_e4m3fn but the checkpoint has no {scale_name!r} "
            f"(its block scales, shape {list(expected)})"
        )
    scale_dtype, scale_shape = scale
    if tuple(scale_shape) != expected:
        raise ValueError(
            f"tensor {scale_name!r} has shape {list(scale_shape)}, expected {list(expected)} "
            f"(ceil of {list(shape)} / {list(fmt.block_size)})"
        )
    if scale_dtype not in SCALE_DTYPES:
        allowed = [DTYPE_NAMES[d] for d in SCALE_DTYPES]
        raise ValueError(
            f"tensor {scale_name!r} is {DTYPE_NAMES.get(scale_dtype, scale_dtype)}; "
            f"block scales must be one of {allowed}"
        )
    return True


def dequantize(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """weight: [O, I] float8_e4m3fn; scale_inv: [ceil(O/bo), ceil(I/bi)] → [O, I] in `dtype`,
    on weight's device: each block times its scale, in float32.

    One block row at a time, so the float32 working set is `bo` rows, not the whole weight.
    The FP8 values are looked up by their byte in a 256-entry table of torch's own conversions
    (the same floats): PyTorch's CPU cast from float8 runs element by element, several times
    slower than a gather."""
    rows, cols = weight.shape
    block_rows, block_cols = block_size
    assert scale_inv.shape == (-(-rows // block_rows), -(-cols // block_cols)), scale_inv.shape
    # [R, I]: each column's scale, per block row (the last block column cut to size).
    column_scales = scale_inv.to(weight.device, torch.float32)
    column_scales = column_scales.repeat_interleave(block_cols, dim=1)[:, :cols]
    values = _FP8_VALUES.to(weight.device)
    codes = weight.view(torch.uint8)
    out = torch.empty(rows, cols, dtype=dtype, device=weight.device)
    for block_row, start in enumerate(range(0, rows, block_rows)):
        stop = min(start + block_rows, rows)
        indices = codes[start:stop].reshape(-1).to(torch.int32)
        block = values.index_select(0, indices).view(stop - start, cols)
        out[start:stop] = block.mul_(column_scales[block_row])
    return out


def quantize(
    weight: torch.Tensor, block_size: tuple[int, int] = SUPPORTED_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [O, I] floating → (float8_e4m3fn [O, I], float32 scale_inv [ceil(O/bo),
    ceil(I/bi)]), as the release tooling does: per block, scale_inv = absmax / 448 and the
    weight divided by it, rounded to the nearest float8_e4m3fn."""
    rows, cols = weight.shape
    block_rows, block_cols = block_size
    num_row_blocks, num_col_blocks = -(-rows // block_rows), -(-cols // block_cols)
    padded = weight.new_zeros(num_row_blocks * block_rows, num_col_blocks * block_cols)
    padded = padded.to(torch.float32)
    padded[:rows, :cols] = weight.to(torch.float32)
    blocks = padded.view(num_row_blocks, block_rows, num_col_blocks, block_cols)
    absmax = blocks.abs().amax(dim=(1, 3))
    # An all-zero block keeps scale 0 (its values stay 0); dividing by a tiny scale avoids 0/0.
    scale_inv = absmax / FP8_MAX
    divisor = scale_inv.clamp(min=torch.finfo(torch.float32).tiny)[:, None, :, None]
    scaled = (blocks / divisor).clamp(-FP8_MAX, FP8_MAX).view_as(padded)[:rows, :cols]
    return scaled.to(FP8_DTYPE), scale_inv


def release_quantization_config(**extra: Any) -> dict[str, Any]:
    """The `quantization_config` the block-FP8 releases write (plus `extra` keys)."""
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(SUPPORTED_BLOCK_SIZE),
        **extra,
    }
