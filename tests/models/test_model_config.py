"""ModelConfig parsing, the tiny-checkpoint writer's extras (tokenizer, CLI, tied embeddings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_fixtures import TINY_SIZES, hf_model, random_prompts

from dist_engine.attention.kv_cache import KVCache
from dist_engine.attention.metadata import AttentionMetadata
from dist_engine.models.loader import load_model
from dist_engine.models.make_model import main, make_tiny_checkpoint
from dist_engine.models.registry import load_config, parse_config
from moe import DispatchMode

QWEN_HUB_STYLE = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
    "eos_token_id": 151645,
    "max_position_embeddings": 40960,
    "use_sliding_window": False,
    "sliding_window": None,
}


def test_qwen3_hub_config_parses() -> None:
    config = parse_config(QWEN_HUB_STYLE)
    assert (config.num_experts, config.top_k, config.head_dim) == (128, 8, 128)
    assert config.rope_theta == 1e6 and config.norm_topk_prob and config.use_qk_norm
    assert config.eos_token_ids == (151645,)
    assert config.moe_layer_indices == list(range(48))


def test_qwen3_dense_layers_follow_hf_rule() -> None:
    config = parse_config(
        {**QWEN_HUB_STYLE, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    )
    # Sparse where (i + 1) % step == 0 and i not in mlp_only_layers.
    assert config.moe_layer_indices == [1, 5]


def test_mixtral_config_always_renormalises_and_derives_head_dim() -> None:
    config = parse_config(
        {
            "model_type": "mixtral",
            "vocab_size": 32000,
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": None,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 14336,
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
            "eos_token_id": [2, 3],
        }
    )
    assert config.head_dim == 128 and config.moe_intermediate_size == 14336
    assert config.norm_topk_prob and not config.use_qk_norm and config.mlp_only_layers == ()
    assert config.eos_token_ids == (2, 3)


def test_glm4_moe_and_qwen2_moe_hub_configs_parse() -> None:
    glm = parse_config(  # zai-org/GLM-4.5-Air
        {
            "model_type": "glm4_moe",
            "vocab_size": 151552,
            "hidden_size": 4096,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": 46,
            "num_attention_heads": 96,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "partial_rotary_factor": 0.5,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": True,
            "use_qk_norm": False,
            "attention_bias": True,
            "rope_theta": 1000000,
            "max_position_embeddings": 131072,
            "num_nextn_predict_layers": 1,
            "rms_norm_eps": 1e-05,
            "eos_token_id": [151329, 151336, 151338],
        }
    )
    assert glm.rotary_dim == 64 and glm.attention_bias and not glm.output_bias
    assert glm.moe_layer_indices == list(range(1, 46)) and glm.num_extra_layers == 1
    assert glm.routing.scoring == "sigmoid" and glm.routing.correction_bias
    assert glm.shared_expert_intermediate_size == 1408 and glm.router_in_float32
    qwen2 = parse_config(  # Qwen/Qwen1.5-MoE-A2.7B
        {
            "model_type": "qwen2_moe",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "decoder_sparse_step": 1,
            "norm_topk_prob": False,
            "rope_theta": 1000000.0,
            "use_sliding_window": False,
            "sliding_window": 32768,
            "max_position_embeddings": 8192,
            "eos_token_id": 151643,
        }
    )
    assert qwen2.head_dim == 128 and qwen2.attention_bias and not qwen2.output_bias
    assert qwen2.shared_expert_gate and qwen2.shared_expert_intermediate_size == 5632
    assert qwen2.routing.scoring == "softmax" and not qwen2.norm_topk_prob


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"hidden_size": None}, "missing the key 'hidden_size'"),
        ({"num_key_value_heads": 0}, "'num_key_value_heads' must be a positive integer, got 0"),
        ({"num_key_value_heads": 5}, r"num_attention_heads \(32\) must be a multiple of .*\(5\)"),
        ({"num_experts_per_tok": 200}, r"num_experts_per_tok \(200\) exceeds .* \(128\)"),
        ({"mlp_only_layers": [2, 48]}, r"has layers \[48\] outside \[0, 48\)"),
        ({"rope_scaling": {"type": "yarn"}}, "only default RoPE is supported"),
        ({"hidden_act": "gelu"}, "'hidden_act' must be 'silu', got 'gelu'"),
        ({"use_sliding_window": True, "sliding_window": 4096}, "sliding_window=4096"),
        ({"eos_token_id": "eos"}, "'eos_token_id' must be an int or a list of ints, got 'eos'"),
    ],
)
def test_bad_config_names_key_and_value(change: dict, message: str) -> None:
    hf = {**QWEN_HUB_STYLE, **change}
    hf = {k: v for k, v in hf.items() if v is not None or k not in change}
    with pytest.raises(ValueError, match=message):
        parse_config(hf)


def test_bad_json_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(tmp_path)


def test_tokenizer_ids_fit_the_vocabulary(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    model_dir = make_tiny_checkpoint("mixtral", tmp_path, vocab_size=300)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() <= 300
    text = "Wide experts, ünïcödé and 123!"
    ids = tokenizer.encode(text).ids
    assert max(ids) < 300 and tokenizer.decode(ids) == text
    assert tokenizer.token_to_id("<|endoftext|>") == 0
    assert json.loads((model_dir / "config.json").read_text())["eos_token_id"] == 0


def test_cli_writes_a_loadable_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cli"
    argv = ["--arch", "qwen3_moe", "--out", str(out), "--seed", "2", "--num-layers", "1"]
    assert main([*argv, "--num-experts", "4", "--top-k", "1", "--shards", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = load_config(out)
    assert (config.num_layers, config.num_experts, config.top_k) == (1, 4, 1)
    assert (out / "model.safetensors.index.json").is_file()
    load_model(out)


def test_tied_embeddings_match_transformers(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(
        "qwen3_moe", tmp_path, seed=9, tie_word_embeddings=True, **TINY_SIZES
    )
    ours = load_model(model_dir)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    prompt = random_prompts(1, TINY_SIZES["vocab_size"], 12, 12, seed=3)[0]
    ours.attach_kv_cache(KVCache.for_model(ours.config, 8, 4, ours.dtype))
    attn = AttentionMetadata.build([[1, 2, 3]], [0], [12], 4, is_prefill=True)
    hidden = ours(torch.tensor(prompt), attn.positions, attn, DispatchMode.NORMAL)
    logits = ours.compute_logits(hidden)
    with torch.no_grad():
        expected = hf_model(model_dir)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=0)
