"""`lockstep run` / `lockstep make-model`: arguments, YAML, prompts files and a real local job.

Everything runs in-process through ``launcher.cli.main`` and never starts Ray: the error cases
fail before any launcher starts, and the real jobs use ``--launcher local --dp-size 1``. The
flags themselves (one per config key, vLLM's names) are tested in test_flags.py.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from cli_harness import run_cli

from dist_engine.engine.config import EngineConfig
from launcher import LLM, SamplingParams
from launcher import cli as cli_module
from launcher.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECORD_FIELDS = [
    "index",
    "prompt_token_ids",
    "output_token_ids",
    "text",
    "finish_reason",
    "detail",
    "dp_rank",
]


@pytest.fixture(scope="module")
def config_path(model_dir, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cli_config") / "local.yaml"
    path.write_text(
        f"model: {model_dir}\n"
        "dtype: float64\n"
        "parallel: {dp_size: 1, launcher: local, backend: gloo}\n"
        "scheduler: {max_num_seqs: 8, max_model_len: 128, num_blocks: 128, block_size: 4}\n"
    )
    return str(path)


def run_args(*argv: str):
    """`lockstep run ARGV` parsed, as `main` parses it."""
    parser, _ = cli_module.build_parser()
    return parser.parse_args(["run", *argv])


def write_jsonl(path: Path, lines: list[object]) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


# -- presets ------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_preset_loads(preset, model_dir):
    config = EngineConfig.from_yaml(CONFIGS / preset)
    assert config.model  # a placeholder path; the presets say to override it
    config = config.with_overrides(model=model_dir)
    assert config.model == model_dir
    assert config.parallel.launcher in ("ray", "torchrun")
    assert config.parallel.dp_size >= 2


def test_presets_say_what_their_comments_say():
    torchrun = EngineConfig.from_yaml(CONFIGS / "torchrun.yaml")
    assert torchrun.parallel.launcher == "torchrun"
    two_node = EngineConfig.from_yaml(CONFIGS / "two_node.yaml")
    assert (two_node.parallel.dp_size, two_node.parallel.placement_strategy) == (2, "STRICT_SPREAD")
    assert EngineConfig.from_yaml(CONFIGS / "ray_cluster.yaml").parallel.launcher == "ray"


def test_builtin_yaml_is_the_job_run_without_a_config(monkeypatch, model_dir):
    # `lockstep run` with no --config builds its job in code; configs/builtin.yaml claims to be
    # the same job written out. Avoid building the (larger) cached built-in model.
    import launcher.builtin

    monkeypatch.setattr(launcher.builtin, "builtin_model", lambda: Path(model_dir))
    in_code = cli_module.job_config(run_args())
    in_yaml = EngineConfig.from_yaml(CONFIGS / "builtin.yaml").with_overrides(model=model_dir)
    assert in_yaml == in_code


def test_set_overrides_are_parsed_as_yaml_values(config_path):
    args = run_args(
        "--config", config_path, "--launcher", "ray", "--dp-size", "4",
        "--set", "max_num_seqs=4", "--set", "scheduler.enable_prefix_caching=true",
        "--set", "dtype=float32",
    )  # fmt: skip
    config = cli_module.job_config(args)
    assert (config.parallel.launcher, config.parallel.dp_size) == ("ray", 4)
    assert config.scheduler.max_num_seqs == 4
    assert config.scheduler.enable_prefix_caching is True
    assert config.dtype == "float32"
    assert config.scheduler.block_size == 4  # untouched settings keep the file's values


# -- bad input: exit code 2 and a message naming the problem ------------------------------------
def test_bad_yaml_fails_with_the_file_name(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    code, _, err = run_cli(capsys, "run", "--config", str(bad))
    assert code == 2
    assert f"{bad}: not valid YAML" in err
    listed = tmp_path / "list.yaml"
    listed.write_text("- model\n")
    code, _, err = run_cli(capsys, "run", "--config", str(listed))
    assert code == 2 and "top level must be a mapping" in err


def test_a_missing_config_file_is_a_clean_error(capsys, tmp_path):
    code, _, err = run_cli(capsys, "run", "--config", str(tmp_path / "nope.yaml"))
    assert code == 2
    assert "nope.yaml: no such file" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--set", "scheduler.block_size=0"], "scheduler.block_size must be an int >= 1, got 0"),
        (["--set", "scheduler.bogus=1"], "unknown setting 'scheduler.bogus'"),
        (["--set", "no_such_key=1"], "unknown setting 'no_such_key'"),
        (["--set", "dtype"], "--set takes KEY=VALUE, got 'dtype'"),
        (["--set", "parallel.launcher=mpi"], "parallel.launcher must be one of"),
        (["--set", "dtype=int8"], "dtype must be one of"),
        (["--set", "placement_strategy=ANYWHERE"], "parallel.placement_strategy must be one of"),
        (["--dp-size", "0"], "parallel.dp_size must be an int >= 1, got 0"),
        (["--dp-size", "-1"], "parallel.dp_size must be an int >= 1, got -1"),
        (["--max-tokens", "0"], "--max-tokens: max_tokens must be >= 1, got 0"),
    ],
)
def test_bad_values_exit_2_naming_the_key(capsys, config_path, argv, named):
    code, out, err = run_cli(capsys, "run", "--config", config_path, *argv)
    assert code == 2, err
    assert named in err
    assert err.startswith("lockstep: error:")
    assert out == ""  # failed before starting anything


def test_unknown_keys_in_the_yaml_are_named(capsys, tmp_path, model_dir):
    path = tmp_path / "typo.yaml"
    path.write_text(f"model: {model_dir}\nscheduler: {{blok_size: 4}}\n")
    code, _, err = run_cli(capsys, "run", "--config", str(path))
    assert code == 2 and "unknown setting(s) ['scheduler.blok_size']" in err
    path.write_text(f"model: {model_dir}\nparallel: {{dp_size: 2, launcher: slurm}}\n")
    code, _, err = run_cli(capsys, "run", "--config", str(path))
    assert code == 2 and "parallel.launcher must be one of" in err and "'slurm'" in err


def test_bad_command_line_arguments_exit_2(capsys, config_path):
    code, _, err = run_cli(capsys, "run", "--config", config_path, "--launcher", "mpi")
    assert code == 2 and "argument --launcher: invalid choice: 'mpi'" in err
    code, _, err = run_cli(capsys, "run", "--config", config_path, "--bogus")
    assert code == 2 and "unrecognized arguments: --bogus" in err
    code, _, err = run_cli(capsys, "run", "--config", config_path, "--dp-size", "two")
    assert code == 2 and "--dp-size" in err
    code, _, err = run_cli(capsys, "make-model", "--arch", "gpt2", "--out", "x")
    assert code == 2 and "invalid choice: 'gpt2'" in err
    code, _, err = run_cli(capsys)
    assert code == 2


@pytest.mark.parametrize(
    ("lines", "bad_line", "named"),
    [
        ([{"prompt_token_ids": [1, 2]}, "{nope"], 2, "not JSON"),
        ([{"prompt_token_ids": [1, 2]}, "", "[1, 2]"], 3, "need exactly one of"),
        ([{"prompt": "a", "prompt_token_ids": [1]}], 1, "need exactly one of"),
        (
            [{"prompt_token_ids": [3]}, {"prompt_token_ids": [1], "temperature": -1}],
            2,
            "temperature",
        ),
        ([{"prompt_token_ids": [1], "max_tokens": "many"}], 1, "max_tokens must be an int"),
        ([{"prompt_token_ids": [1]}, {"prompt_token_ids": [1], "dp_rank": 1}], 2, "dp_rank"),
        ([{"prompt_token_ids": [1], "dp_rank": "0"}], 1, "dp_rank"),
        ([{"prompt_token_ids": "1 2 3"}], 1, "'prompt_token_ids' must be a list of ints"),
        ([{"prompt_token_ids": [1, 2.5]}], 1, "'prompt_token_ids' must be a list of ints"),
        ([{"prompt": 42}], 1, "'prompt' must be a string"),
    ],
)
def test_a_bad_prompts_line_is_named_by_file_and_line(
    capsys, tmp_path, config_path, lines, bad_line, named
):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", lines)
    code, out, err = run_cli(capsys, "run", "--config", config_path, "--prompts", prompts)
    assert code == 2, err
    assert f"{prompts}:{bad_line}: " in err
    assert named in err
    assert out == ""


def test_missing_or_empty_prompts_files(capsys, tmp_path, config_path):
    code, _, err = run_cli(
        capsys, "run", "--config", config_path, "--prompts", str(tmp_path / "none.jsonl")
    )
    assert code == 2 and "none.jsonl: no such file" in err
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    code, _, err = run_cli(capsys, "run", "--config", config_path, "--prompts", empty)
    assert code == 2 and f"{empty}: no prompts" in err


def test_torchrun_launcher_outside_torchrun_says_how_to_start_it(config_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"launcher 'torchrun' needs 'RANK'.*torchrun"):
        main(["run", "--config", config_path, "--launcher", "torchrun", "--dp-size", "1"])


# -- real jobs ----------------------------------------------------------------------------------
PROMPT_LINES = [
    {"prompt_token_ids": [5, 9, 13, 17], "max_tokens": 6, "ignore_eos": True},
    {"prompt": "experts route tokens", "max_tokens": 3, "ignore_eos": True},
    {"prompt_token_ids": [100, 200, 300], "ignore_eos": True},  # --max-tokens applies
    {"prompt_token_ids": [7] * 11, "max_tokens": 1, "dp_rank": 0},
    {"prompt_token_ids": [42, 43], "max_tokens": 4, "temperature": 0.8, "seed": 3},
]


def test_a_local_job_writes_one_record_per_prompt_in_order(capsys, tmp_path, config_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPT_LINES[:2] + [""] + PROMPT_LINES[2:])
    output = tmp_path / "out.jsonl"
    code, out, err = run_cli(
        capsys,
        "run",
        "--config",
        config_path,
        "--prompts",
        prompts,
        "--output",
        str(output),
        "--max-tokens",
        "5",
    )
    assert code == 0, err
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == len(PROMPT_LINES)
    assert [list(r) for r in records] == [RECORD_FIELDS] * len(PROMPT_LINES)
    assert [r["index"] for r in records] == list(range(len(PROMPT_LINES)))
    assert all(r["dp_rank"] == 0 for r in records)
    assert [len(r["output_token_ids"]) for r in records[:4]] == [6, 3, 5, 1]
    assert all(r["finish_reason"] in ("length", "stop") for r in records)
    assert all(isinstance(r["text"], str) for r in records)  # the tiny model has a tokenizer
    # The same prompts through the API give the same tokens: the file is in input order. A line
    # without temperature samples at vLLM's default, 1.0 (the tiny model's generation_config.json
    # sets no sampling), and stops at that file's EOS ids [0, 2] unless it ignores EOS; the
    # driver draws the same per-request seeds in the same order in both runs.
    eos = {0, 2}
    with LLM(config=config_path) as llm:
        params = [
            SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True),
            SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True),
            SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True),
            SamplingParams(max_tokens=1, temperature=1.0, stop_token_ids=eos),
            SamplingParams(max_tokens=4, temperature=0.8, seed=3, stop_token_ids=eos),
        ]
        prompts_in = [line.get("prompt", line.get("prompt_token_ids")) for line in PROMPT_LINES]
        expected = llm.generate(prompts_in, params, use_tqdm=False)
    assert [r["prompt_token_ids"] for r in records] == [o.prompt_token_ids for o in expected]
    assert [r["output_token_ids"] for r in records] == [o.output_token_ids for o in expected]
    assert [r["text"] for r in records] == [o.text for o in expected]
    assert records[0]["prompt_token_ids"] == [5, 9, 13, 17]
    # The summary table is printed, and one line per request unless --quiet.
    assert "launcher / DP          local / 1" in out
    assert "MoE exchange           none" in out
    # The backends each op kind got (the fixture's config leaves them at auto; float64 on the
    # CPU: the decode attention kernel serves every float dtype, the rest is PyTorch's).
    assert "backends               attention decode native, prefill torch; experts torch" in out
    assert "[4] rank 0" in out


def test_a_failed_request_is_written_and_the_exit_code_is_1(capsys, tmp_path, config_path):
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl",
        [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [1, 99999]}],
    )
    output = tmp_path / "out.jsonl"
    code, out, _ = run_cli(
        capsys, "run", "--config", config_path, "--prompts", prompts, "--output", str(output)
    )
    assert code == 1
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == 2
    assert records[0]["finish_reason"] in ("length", "stop")
    reason = records[1]["finish_reason"]
    assert reason.startswith("error") and "vocabulary" in reason
    assert records[1]["output_token_ids"] == []
    assert "[1] rank 0 error" in out


def test_a_job_torchrun_restarted_keeps_what_its_output_holds(capsys, tmp_path, model_dir,
                                                                monkeypatch):  # fmt: skip
    """An attempt torchrun restarted (--max-restarts) keeps the results that had finished
    (as written: the kept one below carries tokens no run would make, so it was not run
    again), runs the others (a failed one, one cut short by the crash, one never reached),
    and rewrites the file in input order. One torchrun rank in this process, with the
    environment torchrun gives a restarted worker."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    worker = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              "TORCHELASTIC_RESTART_COUNT": "1"}  # fmt: skip
    config = tmp_path / "torchrun.yaml"
    config.write_text(
        f"model: {model_dir}\ndtype: float64\n"
        "parallel: {dp_size: 1, launcher: torchrun, backend: gloo, cpu_binding: false}\n"
        "scheduler: {max_num_seqs: 8, max_model_len: 128, num_blocks: 128, block_size: 4}\n"
    )
    lines = [{"prompt_token_ids": [3 + i, 9, 27], "max_tokens": 4, "ignore_eos": True,
              "temperature": 0} for i in range(4)]  # fmt: skip
    prompts = write_jsonl(tmp_path / "prompts.jsonl", lines)
    output = tmp_path / "out.jsonl"
    kept = {"index": 2, "prompt_token_ids": [5, 9, 27], "output_token_ids": [7, 7, 7, 7],
            "text": "", "finish_reason": "length", "detail": None, "dp_rank": 0}  # fmt: skip
    failed = {**kept, "index": 0, "prompt_token_ids": [3, 9, 27], "output_token_ids": [],
              "finish_reason": "error: DP group failed: rank 1 stopped answering"}  # fmt: skip
    output.write_text(json.dumps(failed) + "\n" + json.dumps(kept) + "\n" + '{"index": 1, "pro')
    with monkeypatch.context() as env:
        for name, value in worker.items():
            env.setenv(name, value)
        code, _, err = run_cli(capsys, "run", "--config", str(config), "--prompts", prompts,
                               "--output", str(output), "--quiet")  # fmt: skip
    assert code == 0, err
    assert "restarted by torchrun: 1 of 4 results are kept" in err
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    assert records[2] == kept
    with LLM(model=model_dir, launcher="local", dtype="float64", max_model_len=128) as llm:
        expected = llm.generate(
            [lines[i]["prompt_token_ids"] for i in (0, 1, 3)],
            SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False,
        )  # fmt: skip
    assert [records[i]["output_token_ids"] for i in (0, 1, 3)] == [
        o.output_token_ids for o in expected
    ]
    assert all(records[i]["finish_reason"] == "length" for i in (0, 1, 3))


