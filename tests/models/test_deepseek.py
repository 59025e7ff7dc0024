"""DeepSeek-V3 and V2 (MLA over a latent cache, grouped routing, shared experts) against
transformers on tiny random checkpoints, their config parsing, and the latent cache."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from model_fixtures import TINY_SIZES, PagedGreedyRunner, hf_greedy, hf_model, random_prompts
from safetensors.torch import load_file, save_file

from dist_engine.attention.latent_cache import LatentKVCache, LatentKVSpec
from dist_engine.attention.metadata import AttentionMetadata
from dist_engine.attention.mla_torch import TorchMLA
from dist_engine.backends import Backends, RegimeChoice, resolve_backends
from dist_engine.layers.linear import Linear, onednn_serves
from dist_engine.models.block_fp8 import BlockFP8Format
from dist_engine.models.hub_configs import DEEPSEEK_V2_LITE_HUB, DEEPSEEK_V3_HUB
from dist_engine.models.loader import load_model
from dist_engine.models.make_model import make_tiny_checkpoint
from dist_engine.models.registry import load_config, parse_config
from moe import DispatchMode

YARN = {
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
# Tiny configs covering: q low-rank or full-rank q; YaRN or default RoPE; interleaved or
# half-split rotary pairs; V3's sigmoid grouped top-k with its (nonzero) correction bias and
# V2's softmax greedy top-k, group-limited or not; shared experts; dense first layers.
CASES = {
    "v3_q_lora_yarn": ("deepseek_v3", {"num_layers": 3, "yarn": YARN}),
    "v3_full_q": (
        "deepseek_v3",
        {
            "num_layers": 2,
            "q_lora_rank": None,
            "rope_interleave": False,
            "n_group": 4,
            "topk_group": 2,
            "first_k_dense_replace": 0,
            "n_shared_experts": 2,
        },
    ),
    "v2_grouped_yarn": (
        "deepseek_v2",
        {"num_layers": 3, "q_lora_rank": None, "yarn": {**YARN, "mscale": 0.707}},
    ),
    "v2_greedy": ("deepseek_v2", {"num_layers": 2, "topk_method": "greedy"}),
}
NUM_PROMPTS = 8
NUM_NEW_TOKENS = 16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and on a loaded machine OpenMP's
    spinning workers made these tests 50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, options = CASES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    return make_tiny_checkpoint(arch, out, seed=3, **TINY_SIZES, **options)


def _prompt_logits(model, prompt: list[int]) -> torch.Tensor:
    model.attach_kv_cache(model.new_kv_cache(32, 8))
    table = list(range(1, 1 + -(-len(prompt) // 8)))
    attn = AttentionMetadata.build([table], [0], [len(prompt)], 8, is_prefill=True)
    hidden = model(torch.tensor(prompt), attn.positions, attn, DispatchMode.NORMAL)
    return model.compute_logits(hidden)


def test_prompt_logits_match_transformers(checkpoint: Path) -> None:
    ours, reference = load_model(checkpoint), hf_model(checkpoint)
    prompt = random_prompts(1, TINY_SIZES["vocab_size"], 41, 41, seed=1)[0]
    logits = _prompt_logits(ours, prompt)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.skipif(not onednn_serves(torch.float32), reason="this torch has no oneDNN")
def test_weights_stored_in_out_leave_mla_alone(checkpoint: Path) -> None:
    """`linear_backend: onednn_t` stores every Linear's weight [in, out] except MLA's kv_b_proj,
    which the attention views per head; the logits stay transformers'."""
    backends = Backends.all("torch", attention_kind="mla")
    backends = replace(backends, linear=RegimeChoice("onednn_t", "onednn_t"))
    ours, reference = load_model(checkpoint, backends=backends), hf_model(checkpoint)
    linears = {n: m for n, m in ours.named_modules() if isinstance(m, Linear)}
    assert any(n.endswith("kv_b_proj") for n in linears)
    for name, module in linears.items():
        in_out = module.weight.stride() == (1, module.weight.shape[0])
        assert in_out != name.endswith("kv_b_proj"), name
    prompt = random_prompts(1, TINY_SIZES["vocab_size"], 41, 41, seed=1)[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_prompt_logits(ours, prompt), expected, atol=2e-5, rtol=1e-5)


