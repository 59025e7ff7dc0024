"""The model registry: config.json's `model_type` → the module that implements it.

Modules are imported on first use, so a process imports only the architecture it serves.
Adding an architecture: write its module (see models/base.py) and add its line here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dist_engine.models.base import Architecture
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


def supported_model_types() -> tuple[str, ...]:
    return ARCHITECTURES.names()


def get_architecture(model_type: object) -> Architecture:
    return ARCHITECTURES.get(model_type)


def parse_config(hf: dict[str, Any]) -> ModelConfig:
    """Parse config.json's contents with the module of its `model_type`; raises ValueError
    naming the bad key."""
    architecture = get_architecture(hf.get("model_type"))
    require_keys(hf, REQUIRED_KEYS)
    if hf.get("quantization_config"):
        # e.g. DeepSeek-V3's FP8 blocks: weights plus `weight_scale_inv` tensors this project
        # does not dequantize.
        method = hf["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"config key 'quantization_config' (quant_method {method!r}): quantized checkpoints "
            "are not supported; use a bfloat16 or float32 conversion"
        )
    return architecture.parse_config(hf)


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read and parse `<model_dir>/config.json`; errors name the file or the bad key."""
    return parse_config(read_hf_config(model_dir))
