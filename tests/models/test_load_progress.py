"""A rank's loading progress over its shards: what it plans to read is what it reads, in
every layout, and its log gets one progress line per interval and one line at the end."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_engine.layers.moe import ExpertParallelContext
from dist_engine.models import loader
from dist_engine.models.loader import (
    CheckpointReader,
    build_model,
    load_model,
    load_weights,
    planned_reads,
)
from dist_engine.models.make_model import make_tiny_checkpoint
from dist_engine.models.registry import get_architecture, load_config


@pytest.fixture(scope="module")
def fp8_shards(tmp_path_factory) -> Path:
    """A block-FP8 DeepSeek-V3 release in 3 shards: scales beside their weights."""
    out = tmp_path_factory.mktemp("v3")
    return make_tiny_checkpoint("deepseek_v3", out, seed=1, fp8=True, num_shards=3)


def _fused(model_dir: str, out: Path) -> Path:
    """The checkpoint with each MoE layer's experts in transformers' fused in-memory names."""
    shutil.copytree(model_dir, out)
    config = load_config(out)
    layout = get_architecture(config.model_type).layout(config)
    tensors = load_file(str(out / "model.safetensors"))
    for layer in config.moe_layer_indices:
        names = layout.expert_names(layer)
        experts = [[tensors.pop(n) for n in names.per_expert(e)] for e in range(config.num_experts)]
        tensors[names.fused_gate_up] = torch.stack([torch.cat([g, u]) for g, u, _ in experts])
        tensors[names.fused_down] = torch.stack([d for _, _, d in experts])
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_the_planned_reads_are_the_reads_in_every_layout(model_dir, fp8_shards, tmp_path):
    for directory in (Path(model_dir), fp8_shards, _fused(model_dir, tmp_path / "fused")):
        config = load_config(directory)
        model = build_model(config)
        with CheckpointReader(directory) as reader:
            planned = planned_reads(config, reader, ExpertParallelContext())
            load_weights(model, reader, ExpertParallelContext())
            assert reader.tensors_read == planned, directory
    assert any(entry.endswith("[0]") for entry in planned)  # the fused rows, one by one


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lockstep"]


def test_a_rank_logs_its_shards_as_they_are_done_then_one_line(fp8_shards, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="lockstep")
    load_model(fp8_shards)  # quicker than the interval: only the closing line
    (line,) = [line for line in _lines(caplog) if fp8_shards.name in line]
    assert line.startswith("[rank 0] loaded its weights: 3 of 3 shard(s) of ")
    assert line.endswith(" s") and " MiB read in " in line
    caplog.clear()
    monkeypatch.setattr(loader, "PROGRESS_INTERVAL_S", 0.0)  # a line at every shard
    load_model(fp8_shards)
    bars = [
        line for line in _lines(caplog) if line.startswith(f"[rank 0] loading {fp8_shards.name}")
    ]
    assert [bar.split("|")[-1].split()[0] for bar in bars] == ["0/3", "1/3", "2/3", "3/3"]
    assert "MiB]" in bars[-1] and len(_lines(caplog)) - len(bars) <= 2  # + backends, the end