def test_greedy_generation_matches_transformers(checkpoint: Path) -> None:
    """Prefill (a third in two chunks, the second over a cached prefix), then absorbed decode
    over scattered blocks of the latent cache."""
    ours, reference = load_model(checkpoint), hf_model(checkpoint)
    prompts = random_prompts(NUM_PROMPTS, TINY_SIZES["vocab_size"], 2, 29, seed=7)
    prompts[0] = prompts[0][:1]
    chunked = [b % 3 == 1 for b in range(NUM_PROMPTS)]
    outputs = PagedGreedyRunner(ours, block_size=4).generate(prompts, NUM_NEW_TOKENS, chunked)
    for b, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        expected = hf_greedy(reference, prompt, NUM_NEW_TOKENS)
        assert output == expected, f"prompt {b} (len {len(prompt)}, chunked={chunked[b]})"


def test_tiny_checkpoint_has_a_selection_bias_that_matters(v3_dir: Path) -> None:
    """Random init would leave e_score_correction_bias at zero; make_model draws it, and it
    changes which experts many tokens choose (so the parity tests cover biased selection)."""
    model = load_model(v3_dir)
    layer = next(layer.mlp for layer in model.model.layers if layer.mlp_takes_mode)
    bias = layer.gate.e_score_correction_bias
    assert bias.abs().min() > 0
    hidden = torch.randn(256, TINY_SIZES["hidden_size"], generator=torch.Generator().manual_seed(0))
    logits = layer.gate(hidden)
    chosen = layer.routing.route(logits, layer.top_k, True, bias).topk_ids.sort(-1).values
    unbiased = layer.routing.route(logits, layer.top_k, True, None).topk_ids.sort(-1).values
    assert (chosen != unbiased).any(-1).float().mean() > 0.1


def test_absorbed_and_expanded_forms_agree() -> None:
    """Both forms in both regimes, over fresh prompts, a chunk behind a cached prefix and
    decode, on shuffled blocks."""
    gen = torch.Generator().manual_seed(0)
    heads, nope, rope, value, latent = 4, 16, 8, 12, 32
    cache = torch.randn(40, 4, latent + rope, generator=gen, dtype=torch.float64)
    kv_up = torch.randn(heads, nope + value, latent, generator=gen, dtype=torch.float64)
    blocks = torch.randperm(39, generator=gen) + 1
    tables = [blocks[0:6].tolist(), blocks[6:9].tolist(), blocks[9:16].tolist()]
    for cached, new in (([0, 0, 0], [21, 9, 3]), ([13, 0, 20], [5, 7, 6]), ([17, 9, 25], [1] * 3)):
        attn = AttentionMetadata.build(tables, cached, new, 4, is_prefill=max(new) > 1)
        q_nope = torch.randn(attn.num_tokens, heads, nope, generator=gen, dtype=torch.float64)
        q_rope = torch.randn(attn.num_tokens, heads, rope, generator=gen, dtype=torch.float64)
        outs = [
            TorchMLA(form, form).attend(q_nope, q_rope, cache, kv_up, attn, 0.2)
            for form in ("absorbed", "expanded")
        ]
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-10)
        # and the dense reference: each token against its own sequence's positions
        for b, table in enumerate(tables):
            context = cache[table].reshape(-1, latent + rope)[: cached[b] + new[b]]
            keys = context[:, :latent] @ kv_up[:, :nope].reshape(-1, latent).t()
            keys = torch.cat(
                (keys.view(-1, heads, nope), context[:, None, latent:].expand(-1, heads, -1)), -1
            )
            values = (context[:, :latent] @ kv_up[:, nope:].reshape(-1, latent).t()).view(
                -1, heads, value
            )
            rows = slice(int(attn.query_start_loc[b]), int(attn.query_start_loc[b + 1]))
            query = torch.cat((q_nope[rows], q_rope[rows]), -1)
            scores = torch.einsum("qhd,khd->hqk", query, keys) * 0.2
            mask = torch.arange(len(context))[None] <= (cached[b] + torch.arange(new[b]))[:, None]
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            expected = torch.einsum("hqk,khd->qhd", probs, values)
            torch.testing.assert_close(outs[0][rows], expected, rtol=1e-10, atol=1e-10)


