import pytest
import torch

from dist_engine.engine.config import (
    CODE_PACKAGES,
    EngineConfig,
    MoEConfig,
    code_digest,
    code_identity,
    code_root,
    model_identity,
)
from dist_engine.engine.eplb import check_slots, initial_placement


def test_nested_sections_and_flat_overrides():
    config = EngineConfig.from_dict(
        {"model": "/m", "parallel": {"dp_size": 2}, "scheduler": {"max_num_seqs": 8}}
    )
    assert config.parallel.dp_size == 2 and config.scheduler.max_num_seqs == 8
    assert config.ll_capacity == 8
    changed = config.with_overrides(max_num_seqs=4, dp_size=3, dtype="float64")
    assert (changed.scheduler.max_num_seqs, changed.parallel.dp_size, changed.dtype) == (
        4,
        3,
        "float64",
    )
    assert config.with_overrides(**{"moe.ll_max_tokens_per_rank": 32}).ll_capacity == 32


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"model": "/m", "colour": 1}, "unknown setting(s) ['colour']"),
        ({"model": "/m", "scheduler": {"max_num_seq": 4}}, "['scheduler.max_num_seq']"),
        (
            {"model": "/m", "scheduler": {"block_size": 0}},
            "scheduler.block_size must be an int >= 1, got 0",
        ),
        (
            {"model": "/m", "parallel": {"backend": "mpi"}},
            "parallel.backend must be one of ['auto', 'nccl', 'gloo'], got 'mpi'",
        ),
        ({"model": "/m", "dtype": "int8"}, "dtype must be one of"),
        (
            {"model": "/m", "parallel": {"threads_per_rank": 0}},
            "parallel.threads_per_rank must be an int >= 1, got 0",
        ),
        ({"scheduler": {}}, "model is required"),
        (
            {
                "model": "/m",
                "scheduler": {"max_num_seqs": 64},
                "moe": {"ll_max_tokens_per_rank": 8},
            },
            "moe.ll_max_tokens_per_rank (8) must be >= scheduler.max_num_seqs (64)",
        ),
        (
            {"model": "/m", "scheduler": {"sync_policy": "unified"}},
            "sync_policy must be one of ['vote', 'every_step', 'deadline']",
        ),
        ({"model": "/m", "moe": {"enable_eplb": 1}}, "moe.enable_eplb must be true or false"),
        (
            {"model": "/m", "moe": {"enable_eplb": True, "eplb_window_steps": 0}},
            "moe.eplb_window_steps must be an int >= 1, got 0",
        ),
        (
            {"model": "/m", "moe": {"enable_eplb": True, "eplb_interval_steps": 2.5}},
            "moe.eplb_interval_steps must be an int >= 1, got 2.5",
        ),
        (
            {"model": "/m", "moe": {"enable_eplb": True, "eplb_expert_source": "disk"}},
            "moe.eplb_expert_source must be one of auto, peer, checkpoint, got 'disk'",
        ),
        (
            {"model": "/m", "moe": {"enable_eplb": True, "eplb_num_redundant_experts": -1}},
            "moe.eplb_num_redundant_experts must be an int >= 0, got -1",
        ),
        (
            {"model": "/m", "moe": {"eplb_num_redundant_experts": 4}},
            "moe.eplb_num_redundant_experts is 4, but moe.enable_eplb is false",
        ),
    ],
)
def test_bad_settings_name_the_key(values, message):
    with pytest.raises(ValueError) as info:
        EngineConfig.from_dict(values)
    assert message in str(info.value)


def test_unknown_override_lists_known_settings():
    with pytest.raises(
        ValueError, match=r"unknown setting 'speed'; known settings: .*max_num_seqs"
    ):
        EngineConfig(model="/m").with_overrides(speed=3)


