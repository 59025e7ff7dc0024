"""Checkpoint loading: layouts (sharded, HF save_pretrained, fused), errors, per-rank experts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from model_fixtures import TINY_SIZES, hf_model, random_prompts
from safetensors.torch import load_file, save_file

from dist_engine.attention.metadata import AttentionMetadata
from dist_engine.distributed.spawn import run_multirank
from dist_engine.layers.moe import ExpertParallelContext
from dist_engine.models.decoder import MoECausalLM
from dist_engine.models.loader import (
    CheckpointReader,
    build_model,
    load_model,
    load_weights,
    planned_reads,
)
from dist_engine.models.make_model import make_tiny_checkpoint
from dist_engine.models.registry import load_config
from moe import DispatchMode, ExpertPlacement

PROMPT = random_prompts(1, TINY_SIZES["vocab_size"], 19, 19, seed=4)[0]


def _logits(model: MoECausalLM, prompt: list[int] = PROMPT) -> torch.Tensor:
    model.attach_kv_cache(model.new_kv_cache(16, 4))
    table = list(range(1, 1 + -(-len(prompt) // 4)))
    attn = AttentionMetadata.build([table], [0], [len(prompt)], 4, is_prefill=True)
    hidden = model(torch.tensor(prompt), attn.positions, attn, DispatchMode.NORMAL)
    return model.compute_logits(hidden)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen")
    return make_tiny_checkpoint("qwen3_moe", out, seed=5, mlp_only_layers=[0], **TINY_SIZES)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_sharded_checkpoint_equals_single_file(tmp_path: Path, qwen_dir: Path) -> None:
    sharded = make_tiny_checkpoint(
        "qwen3_moe", tmp_path, seed=5, mlp_only_layers=[0], num_shards=3, **TINY_SIZES
    )
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert not (sharded / "model.safetensors").exists()
    torch.testing.assert_close(_logits(load_model(sharded)), _logits(load_model(qwen_dir)))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe"])
@pytest.mark.parametrize("layout", ["save_pretrained", "fused"])
def test_transformers_checkpoints_load(tmp_path: Path, arch: str, layout: str) -> None:
    """What transformers writes (per-expert names) and its in-memory fused names both load."""
    transformers = pytest.importorskip("transformers")
    common = {
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
        "initializer_range": 0.1,
    }
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common,
            head_dim=16,
            num_experts=8,
            moe_intermediate_size=32,
            intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        )
    elif arch == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=8, intermediate_size=32)
    elif arch == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **common,
            num_experts=8,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            intermediate_size=48,
            mlp_only_layers=[0],
        )
    else:
        config = transformers.Glm4MoeConfig(
            **common,
            n_routed_experts=8,
            moe_intermediate_size=32,
            intermediate_size=48,
            n_group=2,
            topk_group=1,
            use_qk_norm=True,
            attention_bias=True,
        )
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    if arch == "glm4_moe":  # random init leaves the selection bias at zero
        with torch.no_grad():
            reference.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    if layout == "save_pretrained":
        reference.save_pretrained(tmp_path)
        names = load_file(str(tmp_path / "model.safetensors")).keys()
        assert not any("gate_up_proj" in n for n in names)  # HF converts back on save
    else:
        config.save_pretrained(tmp_path)
        state = {k: v.contiguous() for k, v in reference.state_dict().items()}
        assert any("gate_up_proj" in n for n in state)
        save_file(state, str(tmp_path / "model.safetensors"))
    prompt = [p % 256 for p in PROMPT]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_logits(load_model(tmp_path), prompt), expected, atol=2e-5, rtol=0)


def test_missing_tensor_is_named(tmp_path: Path, qwen_dir: Path) -> None:
    model_dir = _copy(qwen_dir, tmp_path / "ckpt")
    name = "model.layers.1.self_attn.k_norm.weight"
    _rewrite_weights(model_dir, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing tensor '{name}'"):
        load_model(model_dir)


def test_missing_expert_is_named_on_every_rank(tmp_path: Path, qwen_dir: Path) -> None:
    model_dir = _copy(qwen_dir, tmp_path / "ckpt")
    name = "model.layers.1.mlp.experts.7.up_proj.weight"
    _rewrite_weights(model_dir, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing tensor '{name}'"):
        load_model(model_dir)


def test_wrong_shape_is_named(tmp_path: Path, qwen_dir: Path) -> None:
    model_dir = _copy(qwen_dir, tmp_path / "ckpt")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    _rewrite_weights(model_dir, lambda t: t.update({name: torch.zeros(64, 31)}))
    with pytest.raises(ValueError, match=rf"'{name}' .* shape \[64, 31\], expected \[64, 32\]"):
        load_model(model_dir)


def test_unexpected_tensor_is_an_error(tmp_path: Path, qwen_dir: Path) -> None:
    model_dir = _copy(qwen_dir, tmp_path / "ckpt")
    name = "model.layers.1.mlp.shared_expert.gate_proj.weight"
    _rewrite_weights(model_dir, lambda t: t.update({name: torch.zeros(4, 64)}))
    with pytest.raises(ValueError, match=rf"does not use: \['{name}'\]"):
        load_model(model_dir)


def test_bad_model_type_and_missing_files(tmp_path: Path, qwen_dir: Path) -> None:
    model_dir = _copy(qwen_dir, tmp_path / "ckpt")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        load_model(model_dir)
    (model_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_model(model_dir)
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors files"):
        load_model(model_dir)
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"shard 'model-00001-of-00002\.safetensors'"):
        load_model(model_dir)


def test_bfloat16_checkpoint_loads_into_float32_model(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint("mixtral", tmp_path, seed=1, dtype="bfloat16", **TINY_SIZES)
    ours = load_model(model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = hf_model(model_dir, dtype=torch.float32)(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(_logits(ours), expected, atol=2e-5, rtol=0)


def _ep_worker(rank: int, world_size: int, model_dir: str, prompts: list[list[int]]) -> dict:
    """Load this rank's share of the experts, then run one EP prefill and one EP decode step."""
    placement = ExpertPlacement.even(TINY_SIZES["num_experts"], world_size)
    context = ExpertParallelContext(placement=placement, rank=rank, group=dist.group.WORLD)
    model = build_model(load_config(model_dir), ep_context=context)
    with CheckpointReader(model_dir) as reader:
        planned = planned_reads(model.config, reader, context)  # what the progress line counts
        load_weights(model, reader, context)
        tensors_read = list(reader.tensors_read)
    assert tensors_read == planned
    prefill = _logits(model, prompts[rank])
    # Decode one token on top of the prompt; ranks have different context lengths.
    prompt = prompts[rank]
    table = list(range(1, 1 + -(-(len(prompt) + 1) // 4)))
    attn = AttentionMetadata.build([table], [len(prompt)], [1], 4, is_prefill=False)
    token = prefill[-1:].argmax(-1)
    decode = model.compute_logits(model(token, attn.positions, attn, DispatchMode.LOW_LATENCY))
    return {"tensors_read": tensors_read, "prefill": prefill, "decode": decode}


@pytest.mark.multirank
def test_each_rank_reads_only_its_experts_and_ep_matches_single(qwen_dir: Path) -> None:
    prompts = [PROMPT, PROMPT[:7]]
    results = run_multirank(2, _ep_worker, (str(qwen_dir), prompts), timeout_s=90)
    experts_per_rank = TINY_SIZES["num_experts"] // 2
    for rank, result in enumerate(results):
        read_experts = {
            int(name.split(".experts.")[1].split(".")[0])
            for name in result["tensors_read"]
            if ".experts." in name
        }
        assert read_experts == set(range(rank * experts_per_rank, (rank + 1) * experts_per_rank))
        assert "model.embed_tokens.weight" in result["tensors_read"]
    single = load_model(qwen_dir)
    for rank, result in enumerate(results):
        expected = _logits(single, prompts[rank])
        torch.testing.assert_close(result["prefill"], expected, atol=1e-5, rtol=1e-5)
        prompt = prompts[rank] + [int(expected[-1].argmax())]
        torch.testing.assert_close(
            result["decode"], _logits(single, prompt)[-1:], atol=1e-5, rtol=1e-5
        )