def test_results_of_other_prompts_are_not_kept(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text(json.dumps({"index": 0, "prompt_token_ids": [1, 2], "finish_reason": "stop"}))
    kept = cli_module.finished_records(path, num_prompts=1)
    with pytest.raises(ValueError, match="the file is not this job's"):
        cli_module.check_kept_prompts(kept, [[1, 3]], None, str(path))
    with pytest.raises(ValueError, match=r"a result needs an index in \[0, 1\)"):
        path.write_text('{"index": 5}\n{"index": 0}\n')
        cli_module.finished_records(path, num_prompts=1)
    path.write_text('not json\n{"index": 0}\n')
    with pytest.raises(ValueError, match=r"out\.jsonl:1: not JSON"):
        cli_module.finished_records(path, num_prompts=1)


def test_make_model_writes_a_loadable_checkpoint(capsys, tmp_path):
    out_dir = tmp_path / "tiny-mixtral"
    code, out, err = run_cli(
        capsys,
        "make-model",
        "--arch",
        "mixtral",
        "--out",
        str(out_dir),
        "--vocab-size",
        "320",
        "--num-experts",
        "4",
        "--seed",
        "7",
    )
    assert code == 0, err
    assert out.strip() == str(out_dir)
    assert (out_dir / "config.json").is_file() and (out_dir / "tokenizer.json").is_file()
    assert json.loads((out_dir / "config.json").read_text())["num_local_experts"] == 4
    with LLM(model=str(out_dir), launcher="local", dp_size=1, dtype="float64") as llm:
        (first,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(first.output_token_ids) == 4
    assert all(0 <= t < 320 for t in first.output_token_ids)
    # The same seed writes the same weights: a second checkpoint generates the same tokens.
    again = tmp_path / "again"
    argv = ["--vocab-size", "320", "--num-experts", "4", "--seed", "7"]
    assert run_cli(capsys, "make-model", "--arch", "mixtral", "--out", str(again), *argv)[0] == 0
    with LLM(model=str(again), launcher="local", dp_size=1, dtype="float64") as llm:
        (second,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert second.output_token_ids == first.output_token_ids
