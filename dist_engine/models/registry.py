"""The model registry: config.json's `model_type` → the module that implements it.

Modules are imported on first use, so a process imports only the architecture it serves.
Adding an architecture: write its module (see models/base.py) and add its line here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dist_engine.models.base import Architecture
from dist_engine.models.block_fp8 import parse_quantization_config
from dist_engine.models.config import REQUIRED_KEYS, ModelConfig, read_hf_config, require_keys
from scheduler.registry import Lazy, Registry

# config.json's model_type -> the module's `ARCHITECTURE`, imported when first served.
ARCHITECTURES: Registry[Architecture] = Registry(
    "model_type",
    {
        "qwen3_moe": Lazy("dist_engine.models.qwen3_moe:ARCHITECTURE"),
        "mixtral": Lazy("dist_engine.models.mixtral:ARCHITECTURE"),
        "deepseek_v3": Lazy("dist_engine.models.deepseek_v3:ARCHITECTURE"),
        "deepseek_v2": Lazy("dist_engine.models.deepseek_v2:ARCHITECTURE"),
        "qwen2_moe": Lazy("dist_engine.models.qwen2_moe:ARCHITECTURE"),
        "glm4_moe": Lazy("dist_engine.models.glm4_moe:ARCHITECTURE"),
    },
)
# The architectures whose block-FP8 checkpoints load (dequantized at load): those with releases
# in that format (DeepSeek-V3/R1, Qwen3-MoE) and DeepSeek-V2, which shares V3's layers. GLM-4.5's
# FP8 release is compressed-tensors (per-channel scales), another format.
BLOCK_FP8_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "qwen3_moe")


def supported_model_types() -> tuple[str, ...]:
    return ARCHITECTURES.names()


def get_architecture(model_type: object) -> Architecture:
    return ARCHITECTURES.get(model_type)


def parse_config(hf: dict[str, Any]) -> ModelConfig:
    """Parse config.json's contents with the module of its `model_type`; raises ValueError
    naming the bad key."""
    architecture = get_architecture(hf.get("model_type"))
    require_keys(hf, REQUIRED_KEYS)
    config = architecture.parse_config(hf)
    if not hf.get("quantization_config"):
        return config
    quantization = parse_quantization_config(hf["quantization_config"])
    if config.model_type not in BLOCK_FP8_MODEL_TYPES:
        raise ValueError(
            f"config key 'quantization_config': block-FP8 checkpoints load for "
            f"{list(BLOCK_FP8_MODEL_TYPES)}, not {config.model_type!r}; load a bfloat16 conversion"
        )
    return dataclasses.replace(config, quantization=quantization)


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read and parse `<model_dir>/config.json`; errors name the file or the bad key."""
    return parse_config(read_hf_config(model_dir))
