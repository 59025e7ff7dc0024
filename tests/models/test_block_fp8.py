"""Block-FP8 checkpoints (DeepSeek-V3's and Qwen3's release format): the block math, tiny
releases written in that format, parity with transformers run on the dequantized weights, what
a rank reads, and every bad-checkpoint error the driver reports before a rank starts."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from model_fixtures import (
    FP8_SIZES,
    PagedGreedyRunner,
    blockwise_dequantize,
    hf_greedy,
    hf_model,
    random_prompts,
    write_dequantized_reference,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dist_engine.distributed.spawn import run_multirank
from dist_engine.layers.moe import ExpertParallelContext
from dist_engine.models import block_fp8, loader
from dist_engine.models.block_fp8 import BlockFP8Format
from dist_engine.models.loader import (
    CheckpointReader,
    build_model,
    check_checkpoint,
    load_model,
    load_weights,
    planned_reads,
    read_experts,
)
from dist_engine.models.make_model import make_tiny_checkpoint
from dist_engine.models.registry import load_config
from moe import ExpertPlacement

NUM_PROMPTS = 6
NUM_NEW_TOKENS = 12
ARCHS = sorted(FP8_SIZES)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread; a loaded machine's spinning OpenMP
    workers only slow them down."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _release(arch: str, out: Path, **options) -> Path:
    """A tiny block-FP8 release of `arch`: unquantized tensors in bfloat16, as published."""
    sizes = {**FP8_SIZES[arch], **options}
    return make_tiny_checkpoint(arch, out, seed=11, dtype="bfloat16", fp8=True, **sizes)


@pytest.fixture(scope="module", params=ARCHS)
def release(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _release(request.param, tmp_path_factory.mktemp(f"{request.param}-fp8"))


@pytest.fixture(scope="module")
def v3_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _release("deepseek_v3", tmp_path_factory.mktemp("v3-fp8"))


# -- the block math ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(256, 128), (200, 300), (80, 136), (5, 7)])
def test_quantize_is_per_block_absmax_and_dequantize_inverts_it(shape: tuple[int, int]) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.3
    weight[:3, :3] *= 40  # one block with a far larger range than the others
    quantized, scale_inv = block_fp8.quantize(weight)
    rows, cols = -(-shape[0] // 128), -(-shape[1] // 128)
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (rows, cols)
    for i in range(rows):
        for j in range(cols):
            block = weight[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
            assert scale_inv[i, j] == block.abs().max() / 448
            # the block's largest value lands on the format's largest, 448
            stored = quantized[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)].float()
            assert stored.abs().max() == 448
    restored = block_fp8.dequantize(quantized, scale_inv, (128, 128), torch.float32)
    assert torch.equal(restored, blockwise_dequantize(quantized, scale_inv))
    # e4m3 keeps 3 mantissa bits (relative step 2^-3, so rounding is within 2^-4) down to
    # 2^-6, below which its subnormal step is 2^-9, in units of each block's scale
    steps = scale_inv.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    bound = weight.abs() * (2**-4 + 1e-6) + steps * (2**-10 + 1e-6)
    assert ((restored - weight).abs() <= bound).all()


def test_dequantize_writes_the_run_dtype_and_keeps_zero_blocks_zero() -> None:
    weight = torch.zeros(130, 260)
    weight[129, 259] = 3.0
    quantized, scale_inv = block_fp8.quantize(weight)
    assert scale_inv[0].eq(0).all() and scale_inv[1, 2] == 3.0 / 448
    restored = block_fp8.dequantize(quantized, scale_inv, (128, 128), torch.bfloat16)
    assert restored.dtype == torch.bfloat16 and torch.equal(restored.float(), weight)


# -- the tiny releases ------------------------------------------------------------------------
def test_tiny_release_has_the_hub_release_layout(release: Path) -> None:
    """Linear weights float8_e4m3fn with float32 scales of ceil(shape / 128); embeddings, norms,
    routers and lm_head bfloat16; DeepSeek's selection bias float32; the hub's config keys."""
    config = json.loads((release / "config.json").read_text())
    quantization = config["quantization_config"]
    assert {k: v for k, v in quantization.items() if k != "modules_to_not_convert"} == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    if config["model_type"] == "qwen3_moe":
        skipped = quantization["modules_to_not_convert"]
        assert skipped[:4] == ["lm_head", "model.layers.0.input_layernorm"] + [
            "model.layers.0.mlp.gate",
            "model.layers.0.post_attention_layernorm",
        ]
        assert "model.layers.1.mlp.gate" not in skipped  # layer 1 is dense (mlp_only_layers)
    dtypes, shapes = {}, {}
    with safe_open(str(release / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118
            dtypes[name], shapes[name] = (
                f.get_slice(name).get_dtype(),
                f.get_slice(name).get_shape(),
            )
    partial = full = 0
    for name, dtype in dtypes.items():
        if name.endswith("_scale_inv"):
            weight_shape = shapes[name.removesuffix("_scale_inv")]
            assert dtype == "F32" and shapes[name] == [-(-n // 128) for n in weight_shape]
        elif dtype == "F8_E4M3":
            assert name + "_scale_inv" in dtypes
            partial += any(n % 128 for n in shapes[name])
            full += all(n % 128 == 0 for n in shapes[name])
        elif name.endswith("e_score_correction_bias"):
            assert dtype == "F32"
        else:
            assert dtype == "BF16", name
            assert len(shapes[name]) == 1 or name.endswith(
                ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")
            ), name
    assert partial > 0 and full > 0, (partial, full)
    assert check_checkpoint(release).quantization is not None


# -- against transformers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference_dir(release: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dequantized_reference(release, tmp_path_factory.mktemp("dequantized"))


def test_dequantized_weights_equal_the_blockwise_reference(
    release: Path, reference_dir: Path
) -> None:
    """Every parameter loaded from the FP8 release equals the one loaded from the float32
    checkpoint the test dequantized itself; in bfloat16, that value rounded once."""
    ours = dict(load_model(release).named_parameters())
    expected = dict(load_model(reference_dir).named_parameters())
    assert ours.keys() == expected.keys()
    for name, value in ours.items():
        assert torch.equal(value, expected[name]), name
    low = dict(load_model(release, dtype=torch.bfloat16).named_parameters())
    for name, value in low.items():
        if value.dtype == torch.bfloat16:  # routers stay float32
            assert torch.equal(value, expected[name].to(torch.bfloat16)), name


def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(
    release: Path, reference_dir: Path
) -> None:
    ours, reference = load_model(release), hf_model(reference_dir)
    vocab = FP8_SIZES[ours.config.model_type]["vocab_size"]
    prompts = random_prompts(NUM_PROMPTS, vocab, 2, 29, seed=7)
    chunked = [b % 3 == 1 for b in range(NUM_PROMPTS)]
    outputs = PagedGreedyRunner(ours, block_size=4).generate(prompts, NUM_NEW_TOKENS, chunked)
    for b, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        assert output == hf_greedy(reference, prompt, NUM_NEW_TOKENS), f"prompt {b}"


@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float16"])
def test_half_precision_scales_load(tmp_path: Path, scale_dtype: str) -> None:
    """Qwen3's dense FP8 releases store the scales in bfloat16 (one in float16)."""
    release = _release("qwen3_moe", tmp_path / "fp8", scale_dtype=scale_dtype)
    with safe_open(str(release / "model.safetensors"), "pt") as f:
        scale = f.get_tensor("model.layers.0.self_attn.k_proj.weight_scale_inv")
    assert scale.dtype == getattr(torch, scale_dtype)
    reference = write_dequantized_reference(release, tmp_path / "ref")
    ours, expected = load_model(release), load_model(reference)
    for (name, value), other in zip(ours.named_parameters(), expected.parameters(), strict=True):
        assert torch.equal(value, other), name


