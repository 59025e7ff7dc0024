"""What an architecture module provides: the contract behind the model registry.

One module per architecture (models/qwen3_moe.py, models/mixtral.py, ...), each exposing an
`ARCHITECTURE` instance of a subclass of `Architecture`: how to read its config.json, how its
tensors are named, how its layers are built from the pieces in dist_engine/layers, and what a
tiny random checkpoint of it looks like (`lockstep make-model`). Adding an architecture is one
such module plus one line in models/registry.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from dist_engine.backends import LayerOps
from dist_engine.layers.moe import ExpertParallelContext
from dist_engine.models.config import ModelConfig
from dist_engine.models.decoder import MoECausalLM
from dist_engine.models.weights import CheckpointLayout


class Architecture(ABC):
    model_type: ClassVar[str]  # config.json's "model_type"
    hf_class: ClassVar[str]  # the transformers class, for config.json's "architectures"

    @abstractmethod
    def parse_config(self, hf: dict[str, Any]) -> ModelConfig:
        """The contents of config.json → ModelConfig; ValueError naming the bad key."""

    def layout(self, config: ModelConfig) -> CheckpointLayout:
        """Tensor names and shapes in a checkpoint, and where each goes in the model."""
        return CheckpointLayout(config)

    @abstractmethod
    def build(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | None,
        ep_context: ExpertParallelContext,
        ops: LayerOps,
    ) -> MoECausalLM:
        """The model with empty weights (the loader fills them)."""

    @abstractmethod
    def tiny_hf_config(self, common: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
        """config.json of a tiny random checkpoint: `common` holds the keys every architecture
        shares (sizes, rope, eos, ...), `options` the writer's settings (see make_model)."""