def test_decode_in_sequence_chunks_equals_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    import dist_engine.attention.mla_torch as mla_torch

    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(30, 4, 40, generator=gen, dtype=torch.float64)
    kv_up = torch.randn(4, 28, 32, generator=gen, dtype=torch.float64)
    tables = [[3, 7, 1], [9], [12, 4], [20, 21, 22, 23]]
    attn = AttentionMetadata.build(tables, [9, 2, 5, 13], [1] * 4, 4, is_prefill=False)
    q_nope = torch.randn(4, 4, 16, generator=gen, dtype=torch.float64)
    q_rope = torch.randn(4, 4, 8, generator=gen, dtype=torch.float64)
    whole = TorchMLA().attend(q_nope, q_rope, cache, kv_up, attn, 0.3)
    monkeypatch.setattr(mla_torch, "DECODE_CHUNK_BYTES", 1)  # one sequence per call
    chunked = TorchMLA().attend(q_nope, q_rope, cache, kv_up, attn, 0.3)
    # Equal up to the summation order of differently padded products.
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)


def test_latent_cache_size_is_stated_and_measured(checkpoint: Path) -> None:
    """One (kv_lora_rank + qk_rope_head_dim) entry per token per layer, nothing per head; the
    engine states it at start-up next to the expanded per-head equivalent."""
    from dist_engine.engine.config import EngineConfig
    from dist_engine.engine.engine import DPEngine

    config = load_config(checkpoint)
    mla = config.mla
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("lockstep")
    logger.addHandler(handler)
    try:
        engine_config = EngineConfig.from_dict(
            {
                "model": str(checkpoint),
                "dtype": "bfloat16",
                "attention_backend": "native",
                "scheduler": {"max_model_len": 64, "num_blocks": 24, "block_size": 8},
            }
        )
        engine = DPEngine(engine_config)
    finally:
        logger.removeHandler(handler)
    cache = engine.model.kv_cache
    assert isinstance(cache, LatentKVCache)
    per_token = (mla.kv_lora_rank + mla.qk_rope_head_dim) * config.num_layers * 2
    measured = cache.storage.numel() * cache.storage.element_size() // (24 * 8)
    assert measured == per_token
    expanded = config.num_heads * (mla.qk_head_dim + mla.v_head_dim) * config.num_layers * 2
    stated = next(m for m in messages if m.startswith("[rank 0] KV cache:"))
    assert f"{per_token} bytes per token" in stated
    assert f"an expanded per-head K/V cache would take {expanded} bytes per token" in stated
    # native has no MLA kernels: the resolution says the attention runs torch, and why.
    assert str(engine.backends.attention) == "torch (no native mla kernels)"
    assert engine.backends.describe().startswith("attention torch (no native mla kernels)")


def test_backends_resolve_per_attention_kind() -> None:
    gqa = resolve_backends({"attention_backend": "torch"}, torch.float32, None)
    assert str(gqa.attention) == "torch" and gqa.attention_kind == "gqa"
    mla = Backends.all("native", attention_kind="mla")
    assert str(mla.attention) == "torch (no native mla kernels)"
    assert str(mla.experts) == "native"


def test_latent_spec_counts() -> None:
    spec = LatentKVSpec(61, 512, 64, 128, 192, 128)  # DeepSeek-V3
    assert spec.bytes_per_token(torch.bfloat16) == 576 * 61 * 2
    assert spec.expanded_bytes_per_token(torch.bfloat16) == 128 * 320 * 61 * 2
    assert "(71.1x)" in spec.describe(torch.bfloat16)
    with pytest.raises(ValueError, match="num_blocks must exceed"):
        spec.allocate(1, 16, torch.float32)