def test_yaml(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: /m\nscheduler:\n  block_size: 8\n")
    assert EngineConfig.from_yaml(path).scheduler.block_size == 8
    path.write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        EngineConfig.from_yaml(path)
    path.write_text("- a list\n")
    with pytest.raises(ValueError, match="top level must be a mapping"):
        EngineConfig.from_yaml(path)


def test_group_agreed_settings_and_model_identity(tmp_path):
    (tmp_path / "config.json").write_text('{"b": 1, "a": 2}')
    identity = model_identity(tmp_path)
    (tmp_path / "config.json").write_text('{"a": 2,\n "b": 1}')
    assert model_identity(tmp_path) == identity  # formatting does not matter
    agreed = EngineConfig(model=str(tmp_path)).group_agreed(identity)
    assert agreed["model"] == identity
    assert agreed["code"] == code_identity()  # ranks on other code refuse to start together
    assert agreed["torch"] == torch.__version__
    assert {
        "scheduler.block_size",
        "scheduler.prefill_attempt_interval",
        "scheduler.sync_policy",
        "scheduler.prefill_deadline_steps",
        "moe.ll_max_tokens_per_rank",
        "moe.enable_eplb",
        "moe.eplb_num_redundant_experts",
        "moe.eplb_window_steps",
        "moe.eplb_interval_steps",
        "moe.eplb_expert_source",
    } <= set(agreed)


def _package(root, files):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_code_digest_reads_code_files_by_their_place_in_the_package(tmp_path):
    files = {"__init__.py": "", "sub/mod.py": "x = 1\n", "csrc/k.cpp": "int f();\n"}
    one = {"pkg": _package(tmp_path / "a" / "pkg", files)}
    other = {"pkg": _package(tmp_path / "b" / "site" / "pkg", files)}
    digest = code_digest(one)
    assert code_digest(other) == digest  # installed elsewhere: the same code
    (one["pkg"] / "sub" / "__pycache__").mkdir()
    (one["pkg"] / "sub" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0" * 9)
    (one["pkg"] / "notes.txt").write_text("not code")
    assert code_digest(one) == digest  # bytecode caches and other files do not count
    (one["pkg"] / "sub" / "mod.py").write_text("x = 1\n# a changed line\n")
    assert code_digest(one) != digest
    (one["pkg"] / "sub" / "mod.py").write_text("x = 1\n")
    (one["pkg"] / "sub" / "mod.py").rename(one["pkg"] / "sub" / "moved.py")
    assert code_digest(one) != digest  # the same bytes in another module
    assert code_digest({"other": one["pkg"]}) != code_digest(one)


def test_code_identity_is_the_digest_of_the_imported_packages():
    roots = {package: code_root(package) for package in CODE_PACKAGES}
    assert roots["launcher"].name == "launcher" and (roots["scheduler"] / "__init__.py").is_file()
    assert code_identity() == code_digest(roots)


def test_eplb_slots_must_split_evenly_over_the_ranks():
    eplb = MoEConfig(enable_eplb=True, eplb_num_redundant_experts=3)
    with pytest.raises(ValueError) as info:
        check_slots(eplb, num_experts=8, num_ranks=2)
    assert str(info.value).startswith(
        "moe.eplb_num_redundant_experts is 3: the model's 8 experts plus the redundant slots "
        "(11) must be a multiple of parallel.dp_size=2"
    )
    assert "allowed: 0, 2, ..." in str(info.value)
    with pytest.raises(ValueError, match=r"8 experts do not split evenly over .*dp_size=3"):
        check_slots(MoEConfig(), num_experts=8, num_ranks=3)
    check_slots(MoEConfig(enable_eplb=True, eplb_num_redundant_experts=1), 8, 3)
    assert initial_placement(eplb, 8, 1).phy2log.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2]
    assert initial_placement(MoEConfig(), 8, 2).phy2log.tolist() == list(range(8))


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("cp_size", 2, "context parallelism is not implemented"),
        ("lookahead_tokens", 4, "no speculative decoding"),
        ("num_state_slots", 8, "no supported architecture keeps per-sequence recurrent state"),
    ],
)
def test_scheduler_settings_the_engine_does_not_serve_are_refused_by_name(key, value, why):
    with pytest.raises(ValueError, match=rf"scheduler.{key} is {value}, .*{why}"):
        EngineConfig.from_dict({"model": "/m", "scheduler": {key: value}})


