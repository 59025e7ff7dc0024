"""The settings flags of `lockstep run` / `lockstep serve` (launcher/flags.py): one per config
key, vLLM's spellings, config < --set < flags, the closest known flag for a typo, and a --help
that lists them all without importing torch. Nothing here starts a rank."""

from __future__ import annotations

import re
import subprocess
import sys
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

import pytest
from cli_harness import run_cli

from dist_engine.engine.config import EngineConfig, MoEConfig, ParallelConfig
from launcher import flags
from launcher.cli import build_parser
from launcher.server.config import ServerConfig
from launcher.server.serve import load_configs
from scheduler import SchedulerConfig

SECTION_CLASSES = {
    "": EngineConfig,
    "parallel": ParallelConfig,
    "scheduler": SchedulerConfig,
    "moe": MoEConfig,
    "server": ServerConfig,
}


def parse(command: str, *argv: str):
    parser, _ = build_parser()
    return parser.parse_args([command, *argv])


def no_builtin() -> dict:
    pytest.fail("the built-in job was built, but MODEL or --config was given")


def every_field() -> list[tuple[str, str, object]]:
    """(section, field name, annotation) of every config field, read from the dataclasses
    themselves: a field added anywhere shows up here, flag or no flag."""
    found = []
    for section, cls in SECTION_CLASSES.items():
        hints = get_type_hints(cls)
        for item in fields(cls):
            if section == "" and item.name in ("parallel", "scheduler", "moe"):
                continue  # the sections themselves
            found.append((section, item.name, hints[item.name]))
    return found


def sample_value(annotation: object) -> tuple[list[str], object]:
    """Command-line words for a value of this type, and the value they must give."""
    if get_origin(annotation) in (types.UnionType, typing.Union):
        (inner,) = [a for a in get_args(annotation) if a is not type(None)]
        return sample_value(inner)
    if annotation is bool:
        return [], True  # the bare --flag
    if get_origin(annotation) is Literal:
        return [get_args(annotation)[-1]], get_args(annotation)[-1]
    if get_origin(annotation) is tuple:
        return ["first", "second"], ["first", "second"]
    return {int: (["7"], 7), float: (["0.5"], 0.5), str: (["text"], "text")}[annotation]


@pytest.mark.parametrize(("section", "name", "annotation"), every_field())
def test_every_config_field_has_a_flag_that_sets_its_key(section, name, annotation):
    flag = "--" + name.replace("_", "-")
    key = f"{section}.{name}" if section else name
    if key in flags.CHOICES:  # a registry's names: any of them
        words, value = [flags.CHOICES[key][-1]], flags.CHOICES[key][-1]
    else:
        words, value = sample_value(annotation)
    given = flags.overrides(parse("serve", flag, *words))
    mine, other = (
        (given.server, given.engine) if section == "server" else (given.engine, given.server)
    )
    name_in_section = name if section == "server" else key
    assert mine == {name_in_section: value} and other == {}
    if section != "server":  # `run` has the engine's flags too, the same way
        assert flags.overrides(parse("run", flag, *words)).engine == {key: value}
    if annotation is bool or bool in get_args(annotation):
        negated = flags.overrides(parse("serve", "--no-" + flag[2:]))
        assert (negated.server if section == "server" else negated.engine) == {
            name_in_section: False
        }


def test_run_has_no_server_flags():
    with pytest.raises(SystemExit):
        parse("run", "--port", "1")


def test_optional_settings_take_none():
    given = flags.overrides(parse("run", "--max-model-len", "none", "--seed", "null"))
    assert given.engine == {"scheduler.max_model_len": None, "seed": None}
    with pytest.raises(SystemExit):
        parse("run", "--max-num-seqs", "none")  # not optional: an int only