# -- config.json ------------------------------------------------------------------------------
FP8 = {  # deepseek-ai/DeepSeek-V3's quantization_config
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def test_deepseek_hub_configs_parse() -> None:
    from dist_engine.models.mla_moe import softmax_scale

    v3 = parse_config(DEEPSEEK_V3_HUB)
    assert v3.mla is not None and (v3.mla.q_lora_rank, v3.mla.kv_lora_rank) == (1536, 512)
    assert v3.moe_layer_indices == list(range(3, 61)) and v3.num_extra_layers == 1
    assert v3.shared_expert_intermediate_size == 2048 and v3.rope_interleave
    assert (v3.routing.scoring, v3.routing.num_groups, v3.routing.topk_groups) == ("sigmoid", 8, 4)
    assert v3.routing.correction_bias and v3.routing.routed_scaling_factor == 2.5
    assert v3.rope_scaling is not None and v3.rope_scaling.factor == 40
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert softmax_scale(v3) == pytest.approx(192**-0.5 * mscale**2)
    v2 = parse_config(DEEPSEEK_V2_LITE_HUB)
    assert v2.mla is not None and v2.mla.q_lora_rank is None and v2.num_extra_layers == 0
    assert (v2.routing.scoring, v2.routing.num_groups) == ("softmax", 1)
    assert v2.moe_layer_indices == list(range(1, 27)) and v2.shared_expert_intermediate_size == 2816
    assert v2.rope_scaling is not None and v2.rope_scaling.cos_sin_scale() == pytest.approx(1.0)
    assert v3.quantization is None
    fp8 = parse_config({**DEEPSEEK_V3_HUB, "quantization_config": FP8})
    assert fp8.quantization == BlockFP8Format() and fp8 == replace(
        v3, quantization=fp8.quantization
    )


def _v3_config(tmp_path: Path, **options) -> dict:
    out = make_tiny_checkpoint(
        "deepseek_v3", tmp_path / "cfg", num_layers=2, write_tokenizer=False, **options
    )
    return json.loads((out / "config.json").read_text())


def test_both_rope_spellings_parse_alike(tmp_path: Path) -> None:
    hf = _v3_config(tmp_path, yarn=YARN)
    v5 = parse_config(hf)
    legacy = {k: v for k, v in hf.items() if k != "rope_parameters"}
    params = dict(hf["rope_parameters"])
    legacy["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    legacy["rope_scaling"] = params
    v4 = parse_config(legacy)
    assert v4 == v5 and v5.rope_scaling is not None and v5.rope_scaling.factor == 4.0
    assert v5.rope_scaling.mscale_all_dim == 0.8 and v5.rope_theta == 10000.0


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda hf: hf.pop("kv_lora_rank"), "missing the key 'kv_lora_rank'"),
        (
            lambda hf: hf["rope_parameters"].update(rope_type="dynamic"),
            r"'rope_parameters.rope_type' is 'dynamic'; supported: 'default', 'yarn'",
        ),
        (
            lambda hf: hf.update(rope_scaling={"type": "longrope", "factor": 2.0}),
            r"'rope_scaling.type' is 'longrope'",
        ),
        (
            lambda hf: hf["rope_parameters"].update(rope_type="yarn"),
            r"'rope_parameters.factor' must be a number >= 1, got None",
        ),
        (lambda hf: hf.update(qk_rope_head_dim=7), "'qk_rope_head_dim' must be even"),
        (lambda hf: hf.update(topk_method="greedy"), "'topk_method' must be 'noaux_tc'"),
        (lambda hf: hf.update(n_group=3), "'n_group' and 'topk_group' do not fit the experts"),
    ],
)
def test_bad_v3_configs_name_the_key(tmp_path: Path, edit, message: str) -> None:
    hf = _v3_config(tmp_path)
    edit(hf)
    with pytest.raises(ValueError, match=message):
        parse_config(hf)