def test_the_engine_seed_fixes_the_seeds_of_requests_that_give_none(model_dir):
    """Two engines with the same seed sample the same tokens for unseeded requests at
    temperature 1; another seed samples others."""
    from dist_engine.engine.engine import DPEngine
    from scheduler import SamplingParams

    def run(seed: int | None) -> list[list[int]]:
        config = EngineConfig.from_dict(
            {"model": model_dir, "seed": seed, "scheduler": {"max_model_len": 64, "num_blocks": 64}}
        )
        outputs: dict[str, list[int]] = {}
        engine = DPEngine(
            config,
            on_output=lambda o: (
                outputs.__setitem__(o.request_id, o.output_token_ids) if o.finished else None
            ),
        )
        params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
        for index in range(4):
            engine.submit(f"r{index}", [1 + index, 2, 3], params)
        while len(outputs) < 4:
            engine.step()
        return [outputs[f"r{index}"] for index in range(4)]

    first, again, other = run(7), run(7), run(8)
    assert first == again
    assert first != other


# -- dtype: auto --------------------------------------------------------------------------------
def test_auto_dtype_takes_bf16_on_a_cpu_only_with_native_bf16_measured_faster():
    from dist_engine.engine.dtype import checkpoint_dtype, resolve_auto_dtype

    def decide(stored, flags, bf16_s=1.0, fp32_s=2.0, device="cpu"):
        times = {torch.bfloat16: bf16_s, torch.float32: fp32_s}
        return resolve_auto_dtype(
            stored, device, 64, 128, 8, flags=frozenset(flags), time_matmul=times.__getitem__
        )

    assert decide("bfloat16", {"avx2", "fma"}).dtype == "float32"  # emulated bf16
    assert "no native bf16" in decide("bfloat16", {"avx2"}).reason
    assert decide("bfloat16", {"avx512_bf16"}).dtype == "bfloat16"
    assert decide("bfloat16", {"amx_bf16"}, bf16_s=3.0).dtype == "float32"  # not faster
    assert decide("float32", {"avx512_bf16"}).dtype == "float32"  # the checkpoint's own
    assert decide("float32", set(), device="cuda").dtype == "bfloat16"
    assert decide("float16", set(), device="cuda").dtype == "float16"
    assert checkpoint_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert checkpoint_dtype({"dtype": "float16"}) == "float16"
    assert checkpoint_dtype({"quantization_config": {"quant_method": "fp8"}}) == "bfloat16"
    assert checkpoint_dtype({}) == "float32"


def test_auto_is_the_default_and_resolves_on_the_rank(model_dir):
    from dist_engine.engine.engine import DPEngine

    config = EngineConfig.from_dict({"model": model_dir, "scheduler": {"max_model_len": 32}})
    assert config.dtype == "auto"
    with pytest.raises(ValueError, match="resolved by each rank"):
        config.torch_dtype  # noqa: B018
    engine = DPEngine(config)
    # The tiny checkpoint is float32: auto keeps it, whatever the processor.
    assert engine.config.dtype == "float32" and engine.model.dtype == torch.float32
    assert "dtype float32 (the checkpoint's is float32)" in engine.describe_compute()


def test_a_rank_alone_takes_larger_mixed_prompt_chunks_unless_set(model_dir):
    from dist_engine.engine.engine import DPEngine

    alone = DPEngine(
        EngineConfig.from_dict({"model": model_dir, "scheduler": {"max_model_len": 32}})
    )
    assert alone.scheduler.config.mixed_prompt_cap == 1024
    assert alone.config.scheduler.mixed_prompt_tokens is None  # the setting as given
    set_ = DPEngine(
        EngineConfig.from_dict(
            {"model": model_dir, "scheduler": {"max_model_len": 32, "mixed_prompt_tokens": 64}}
        )
    )
    assert set_.scheduler.config.mixed_prompt_cap == 64
