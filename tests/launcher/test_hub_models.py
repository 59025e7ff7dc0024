"""A hub id on the front ends (`LLM`, `lockstep run`, `lockstep serve`): resolved through a
pre-filled Hugging Face cache (there is no network here) before any rank starts, pinned to
its commit, and run like the directory it stands for."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_harness import run_cli

from launcher import LLM
from launcher.cli import build_parser
from launcher.server.serve import load_configs, prepare_model
from scheduler import SamplingParams

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
LOCAL = {"launcher": "local", "dp_size": 1, "threads_per_rank": 1}
PROMPTS = [[5, 9, 13, 17], "Experts route tokens"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def hub_home(model_dir, tmp_path_factory):
    """HF_HOME holding `org/tiny` at COMMIT (its main branch and tag v1), offline."""
    import huggingface_hub.constants as constants

    home = tmp_path_factory.mktemp("hf")
    repo = home / "hub" / "models--org--tiny"
    shutil.copytree(model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    for ref in ("main", "v1"):
        (repo / "refs" / ref).write_text(COMMIT)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HOME", str(home))
        patch.delenv("HF_HUB_CACHE", raising=False)
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
        patch.setattr(constants, "HF_HUB_OFFLINE", True)
        yield repo / "snapshots" / COMMIT


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    with LLM(model_dir, **LOCAL) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.output_token_ids for o in outputs]


def test_llm_with_a_hub_id_runs_the_pinned_snapshot(hub_home, reference):
    with LLM("org/tiny", revision="v1", **LOCAL) as llm:
        assert (llm.config.model, llm.config.revision) == (str(hub_home), COMMIT)
        assert llm.config.hub_id == "org/tiny"
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.output_token_ids for o in outputs] == reference
    assert outputs[1].prompt_token_ids == llm.tokenizer.encode(PROMPTS[1])  # its tokenizer


def test_lockstep_run_with_a_hub_id_gives_the_directorys_tokens(
    hub_home, reference, capsys, tmp_path
):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt_token_ids": PROMPTS[0]}, {"prompt": PROMPTS[1]}]
    prompts.write_text("".join(json.dumps({**line, "temperature": 0}) + "\n" for line in lines))
    output = tmp_path / "out.jsonl"
    code, _, err = run_cli(
        capsys, "run", "org/tiny", "--launcher", "local", "-dp", "1", "--threads-per-rank", "1",
        "--prompts", str(prompts), "--output", str(output), "--max-tokens", str(MAX_TOKENS),
        "--quiet",
    )  # fmt: skip
    assert code == 0, err
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["output_token_ids"] for r in records] == reference


def test_a_missing_repo_or_revision_fails_before_any_rank_starts(hub_home, capsys, monkeypatch):
    from launcher import ray_launcher

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray_launcher, "connect_ray", no_ray)
    cases = {
        ("org/other", None): "hub model 'org/other' is not in the Hugging Face cache",
        ("org/tiny", "v2"): "hub model 'org/tiny' at revision 'v2' is not in the Hugging Face",
    }
    for (model, revision), message in cases.items():
        with pytest.raises(FileNotFoundError, match=message) as raised:
            LLM(model, revision=revision, dp_size=2, launcher="ray")
        assert "HF_HUB_OFFLINE is set" in str(raised.value) and "hf download" in str(raised.value)
        flags = ["--revision", revision] if revision else []
        for command in ("run", "serve"):
            code, _, err = run_cli(capsys, command, model, *flags, "-dp", "2")
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1 and message in lines[0], (command, err)


def test_serve_resolves_a_hub_id_and_names_the_model_after_it(hub_home, model_dir):
    parser, _ = build_parser()
    engine, server = prepare_model(*load_configs(parser.parse_args(["serve", "org/tiny"]), None))
    assert (engine.model, engine.revision, engine.hub_id) == (str(hub_home), COMMIT, "org/tiny")
    assert server.served_model_name == ("org/tiny",)  # vLLM's default: the model as given
    args = parser.parse_args(["serve", "org/tiny", "--served-model-name", "tiny"])
    assert prepare_model(*load_configs(args, None))[1].served_model_name == ("tiny",)
    engine, server = prepare_model(*load_configs(parser.parse_args(["serve", model_dir]), None))
    assert (engine.model, engine.hub_id, server.served_model_name) == (model_dir, None, None)
    assert Path(engine.model).is_dir()