def test_bad_v2_configs_name_the_key(tmp_path: Path) -> None:
    out = make_tiny_checkpoint("deepseek_v2", tmp_path, num_layers=2, write_tokenizer=False)
    hf = json.loads((out / "config.json").read_text())
    with pytest.raises(ValueError, match="'topk_method' must be one of"):
        parse_config({**hf, "topk_method": "noaux_tc"})
    with pytest.raises(ValueError, match="'norm_topk_prob' must be false"):
        parse_config({**hf, "norm_topk_prob": True})
    with pytest.raises(ValueError, match="'n_group' must be an integer"):
        parse_config({**hf, "n_group": None})


# -- checkpoints ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("v3")
    return make_tiny_checkpoint("deepseek_v3", out, seed=5, num_layers=2, **TINY_SIZES)


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_named(tmp_path: Path, v3_dir: Path) -> None:
    name = "model.layers.1.self_attn.q_a_layernorm.weight"
    model_dir = _edited_copy(v3_dir, tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing tensor '{name}'"):
        load_model(model_dir)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    model_dir = _edited_copy(v3_dir, tmp_path / "ckpt2", lambda t: t.pop(bias))
    with pytest.raises(ValueError, match=f"missing tensor '{bias}'"):
        load_model(model_dir)


def test_multi_token_prediction_layers_are_skipped(tmp_path: Path, v3_dir: Path) -> None:
    """Hub V3 checkpoints carry the MTP module as the layer after the last."""
    extra = "model.layers.2.eh_proj.weight"
    model_dir = _edited_copy(
        v3_dir, tmp_path / "ckpt", lambda t: t.update({extra: torch.zeros(4, 4)})
    )
    torch.testing.assert_close(
        _prompt_logits(load_model(model_dir), [1, 2, 3]),
        _prompt_logits(load_model(v3_dir), [1, 2, 3]),
    )


@pytest.mark.parametrize("layout", ["save_pretrained", "fused"])
def test_transformers_checkpoints_load(tmp_path: Path, layout: str) -> None:
    """What transformers writes (per-expert names) and its in-memory fused names both load,
    with a correction bias set after init (random init leaves it at zero)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        reference.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    if layout == "save_pretrained":
        reference.save_pretrained(tmp_path)
        names = load_file(str(tmp_path / "model.safetensors")).keys()
        assert not any("gate_up_proj" in n for n in names)
    else:
        config.save_pretrained(tmp_path)
        state = {k: v.contiguous() for k, v in reference.state_dict().items()}
        assert any("gate_up_proj" in n for n in state)
        save_file(state, str(tmp_path / "model.safetensors"))
    prompt = random_prompts(1, 256, 19, 19, seed=4)[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(
        _prompt_logits(load_model(tmp_path), prompt), expected, atol=2e-5, rtol=0
    )


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_make_model_cli_writes_a_loadable_checkpoint(tmp_path: Path, arch: str) -> None:
    from dist_engine.models.make_model import main

    out = tmp_path / arch
    assert main(["--arch", arch, "--out", str(out), "--num-layers", "2", "--num-experts", "4"]) == 0
    config = load_config(out)
    assert config.model_type == arch and config.attention_kind == "mla"
    assert config.moe_layer_indices == [1]  # first_k_dense_replace = 1
    assert config.shared_expert_intermediate_size > 0
    load_model(out)


def test_placeholder_forward_with_zero_tokens(v3_dir: Path) -> None:
    """A rank with nothing to run still enters every MoE layer (an EP collective)."""
    model = load_model(v3_dir)
    model.attach_kv_cache(model.new_kv_cache(4, 4))
    for mode in DispatchMode:
        attn = AttentionMetadata.build([], [], [], 4, is_prefill=mode is DispatchMode.NORMAL)
        empty = torch.empty(0, dtype=torch.int64)
        assert model(empty, empty, attn, mode).shape == (0, TINY_SIZES["hidden_size"])
