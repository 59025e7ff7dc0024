"""Bad input and unfriendly set-ups get a clear error or a terminal result with a reason, before
any rank starts where possible; each test is named after what it checks.

All in-process, local launcher or none: the multi-process faults are in test_faults.py.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_harness import run_cli
from model_fixtures import TINY_SIZES

from dist_engine.kernels import build
from dist_engine.models.make_model import make_tiny_checkpoint
from launcher import LLM, SamplingParams

LOCAL = dict(launcher="local", dp_size=1, max_model_len=128, num_blocks=128, block_size=4)


@pytest.fixture(scope="module")
def local_yaml(model_dir, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("bad_input") / "local.yaml"
    path.write_text(
        f"model: {model_dir}\n"
        "parallel: {dp_size: 1, launcher: local}\n"
        "scheduler: {max_num_seqs: 8, max_model_len: 128, num_blocks: 128, block_size: 4}\n"
    )
    return str(path)


# -- 1: one request never takes the group down --------------------------------------------------
def test_seeds_outside_uint64_are_refused_at_the_door(capsys, tmp_path, local_yaml):
    for seed in (2**64, -1):
        with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64 - 1\]"):
            SamplingParams(seed=seed)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    with pytest.raises(ValueError, match="stop_token_ids must be ints"):
        SamplingParams(stop_token_ids=[2**70])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt_token_ids": [1, 2]}\n{"prompt_token_ids": [3], "seed": 18446744073709551616}\n'
    )
    code, _, err = run_cli(capsys, "run", "--config", local_yaml, "--prompts", str(prompts))
    assert code == 2 and f"{prompts}:2: seed must be an int" in err


def test_a_request_failing_inside_a_step_ends_alone(model_dir):
    """A fault the door missed (here: a seed forced past validation) ends that request with a
    terminal error; the others in the same steps get exactly the tokens they get without it,
    and the engine keeps serving."""
    prompts = [[5, 9, 13, 17], [2, 4, 6], [7, 7, 7, 7, 7]]
    good = SamplingParams(max_tokens=6, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=7, ignore_eos=True)
    bad = SamplingParams(max_tokens=6, temperature=0.8, ignore_eos=True)
    object.__setattr__(bad, "seed", 2**64)  # what validation would have refused
    with LLM(model=model_dir, **LOCAL) as llm:
        reference = llm.generate(prompts, [good, sampled, good], use_tqdm=False)
        mixed = llm.generate(prompts + [[1, 2, 3]], [good, sampled, good, bad], use_tqdm=False)
        after = llm.generate(prompts, [good, sampled, good], use_tqdm=False)
    assert mixed[3].finish_reason.startswith("error: sampling settings rejected")
    assert mixed[3].output_token_ids == []
    for ours, expected in zip(mixed[:3], reference, strict=True):
        assert ours.output_token_ids == expected.output_token_ids
        assert ours.finish_reason == "length"
    assert [o.output_token_ids for o in after] == [o.output_token_ids for o in reference]


# -- 5: --output is checked before the job --------------------------------------------------------
def test_output_is_checked_before_any_rank_starts(capsys, tmp_path, local_yaml, monkeypatch):
    import launcher.llm

    def no_start(*args, **kwargs):
        raise AssertionError("the job started")

    monkeypatch.setattr(launcher.llm.LLM, "__init__", no_start)
    for target, message in [
        (tmp_path / "missing" / "out.jsonl", "does not exist"),
        (tmp_path, "is a directory"),
    ]:
        code, _, err = run_cli(capsys, "run", "--config", local_yaml, "--output", str(target))
        assert code == 2 and f"--output {target}" in err and message in err
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        code, _, err = run_cli(capsys, "run", "--config", local_yaml, "--output", str(locked / "x"))
        assert code == 2 and "not writable" in err


# -- 8: a Ray (or local) config under torchrun ----------------------------------------------------
def test_a_ray_config_under_torchrun_is_refused(capsys, monkeypatch, model_dir, tmp_path):
    config = tmp_path / "ray.yaml"
    config.write_text(f"model: {model_dir}\nparallel: {{dp_size: 2, launcher: ray}}\n")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    code, _, err = run_cli(capsys, "run", "--config", str(config))
    assert code == 2 and "torchrun started this process" in err and "'ray'" in err
    with pytest.raises(ValueError, match="started by torchrun"):
        LLM(model=model_dir, **LOCAL)


# -- 9: model and checkpoint errors, in the driver, one line --------------------------------------
def _broken_models(root: Path, model_dir: str) -> dict[str, tuple[Path, str]]:
    source = Path(model_dir)
    cases = {}
    cases["missing directory"] = (root / "nowhere", "does not exist")
    no_config = root / "no_config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    cases["no config.json"] = (no_config, "no config.json")
    truncated = root / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text((source / "config.json").read_text())
    data = (source / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated"] = (truncated, "not a readable safetensors file")
    other = root / "other_type"
    other.mkdir()
    hf = json.loads((source / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**hf, "model_type": "llama"}))
    (other / "model.safetensors").write_bytes(data)
    cases["unsupported model_type"] = (other, "unsupported model_type 'llama'")
    return cases


def test_bad_models_fail_in_the_driver_before_any_rank(capsys, tmp_path, model_dir, monkeypatch):
    import ray

    from launcher import ray_launcher

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray_launcher, "connect_ray", no_ray)
    for name, (path, message) in _broken_models(tmp_path, model_dir).items():
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            LLM(model=str(path), dp_size=2, launcher="ray")
        code, _, err = run_cli(capsys, "run", "--set", f"model={path}")
        assert code == 2, name
        lines = err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (name, err)
    assert not ray.is_initialized()


# -- 10: max_model_len comes from the model --------------------------------------------------------
def test_max_model_len_defaults_to_the_model(tmp_path):
    model = make_tiny_checkpoint(
        "qwen3_moe", tmp_path / "short", seed=5, max_position_embeddings=96, **TINY_SIZES
    )
    settings = dict(launcher="local", dp_size=1, num_blocks=64, block_size=4)
    prompt = [(3 * i) % 300 + 1 for i in range(90)]
    with LLM(model=str(model), **settings) as llm:  # no max_model_len: the model's 96
        [out] = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
        assert llm.client.host.engine.scheduler.config.max_model_len == 96
    assert out.finish_reason == "length" and len(out.output_token_ids) == 4
    with pytest.raises(ValueError, match=r"max_model_len \(200\) exceeds the model's max_pos"):
        LLM(model=str(model), max_model_len=200, **settings)
    # A pool smaller than the model's positions caps the default: 8 blocks of 4 = 28 usable.
    with LLM(model=str(model), **{**settings, "num_blocks": 8}) as llm:
        assert llm.client.host.engine.scheduler.config.max_model_len == 28


# -- 11: tiny temperatures are greedy -----------------------------------------------------------
def test_a_tiny_temperature_samples_greedily(model_dir):
    assert SamplingParams(temperature=1e-40).greedy
    prompts = [[5, 9, 13, 17], [2, 4, 6]]
    with LLM(model=model_dir, **LOCAL) as llm:
        greedy = llm.generate(prompts, SamplingParams(max_tokens=6), use_tqdm=False)
        tiny = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=1e-40, seed=1))
    assert [o.output_token_ids for o in tiny] == [o.output_token_ids for o in greedy]
    assert all(len(o.output_token_ids) > 1 for o in tiny)


# -- 12: refused prompts give a non-zero exit, with the limit named -------------------------------
def test_refused_prompts_name_the_limit_and_fail_the_job(capsys, tmp_path, model_dir, caplog):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt_token_ids": [1, 2, 3]}\n{"prompt_token_ids": '
        + json.dumps(list(range(1, 140)))
        + "}\n"
    )
    config = tmp_path / "c.yaml"
    config.write_text(
        f"model: {model_dir}\nparallel: {{dp_size: 1, launcher: local}}\n"
        "scheduler: {max_num_seqs: 8, max_model_len: 128, num_blocks: 128, block_size: 4}\n"
    )
    code, out, _ = run_cli(capsys, "run", "--config", str(config), "--prompts", str(prompts))
    assert code == 1
    assert "prompt_length_exceeded (prompt of 139 tokens exceeds max_model_len 128)" in out
    # A pool too small for the request: the message names the pool, and start-up warned.
    tiny_pool = tmp_path / "pool.yaml"
    tiny_pool.write_text(
        f"model: {model_dir}\nparallel: {{dp_size: 1, launcher: local}}\n"
        "scheduler: {max_num_seqs: 8, max_model_len: 64, num_blocks: 3, block_size: 4}\n"
    )
    caplog.set_level(logging.WARNING, logger="lockstep")
    logging.getLogger("lockstep").propagate = True  # let caplog see the engine's warning
    try:
        small = tmp_path / "small.jsonl"
        small.write_text('{"prompt_token_ids": ' + json.dumps(list(range(1, 20))) + "}\n")
        code, out, _ = run_cli(capsys, "run", "--config", str(tiny_pool), "--prompts", str(small))
    finally:
        logging.getLogger("lockstep").propagate = False
    assert code == 1
    assert "needs 5 KV blocks of 4 tokens; the pool has 2" in out
    assert "exceeds what the KV pool holds (2 blocks of 4 = 8 tokens)" in caplog.text


# -- 14: the first build says so, and the cache key follows the torch build -----------------------
def test_a_first_build_is_announced_and_keyed_by_the_torch_build(tmp_path, monkeypatch, caplog):
    from dist_engine.kernels.build import CSRC, binary_name, shared_library

    monkeypatch.setattr(build, "cache_root", lambda: tmp_path)
    caplog.set_level(logging.INFO, logger="lockstep")
    logging.getLogger("lockstep").propagate = True
    try:
        library, problem = shared_library("probe", CSRC / "shm_exchange.cpp", ("-O0",))
        assert library is not None, problem
        assert "building probe library (first start on this machine only)" in caplog.text
        caplog.clear()
        shared_library("probe", CSRC / "shm_exchange.cpp", ("-O0",))  # cached: no message
        assert "building" not in caplog.text
    finally:
        logging.getLogger("lockstep").propagate = False
    name = binary_name("probe", [CSRC / "shm_exchange.cpp"], ())
    monkeypatch.setattr(torch, "__file__", "/another/venv/site-packages/torch/__init__.py")
    assert binary_name("probe", [CSRC / "shm_exchange.cpp"], ()) != name


# -- 15: --help is fast and documents the files ---------------------------------------------------
def test_help_imports_no_torch_and_documents_the_prompts_file():
    code = (
        "import sys; from launcher.cli import main\n"
        "try:\n    main(['run', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert '"prompt_token_ids": [1, 2, 3]' in done.stdout
    assert "(default: 32)" in done.stdout and '"seed": int in [0, 2**64 - 1]' in done.stdout