def test_eplb_reads_the_experts_it_is_asked_for_dequantized(
    release: Path, reference_dir: Path
) -> None:
    """What EPLB stages while serving: the named experts of one layer, dequantized as at
    load, nothing else read."""
    config = load_config(release)
    layer = config.moe_layer_indices[-1]
    with CheckpointReader(release) as reader, CheckpointReader(reference_dir) as expected:
        ours = list(read_experts(reader, config, layer, [5, 2], torch.float32))
        theirs = list(read_experts(expected, config, layer, [5, 2], torch.float32))
        read = list(reader.tensors_read)
    assert [expert for expert, *_ in ours] == [5, 2]
    for (_, *weights), (_, *reference) in zip(ours, theirs, strict=True):
        for weight, want in zip(weights, reference, strict=True):
            assert weight.dtype == torch.float32 and torch.equal(weight, want)
    prefix = f"model.layers.{layer}.mlp.experts."
    assert read == [
        f"{prefix}{e}.{proj}.weight{suffix}"
        for e in (5, 2)
        for proj in ("gate_proj", "up_proj", "down_proj")
        for suffix in ("", "_scale_inv")
    ]


# -- what a rank reads ------------------------------------------------------------------------
def _read_by_rank(rank: int, world_size: int, model_dir: str) -> list[str]:
    """Load this rank's share of the model in a real 2-rank group; what the reader read."""
    config = load_config(model_dir)
    placement = ExpertPlacement.even(config.num_experts, world_size)
    context = ExpertParallelContext(placement=placement, rank=rank, group=dist.group.WORLD)
    model = build_model(config, ep_context=context)
    with CheckpointReader(model_dir) as reader:
        planned = planned_reads(config, reader, context)  # what the progress line counts
        load_weights(model, reader, context)
        assert reader.tensors_read == planned
        return list(reader.tensors_read)


