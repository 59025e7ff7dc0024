"""Model architectures: one module per `model_type`, found through the registry.

- `registry.py`: `model_type` → architecture module (imported on first use).
- `base.py`: what an architecture module provides (`Architecture`).
- `config.py`: `ModelConfig` and the helpers that read config.json.
- `decoder.py`: the decoder every architecture shares; `gqa_moe.py`: the GQA + MoE layers
  Qwen3-MoE, Mixtral, Qwen2-MoE and GLM-4.5 build it from; `mla_moe.py`: the MLA + MoE
  layers (latent cache, shared experts) of DeepSeek-V3 and V2.
- `qwen3_moe.py`, `mixtral.py`, `qwen2_moe.py`, `glm4_moe.py`, `deepseek_v3.py`,
  `deepseek_v2.py`: the architectures.
- `weights.py`: tensor names and shapes (`CheckpointLayout`); `loader.py`: reading a
  checkpoint into a model; `make_model.py`: tiny random checkpoints.
"""

from dist_engine.models.config import ModelConfig
from dist_engine.models.loader import CheckpointReader, build_model, load_model, load_weights
from dist_engine.models.registry import get_architecture, supported_model_types

__all__ = [
    "CheckpointReader",
    "ModelConfig",
    "build_model",
    "get_architecture",
    "load_model",
    "load_weights",
    "supported_model_types",
]