def test_vllm_spellings_reach_the_configs(model_dir, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    args = parse(
        "serve", model_dir,
        "--data-parallel-size", "2", "--max-model-len", "96", "--max-num-seqs", "3",
        "--max-num-batched-tokens", "512", "--served-model-name", "a", "b", "--dtype", "float64",
        "--seed", "11", "--tokenizer", model_dir, "--chat-template", str(template),
        "--api-key", "k", "--host", "::1", "--port", "0", "--block-size", "8",
        "--enable-prefix-caching", "--kv-cache-memory-bytes", "1048576",
        "--gpu-memory-utilization", "0.8", "--generation-config", "vllm",
        "--enable-expert-parallel",
    )  # fmt: skip
    engine, server = load_configs(args, no_builtin)
    assert engine.model == model_dir and engine.dtype == "float64" and engine.seed == 11
    assert engine.parallel.dp_size == 2
    scheduler = engine.scheduler
    assert (scheduler.max_model_len, scheduler.max_num_seqs) == (96, 3)
    assert (scheduler.max_num_batched_tokens, scheduler.block_size) == (512, 8)
    assert scheduler.enable_prefix_caching is True
    assert engine.kv_cache_bytes == 1048576 and engine.gpu_memory_utilization == 0.8
    assert (engine.tokenizer, engine.generation_config) == (model_dir, "vllm")
    assert server.served_model_name == ("a", "b")
    assert (server.api_key, server.host, server.port) == ("k", "::1", 0)
    assert server.chat_template_text() == template.read_text()
    assert load_configs(parse("serve", model_dir, "-dp", "3"), no_builtin)[0].parallel.dp_size == 3
    off = parse("serve", model_dir, "--no-enable-prefix-caching")
    assert load_configs(off, no_builtin)[0].scheduler.enable_prefix_caching is False


def test_a_habitual_vllm_serve_command_line_is_taken(model_dir, caplog):
    """Flags `vllm serve` users pass by habit: the neutral ones are taken with a note, the
    ones that mean a Lockstep setting set it, and none is silently dropped."""
    args = parse(
        "serve", model_dir,
        "--trust-remote-code", "--tensor-parallel-size", "1", "-pp", "1",
        "--kv-cache-dtype", "auto", "--load-format", "safetensors", "--tokenizer-mode", "auto",
        "--swap-space", "4", "--max-logprobs", "20", "--disable-log-requests",
        "--disable-log-stats", "--enable-chunked-prefill", "--uvicorn-log-level", "warning",
        "--distributed-executor-backend", "ray", "--response-role", "assistant",
        "--api-server-count", "1", "--disable-frontend-multiprocessing", "--async-scheduling",
        "--compilation-config", "{}", "--hf-overrides", "{}",
    )  # fmt: skip
    with caplog.at_level("INFO"):
        engine, server = load_configs(args, no_builtin)
    assert engine.parallel.launcher == "ray" and engine.scheduler.chunked_prefill is True
    assert server.stats_log_interval_s == 0
    for note in ("--trust-remote-code: changes nothing", "--swap-space 4: changes nothing",
                 "--tensor-parallel-size 1: changes nothing"):  # fmt: skip
        assert note in caplog.text
    off = parse("serve", model_dir, "--no-enable-chunked-prefill", "--enable-log-requests",
                "--distributed-executor-backend", "external_launcher")  # fmt: skip
    engine, server = load_configs(off, no_builtin)
    assert engine.scheduler.chunked_prefill is False and engine.parallel.launcher == "torchrun"
    assert server.access_log is True
    # Lockstep's own flag wins over a vLLM flag's meaning.
    both = parse("serve", model_dir, "--disable-log-stats", "--stats-log-interval-s", "5")
    assert load_configs(both, no_builtin)[1].stats_log_interval_s == 5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-tp", "2"], "--tensor-parallel-size 2: not supported here (there is no tensor"),
        (["--kv-cache-dtype", "fp8"], "the KV cache takes the model's dtype"),
        (["--quantization", "fp8"], "the checkpoint is not quantized, and quantizing a model"),
        (["--distributed-executor-backend", "mp"], "--distributed-executor-backend mp: not"),
        (["--response-role", "bot"], "leave it out or give assistant"),
    ],
)
def test_vllm_flags_this_engine_cannot_honour_fail_naming_them(model_dir, argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_configs(parse("serve", model_dir, *argv), no_builtin)


def test_quantization_is_taken_where_it_names_the_checkpoints_own(model_dir, tmp_path):
    import json
    import shutil

    release = tmp_path / "fp8"
    shutil.copytree(model_dir, release)
    config = json.loads((release / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (release / "config.json").write_text(json.dumps(config))
    load_configs(parse("serve", str(release), "--quantization", "fp8"), no_builtin)
    with pytest.raises(ValueError, match="quantized with 'fp8', and quantizing"):
        load_configs(parse("serve", str(release), "--quantization", "awq"), no_builtin)
    with pytest.raises(ValueError, match="is not a local checkpoint directory yet"):
        load_configs(parse("serve", "org/name", "--quantization", "fp8"), no_builtin)


def test_server_only_vllm_flags_are_not_flags_of_run():
    with pytest.raises(SystemExit):
        parse("run", "--disable-log-stats")
    parse("run", "--trust-remote-code", "-tp", "1")  # engine-side: run takes them too


def test_model_without_a_config_takes_every_default(model_dir):
    engine, server = load_configs(parse("serve", model_dir), no_builtin)
    assert engine == EngineConfig(model=model_dir)
    assert server == ServerConfig()


def test_config_then_set_then_flags(model_dir, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "model: /nowhere\nscheduler: {max_num_seqs: 8, block_size: 4}\n"
        "server: {port: 9000, max_pending_requests: 8}\n"
    )
    args = parse(
        "serve", "--max-num-seqs", "2", "--config", str(path), "--port", "9002",
        "--set", "max_num_seqs=4", "--set", "server.port=9001", "--set", "max_pending_requests=5",
        "--set", "model=/also/nowhere", model_dir,
    )  # fmt: skip
    engine, server = load_configs(args, no_builtin)
    # The flag wins wherever it stands on the line; --set beats the YAML; untouched keys keep
    # the YAML's values.
    assert engine.scheduler.max_num_seqs == 2 and engine.scheduler.block_size == 4
    assert engine.model == model_dir  # MODEL is a flag too
    assert (server.port, server.max_pending_requests) == (9002, 5)
    without_flags = parse("serve", "--config", str(path), "--set", "max_num_seqs=4")
    engine, server = load_configs(without_flags, no_builtin)
    assert engine.scheduler.max_num_seqs == 4 and server.port == 9000


def test_model_and_model_flag_must_agree(capsys, model_dir):
    code, _, err = run_cli(capsys, "run", model_dir, "--model", "/elsewhere")
    assert code == 2 and "MODEL" in err and "'/elsewhere'" in err and "give one" in err


@pytest.mark.parametrize(
    ("command", "typo", "meant"),
    [
        ("run", "--max-model-length", "--max-model-len"),
        ("run", "--data-paralel-size", "--data-parallel-size"),
        ("serve", "--served-model", "--served-model-name"),
        ("serve", "--enable-prefix-cache", "--enable-prefix-caching"),
    ],
)
def test_an_unknown_flag_names_the_closest_one(capsys, command, typo, meant):
    code, out, err = run_cli(capsys, command, typo, "4")
    assert code == 2 and out == ""
    assert f"unrecognized arguments: {typo}" in err
    assert f"{typo}: did you mean {meant}?" in err


def test_abbreviations_are_not_taken_for_flags(capsys):
    code, _, err = run_cli(capsys, "run", "--max-model", "64")
    assert code == 2 and "did you mean --max-model-len?" in err


def test_a_value_outside_the_choices_is_refused_by_argparse(capsys):
    code, _, err = run_cli(capsys, "serve", "--sync-policy", "sometimes")
    assert code == 2 and "invalid choice: 'sometimes'" in err and "deadline" in err
    code, _, err = run_cli(capsys, "run", "--dtype", "int8")
    assert code == 2 and "invalid choice: 'int8'" in err


def test_serve_refuses_a_bad_chat_template_or_tokenizer_before_starting(capsys, model_dir):
    code, _, err = run_cli(capsys, "serve", model_dir, "--chat-template", "{% if %}")
    assert code == 2 and "server.chat_template: not a valid Jinja template" in err
    code, _, err = run_cli(capsys, "serve", model_dir, "--chat-template", "/no/such/template")
    assert code == 2 and "no such file, and not a Jinja template" in err
    code, _, err = run_cli(capsys, "serve", model_dir, "--tokenizer", "/no/tokenizer/here")
    assert code == 2 and "tokenizer '/no/tokenizer/here': no tokenizer.json there" in err
    code, _, err = run_cli(capsys, "serve", model_dir, "--generation-config", "/no/gen")
    assert code == 2 and "generation_config '/no/gen': no generation_config.json there" in err


def test_two_fields_with_one_flag_name_are_caught():
    clash = [
        flags.Setting("a.x", "a", ("--x",), int, 0),
        flags.Setting("b.x", "b", ("--x",), int, 0),
    ]
    with pytest.raises(RuntimeError, match=r"'a.x' and 'b.x' would both be --x"):
        flags._check_unique(clash)


def test_descriptions_name_real_settings():
    keys = {s.key for s in flags.settings(server=True)}
    assert set(flags.DESCRIPTIONS) <= keys
    assert set(flags.VLLM_NAMES) <= keys and set(flags.CHOICES) <= keys


def test_serve_help_lists_every_flag_by_section_without_torch():
    code = (
        "import sys; from launcher.cli import main\n"
        "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
        cwd=root,
    )  # fmt: skip
    text = done.stdout
    positions = [text.index(title + ":") for title in flags.SECTION_TITLES.values()]
    assert positions == sorted(positions)  # one group per section, in order
    for section, name, _ in every_field():
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
        # Listed under its own section: after its title, before the next one.
        start = text.index(flags.SECTION_TITLES[section] + ":")
        later = [p for p in positions if p > start]
        end = min(later) if later else len(text)
        assert start <= text.find(flag, start) < end, (flag, section)
    for alias in ("-dp", "--data-parallel-size", "--kv-cache-memory-bytes", "--no-enable-"):
        assert alias in text
    assert "--enable-expert-parallel" in text and "MODEL" in text