@pytest.mark.multirank
def test_a_rank_reads_only_its_experts_and_their_scales(v3_release: Path) -> None:
    config = load_config(v3_release)
    placement = ExpertPlacement.even(config.num_experts, 2)
    results = run_multirank(2, _read_by_rank, (str(v3_release),), timeout_s=90)
    for rank, tensors_read in enumerate(results):
        assert len(tensors_read) == len(set(tensors_read))
        hosted = set(placement.hosted_logical(rank))
        assert len(hosted) == config.num_experts // 2
        for layer in config.moe_layer_indices:
            prefix = f"model.layers.{layer}.mlp.experts."
            read = {n.removeprefix(prefix) for n in tensors_read if n.startswith(prefix)}
            assert read == {
                f"{e}.{proj}.weight{suffix}"
                for e in hosted
                for proj in ("gate_proj", "up_proj", "down_proj")
                for suffix in ("", "_scale_inv")
            }
        # every dense weight with its scales; the unquantized tensors alone
        assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in tensors_read
        assert "model.layers.1.mlp.shared_experts.down_proj.weight_scale_inv" in tensors_read
        assert "model.embed_tokens.weight" in tensors_read
        assert not any(n.startswith("model.embed_tokens.weight_") for n in tensors_read)


def test_unmapping_files_between_reads_changes_nothing(
    v3_release: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader closes its files every MAX_MAPPED_BYTES of tensors; at 1 byte that is before
    every read, and every tensor is reopened and read alike."""
    expected = dict(load_model(v3_release).named_parameters())
    monkeypatch.setattr(loader, "MAX_MAPPED_BYTES", 1)
    for name, value in load_model(v3_release).named_parameters():
        assert torch.equal(value, expected[name]), name


def test_make_model_cli_writes_an_fp8_release(tmp_path: Path) -> None:
    from dist_engine.models.make_model import main

    out = tmp_path / "v3"
    assert main(["--arch", "deepseek_v3", "--out", str(out), "--num-layers", "2", "--fp8"]) == 0
    assert check_checkpoint(out).quantization == BlockFP8Format()
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    load_model(out)
    with pytest.raises(ValueError, match=r"fp8 checkpoints are written for \['deepseek_v3'"):
        make_tiny_checkpoint("mixtral", tmp_path / "mixtral", fp8=True)


# -- config.json ------------------------------------------------------------------------------
def test_hub_quantization_configs_parse() -> None:
    deepseek = {  # deepseek-ai/DeepSeek-V3's config.json
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    assert block_fp8.parse_quantization_config(deepseek) == BlockFP8Format()
    # DeepSeek-V3.1 adds scale_fmt (power-of-two scales, stored as float32)
    assert block_fp8.parse_quantization_config({**deepseek, "scale_fmt": "ue8m0"}).block_size == (
        128,
        128,
    )
    qwen = {**deepseek, "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}
    parsed = block_fp8.parse_quantization_config(qwen)
    assert parsed.left_unquantized("model.layers.0.mlp.gate.weight")
    assert not parsed.left_unquantized("model.layers.0.mlp.gate_proj.weight")
    assert not parsed.left_unquantized("model.layers.10.mlp.gate.weight")


# -- bad checkpoints: one line each, from check_checkpoint (the driver, before any rank) ------
def _edited(src: Path, dst: Path, tensors=None, config=None) -> Path:
    shutil.copytree(src, dst)
    if tensors is not None:
        values = load_file(str(dst / "model.safetensors"))
        tensors(values)
        save_file(values, str(dst / "model.safetensors"))
    if config is not None:
        values = json.loads((dst / "config.json").read_text())
        config(values)
        (dst / "config.json").write_text(json.dumps(values))
    return dst


def _one_line_error(model_dir: Path) -> str:
    with pytest.raises(ValueError) as info:
        check_checkpoint(model_dir)
    message = str(info.value)
    assert "\n" not in message, message
    return message


KV_A = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # [80, 128]: scales [1, 1]
Q_B = "model.layers.2.self_attn.q_b_proj.weight"  # [192, 136]: scales [2, 2]
EXPERT = "model.layers.2.mlp.experts.5.down_proj.weight"  # [128, 96]: scales [1, 1]


def _quantization(edit):
    return lambda config: edit(config["quantization_config"])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            _quantization(lambda q: q.update(quant_method="compressed-tensors")),
            r"^config key 'quantization_config.quant_method' is 'compressed-tensors'; "
            r"supported: 'fp8' \(float8_e4m3fn weights with 128x128 weight_scale_inv blocks\)",
        ),
        (
            _quantization(lambda q: q.update(fmt="e5m2")),
            r"^config key 'quantization_config.fmt' is 'e5m2'; supported: 'e4m3'",
        ),
        (
            _quantization(lambda q: q.update(weight_block_size=[64, 64])),
            r"^config key 'quantization_config.weight_block_size' is \[64, 64\]; "
            r"supported: \[128, 128\]$",
        ),
        (
            _quantization(lambda q: q.pop("weight_block_size")),
            r"'quantization_config.weight_block_size' is None; supported: \[128, 128\]$",
        ),
        (
            _quantization(lambda q: q.update(activation_scheme="static")),
            r"^config key 'quantization_config.activation_scheme' is 'static'; "
            r"supported: 'dynamic'$",
        ),
        (
            _quantization(lambda q: q.update(scale_fmt="e8m0x")),
            r"'quantization_config.scale_fmt' is 'e8m0x'; supported: absent or 'ue8m0'$",
        ),
        (
            lambda config: config.update(quantization_config="fp8"),
            r"^config key 'quantization_config' must be an object, got 'fp8'$",
        ),
    ],
)
def test_bad_quantization_config_names_the_key(
    tmp_path: Path, v3_release: Path, edit, message: str
) -> None:
    model_dir = _edited(v3_release, tmp_path / "ckpt", config=edit)
    assert re.search(message, _one_line_error(model_dir))


def test_fp8_for_another_architecture_is_refused(tmp_path: Path) -> None:
    """GLM-4.5's FP8 release is compressed-tensors, not this format; no Mixtral release is."""
    model_dir = make_tiny_checkpoint("glm4_moe", tmp_path, num_layers=2, write_tokenizer=False)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = block_fp8.release_quantization_config()
    (model_dir / "config.json").write_text(json.dumps(config))
    assert _one_line_error(model_dir) == (
        "config key 'quantization_config': block-FP8 checkpoints load for "
        "['deepseek_v3', 'deepseek_v2', 'qwen3_moe'], not 'glm4_moe'; load a bfloat16 conversion"
    )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop(KV_A + "_scale_inv"),
            f"tensor '{KV_A}' is float8_e4m3fn but the checkpoint has no '{KV_A}_scale_inv' "
            "(its block scales, shape [1, 1])",
        ),
        (
            lambda t: t.update({Q_B + "_scale_inv": torch.ones(2, 1)}),
            f"tensor '{Q_B}_scale_inv' has shape [2, 1], expected [2, 2] "
            "(ceil of [192, 136] / [128, 128])",
        ),
        (
            lambda t: t.update({EXPERT + "_scale_inv": torch.ones(1, 1, 1)}),
            f"tensor '{EXPERT}_scale_inv' has shape [1, 1, 1], expected [1, 1] "
            "(ceil of [128, 96] / [128, 128])",
        ),
        (
            lambda t: t.update({EXPERT: t[EXPERT].to(torch.bfloat16)}),
            f"tensor '{EXPERT}' is bfloat16 and has block scales '{EXPERT}_scale_inv'; "
            "block-quantized weights must be float8_e4m3fn",
        ),
        (
            lambda t: t.update({Q_B: t[Q_B].float().to(torch.float8_e5m2)}),
            f"tensor '{Q_B}' is float8_e5m2 and has block scales '{Q_B}_scale_inv'; "
            "block-quantized weights must be float8_e4m3fn",
        ),
        (
            lambda t: t.update({KV_A + "_scale_inv": torch.ones(1, 1, dtype=torch.uint8)}),
            f"tensor '{KV_A}_scale_inv' is uint8; block scales must be one of "
            "['float32', 'bfloat16', 'float16']",
        ),
        (
            lambda t: t.update(
                {
                    "model.norm.weight": t["model.norm.weight"].float().to(torch.float8_e4m3fn),
                    "model.norm.weight_scale_inv": torch.ones(1),
                }
            ),
            "tensor 'model.norm.weight' is float8_e4m3fn with shape [128]; only 2-D weights "
            "[out, in] are block-quantized",
        ),
    ],
)
def test_bad_fp8_tensor_is_named(tmp_path: Path, v3_release: Path, edit, message: str) -> None:
    model_dir = _edited(v3_release, tmp_path / "ckpt", tensors=edit)
    assert _one_line_error(model_dir).startswith(message)
    # a rank loading it anyway stops at the same tensor
    with pytest.raises(ValueError, match="tensor '"):
        load_model(model_dir)


def test_fp8_tensors_without_a_quantization_config_are_named(
    tmp_path: Path, v3_release: Path
) -> None:
    model_dir = _edited(
        v3_release, tmp_path / "ckpt", config=lambda c: c.pop("quantization_config")
    )
    message = _one_line_error(model_dir)
    assert message.endswith(
        "is float8_e4m3fn, but config.json has no 'quantization_config'; a block-FP8 "
        "checkpoint states quant_method 'fp8' there"
    )
    assert message.startswith("tensor 'model.layers.")


def test_fp8_tensor_in_a_module_listed_as_unquantized_is_named(tmp_path: Path) -> None:
    release = _release("qwen3_moe", tmp_path / "fp8")
    name = "model.layers.0.self_attn.o_proj"
    model_dir = _edited(
        release,
        tmp_path / "ckpt",
        config=_quantization(lambda q: q["modules_to_not_convert"].append(name)),
    )
    assert _one_line_error(model_dir) == (
        f"tensor '{name}.weight' is float8_e4m3fn, but "
        "quantization_config.modules_to_not_convert lists its module"
    )
