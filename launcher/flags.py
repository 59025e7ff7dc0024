"""The settings flags of `lockstep run` and `lockstep serve`, generated from the config
dataclasses so that no setting lacks one and none drifts from its key.

Every field of `EngineConfig` (top-level keys), `ParallelConfig`, `SchedulerConfig`, `MoEConfig`
and, for `serve`, `ServerConfig` gets `--field-name` (the name with dashes), typed from the
field's annotation:

    int, float, str          a value (`X | None` also takes `none`)
    bool                     --x / --no-x (vLLM's form)
    Literal[...]             the listed values only (and the registries' names, `CHOICES`)
    tuple[str, ...]          one or more values (--served-model-name a b)

vLLM's spellings are aliases of the same flag where its name differs (`VLLM_NAMES`:
`--data-parallel-size`/`-dp`, `--kv-cache-memory-bytes`, `--enable-chunked-prefill`);
`--enable-expert-parallel` is accepted and changes nothing (expert parallelism is always
on); `--enforce-eager` is `--cuda-graphs off`. Other flags `vllm serve` users pass by habit
(`VLLM_FLAGS`: `--trust-remote-code`, `-tp 1`, `--kv-cache-dtype auto`, ...) are accepted
where they change nothing here (with a note) or mean a Lockstep setting
(`--disable-log-stats`, `--distributed-executor-backend ray`), and refused naming the flag
and why where their value cannot be honoured. A flag overrides `--set`, which overrides the
YAML: config < set < flags.
An unknown flag is argparse's error plus the closest known one.

Nothing here imports torch: `lockstep serve --help` builds the whole parser.
"""

from __future__ import annotations

import argparse
import difflib
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from dist_engine.engine.config import EngineConfig, MoEConfig, ParallelConfig
from dist_engine.log import get_logger
from launcher.routing import ROUTING_POLICIES
from launcher.server.config import SERVER_KEYS as _SERVER_KEYS
from launcher.server.config import ServerConfig
from launcher.server.reasoning import REASONING_PARSERS
from launcher.server.tools import TOOL_CALL_PARSERS
from scheduler import SchedulerConfig
from scheduler.config import PREEMPTION_ORDERS
from scheduler.vote import SYNC_POLICIES

# section -> its dataclass; "" is EngineConfig's own (top-level) keys.
SECTIONS: dict[str, type] = {
    "": EngineConfig,
    "parallel": ParallelConfig,
    "scheduler": SchedulerConfig,
    "moe": MoEConfig,
    "server": ServerConfig,
}
SECTION_TITLES = {
    "": "engine (top-level keys)",
    "parallel": "parallel (parallel.*)",
    "scheduler": "scheduler (scheduler.*, per rank)",
    "moe": "moe (moe.*)",
    "server": "server (server.*)",
}
# Config key -> vLLM's option strings for it, listed before Lockstep's own `--field-name`.
VLLM_NAMES = {
    "parallel.dp_size": ("-dp", "--data-parallel-size"),
    "kv_cache_bytes": ("--kv-cache-memory-bytes",),
    "scheduler.chunked_prefill": ("--enable-chunked-prefill",),
}


@dataclass(frozen=True)
class VllmFlag:
    """A `vllm serve` flag with no Lockstep setting of its own. ``neutral``: the values that
    change nothing here (None: any value); given one, the flag is accepted with a note saying
    why it changes nothing; given another, the command fails naming the flag and ``why``.
    ``sets``: (config key, value) for a flag that means one of Lockstep's settings."""

    option: str
    why: str
    takes_value: bool = True
    neutral: tuple[str, ...] | None = ()
    sets: tuple[str, Any] | None = None
    short: str | None = None
    server_only: bool = False  # a flag of `lockstep serve` only


_ONE = ("1",)
# Flags vLLM users pass by habit. Those that change nothing here are accepted with a note;
# those whose other values this engine cannot honour fail naming the flag (never ignored).
VLLM_FLAGS = (
    VllmFlag(
        "--trust-remote-code",
        "no code from a checkpoint ever runs here: the architectures are Lockstep's own",
        takes_value=False,
    ),
    VllmFlag(
        "--disable-log-requests",
        "requests are not logged (server.access_log logs one line per HTTP request)",
        takes_value=False,
        server_only=True,
    ),
    VllmFlag(
        "--enable-log-requests",
        "one line per request",
        takes_value=False,
        sets=("server.access_log", True),
        server_only=True,
    ),
    VllmFlag(
        "--disable-log-stats",
        "no periodic stats line",
        takes_value=False,
        sets=("server.stats_log_interval_s", 0),
        server_only=True,
    ),
    VllmFlag(
        "--tensor-parallel-size",
        "there is no tensor parallelism: the ranks run data-"
        "parallel attention with the experts spread over them (--data-parallel-size)",
        neutral=_ONE,
        short="-tp",
    ),
    VllmFlag(
        "--pipeline-parallel-size",
        "there is no pipeline parallelism (use --data-parallel-size)",
        neutral=_ONE,
        short="-pp",
    ),
    VllmFlag("--kv-cache-dtype", "the KV cache takes the model's dtype (auto)", neutral=("auto",)),
    VllmFlag(
        "--quantization",
        "the checkpoint's own quantization is read from its config (block FP8); a value "
        "that names it is accepted, quantizing a model while loading it is not built",
        neutral=("none", "None"),
    ),
    VllmFlag("--load-format", "safetensors checkpoints are read", neutral=("auto", "safetensors")),
    VllmFlag(
        "--tokenizer-mode",
        "the `tokenizers` library (transformers' for SentencePiece models) reads the tokenizer",
        neutral=("auto", "hf"),
    ),
    VllmFlag(
        "--swap-space",
        "a preempted request is recomputed, never swapped to host memory",
        neutral=None,
    ),
    VllmFlag(
        "--max-logprobs",
        "requests may ask for up to 20 top logprobs (OpenAI's limit)",
        neutral=("20",),
        server_only=True,
    ),
    VllmFlag(
        "--response-role",
        "chat replies come from the assistant",
        neutral=("assistant",),
        server_only=True,
    ),
    VllmFlag(
        "--distributed-executor-backend",
        "ray starts the ranks as Ray actors and "
        "external_launcher is torchrun (--launcher); other executors are not built",
        neutral=(),
    ),
    VllmFlag(
        "--uvicorn-log-level",
        "the server is aiohttp's; its log follows Lockstep's",
        neutral=None,
        server_only=True,
    ),
    VllmFlag(
        "--disable-frontend-multiprocessing",
        "the server and the group already run "
        "apart (a local DP=1 group runs in the server's process)",
        takes_value=False,
        server_only=True,
    ),
    VllmFlag(
        "--api-server-count", "one server process fronts the group", neutral=_ONE, server_only=True
    ),
    VllmFlag(
        "--async-scheduling",
        "the next step is scheduled while the outputs of the last go out already",
        takes_value=False,
    ),
    VllmFlag(
        "--compilation-config",
        "no torch.compile here (--cuda-graphs is the graph setting)",
        neutral=("{}",),
    ),
    VllmFlag("--hf-overrides", "a checkpoint's config is read as published", neutral=("{}",)),
)
_VLLM_DEST = "vllm-flag:"
# --distributed-executor-backend values that name one of Lockstep's launchers.
_EXECUTORS = {"ray": "ray", "external_launcher": "torchrun"}
# The same settings as keywords of `LLM(...)`, spelled vLLM's way.
VLLM_KEYWORDS = {"data_parallel_size": "dp_size", "kv_cache_memory_bytes": "kv_cache_bytes"}
# Settings validated against a registry or a tuple of the scheduler's (which has no Literal
# types): their values, from the objects the configs check them with.
CHOICES: dict[str, tuple[str, ...]] = {
    "scheduler.sync_policy": SYNC_POLICIES.names(),
    "scheduler.preemption_order": PREEMPTION_ORDERS,
    "server.routing": ROUTING_POLICIES.names(),
    "server.reasoning_parser": REASONING_PARSERS,
    "server.tool_call_parser": TOOL_CALL_PARSERS,
}
log = get_logger()
# Keys that have no flag of their own: the sections themselves.
_NOT_FLAGS = {"parallel", "scheduler", "moe"}
_DEST = "setting:"  # the argparse dest of a setting flag: _DEST + its config key
EXPERT_PARALLEL_DEST = "vllm:enable_expert_parallel"

DESCRIPTIONS = {
    "model": "Hugging Face checkpoint directory or hub id org/name (the same as MODEL)",
    "revision": "a hub id's branch, tag or commit (default: its main branch)",
    "hub_id": "the hub id MODEL's directory is a snapshot of (the driver records it; a rank on "
    "a host without the directory resolves it at --revision there)",
    "dtype": "dtype of the weights and activations",
    "check_lockstep": "all-gather every step's kind and check the ranks agree (debugging)",
    "seed": "seeds the requests that give no seed of their own; none: random per request",
    "kv_cache_bytes": "size each rank's KV pool to fit this many bytes (replaces --num-blocks)",
    "attention_backend": "implementation of paged attention (auto: measured on this host)",
    "expert_backend": "implementation of the experts (auto: measured on this host)",
    "norm_backend": "implementation of RMSNorm (auto: measured on this host)",
    "linear_backend": "implementation of the dense linear layers and the LM head: torch, "
    "onednn (CPU) (auto: measured on this host)",
    "sampler_backend": "implementation of the draw for rows sampled without top-k/top-p/min-p "
    "(auto: measured on this host)",
    "cuda_graphs": "replay decode steps from CUDA graphs: off, on, or auto (captured and timed "
    "against the eager forward at the first decode step); CUDA at DP=1 without EPLB",
    "tokenizer": "directory whose tokenizer files encode prompts and decode outputs "
    "(default: the model's)",
    "generation_config": "default sampling of requests that set none: auto (the model's "
    "generation_config.json), vllm (temperature 1.0), or a directory holding one",
    "gpu_memory_utilization": "vLLM's KV sizing by a share of GPU memory: does not apply to a "
    "CPU group, refused for a GPU group (use --kv-cache-memory-bytes)",
    "parallel.dp_size": "data-parallel ranks: each a whole engine, together one expert-parallel "
    "group",
    "parallel.launcher": "how the ranks start (serve: ray or local)",
    "parallel.backend": "backend of the MoE group (auto: nccl where CUDA is available)",
    "parallel.placement_strategy": "Ray placement of the ranks' bundles",
    "parallel.collective_timeout_s": "seconds a collective waits before a peer counts as failed",
    "parallel.threads_per_rank": "torch threads per rank (default under Ray: the cores split "
    "over the ranks)",
    "parallel.cpu_binding": "pin the CPU ranks sharing a host to disjoint cores",
    "parallel.moe_exchange": "how the MoE all-to-alls travel (auto: shared memory between CPU "
    "ranks on one host)",
    "scheduler.max_num_seqs": "running sequences per rank",
    "scheduler.max_num_batched_tokens": "tokens per step per rank",
    "scheduler.max_model_len": "longest prompt plus output (default: the model's, capped by "
    "the KV pool)",
    "scheduler.block_size": "tokens per KV block",
    "scheduler.num_blocks": "KV blocks per rank, the reserved block 0 included",
    "scheduler.num_state_slots": "recurrent-state slots (no supported model has state: keep 0)",
    "scheduler.chunked_prefill": "split prompts longer than a step's budget over steps",
    "scheduler.stop_preempted_request": "fail a preempted request instead of recomputing it",
    "scheduler.preemption_order": "which running request is preempted first",
    "scheduler.prefill_attempt_interval": "vote: decode steps between ALL attempt points",
    "scheduler.prefill_any_attempt_interval": "vote: decode steps between ANY attempt points",
    "scheduler.prefill_watermark": "KV usage above which a rank does not ask to prefill",
    "scheduler.prefill_max_sum_seqlen_k": "cap on a prefill step's summed key lengths "
    "(default: none)",
    "scheduler.enable_prefix_caching": "reuse the KV blocks of prompt prefixes seen before",
    "scheduler.lookahead_tokens": "speculative lookahead (not served: keep 0)",
    "scheduler.cp_size": "context parallelism (not served: keep 1)",
    "scheduler.sync_policy": "how the ranks agree on each step's kind",
    "scheduler.prefill_deadline_steps": "deadline: decode steps a ready prompt waits at most "
    "(default: 0 for one or two ranks, 2 for more)",
    "scheduler.mixed_steps": "prefill steps also decode the running sequences (default: on "
    "unless the policy is vote)",
    "scheduler.mixed_prompt_tokens": "mixed steps: prompt tokens per step while any rank decodes "
    "(default: 1024 for one rank, 256 in a group)",
    "scheduler.vocab_size": "fail prompts with ids beyond this (the engine sets it from the model)",
    "moe.ll_max_tokens_per_rank": "tokens a rank may send in one decode dispatch (default: "
    "max_num_seqs)",
    "moe.enable_eplb": "balance expert load while serving (EPLB)",
    "moe.eplb_num_redundant_experts": "EPLB: extra expert slots (experts + these must split "
    "evenly over dp_size)",
    "moe.eplb_window_steps": "EPLB: forward steps of load a decision looks at",
    "moe.eplb_interval_steps": "EPLB: forward steps between decisions",
    "moe.eplb_expert_source": "EPLB: where a rank gets the experts a rebalance gives it (auto: "
    "a peer or the checkpoint, whichever the group measures faster)",
    "server.host": "address to bind (127.0.0.1: this host only)",
    "server.port": "port to listen on (0: any free one)",
    "server.api_key": "require 'Authorization: Bearer KEY' (default: $LOCKSTEP_API_KEY)",
    "server.served_model_name": "the model name(s) requests may give and /v1/models lists "
    "(default: the model directory's name)",
    "server.chat_template": "chat template for /v1/chat/completions: a file, or the Jinja "
    "text itself (default: the tokenizer's)",
    "server.max_pending_requests": "open requests before new ones get 503",
    "server.max_body_bytes": "larger request bodies get 413",
    "server.drain_timeout_s": "on SIGTERM: seconds open requests may take to finish",
    "server.read_timeout_s": "seconds a request body may take to arrive (else 408)",
    "server.keepalive_timeout_s": "seconds a connection may sit idle or take to send headers",
    "server.routing": "which rank serves a request",
    "server.reasoning_parser": "split a reasoning model's <think> block out of chat replies "
    "as `reasoning` (deepseek_r1, qwen3)",
    "server.enable_auto_tool_choice": "let chat requests use tool_choice auto (needs "
    "--tool-call-parser)",
    "server.tool_call_parser": "how the model writes tool calls, for tool_choice auto "
    "(hermes, deepseek_v3, deepseek_v31, kimi_k2, qwen3_coder, glm45, mistral)",
}


@dataclass(frozen=True)
class Setting:
    """One config field and its flag."""

    key: str  # as --set and YAML name it: "dtype", "parallel.dp_size", "server.port"
    section: str
    option_strings: tuple[str, ...]
    annotation: Any
    default: Any


@dataclass(frozen=True)
class Overrides:
    """What the flags of one command line set, by config key (only the flags given)."""

    engine: dict[str, Any]  # "dp_size"-style keys for EngineConfig.with_overrides
    server: dict[str, Any]  # ServerConfig field names
    enable_expert_parallel: bool


def settings(*, server: bool) -> list[Setting]:
    """Every settings flag, in section order: the engine's, and the server's when ``server``."""
    found = []
    for section, cls in SECTIONS.items():
        if section == "server" and not server:
            continue
        hints = get_type_hints(cls)
        for item in fields(cls):
            if not section and item.name in _NOT_FLAGS:
                continue
            key = f"{section}.{item.name}" if section else item.name
            own = "--" + item.name.replace("_", "-")
            names = (*VLLM_NAMES.get(key, ()), own)
            found.append(Setting(key, section, names, hints[item.name], _default(item)))
    _check_unique(found)
    return found


def add_settings_arguments(parser: argparse.ArgumentParser, *, server: bool) -> None:
    """Add every settings flag to ``parser``, one argument group per section."""
    groups: dict[str, Any] = {}
    for setting in settings(server=server):
        if setting.section not in groups:
            groups[setting.section] = parser.add_argument_group(SECTION_TITLES[setting.section])
        _add(groups[setting.section], setting)
    compat = parser.add_argument_group("vLLM compatibility")
    compat.add_argument(
        "--enable-expert-parallel",
        dest=EXPERT_PARALLEL_DEST,
        action="store_true",
        default=argparse.SUPPRESS,
        help="accepted; Lockstep always spreads the experts over the DP ranks",
    )
    for flag in VLLM_FLAGS:
        if flag.server_only and not server:
            continue
        names = (flag.short, flag.option) if flag.short else (flag.option,)
        if flag.takes_value:
            compat.add_argument(*names, dest=_VLLM_DEST + flag.option, default=argparse.SUPPRESS,
                                metavar="VALUE", help=f"vLLM's; {flag.why}")  # fmt: skip
        else:
            compat.add_argument(*names, dest=_VLLM_DEST + flag.option, action="store_true",
                                default=argparse.SUPPRESS, help=f"vLLM's; {flag.why}")  # fmt: skip
    compat.add_argument(
        "--enforce-eager",
        dest=_DEST + "cuda_graphs",
        action="store_const",
        const="off",
        default=argparse.SUPPRESS,
        help="vLLM's: no CUDA graphs, the same as --cuda-graphs off",
    )


def overrides(args: argparse.Namespace) -> Overrides:
    """The settings the command line's flags give (absent flags give nothing)."""
    engine: dict[str, Any] = {}
    server: dict[str, Any] = {}
    for flag in VLLM_FLAGS:  # first: Lockstep's own flags, below, win over their meaning
        given = getattr(args, _VLLM_DEST + flag.option, None)
        if given is None or given is False:
            continue
        key, value = _vllm_flag(flag, given)
        if key is not None:
            (server if key.startswith("server.") else engine)[key.removeprefix("server.")] = value
    for dest, value in vars(args).items():
        if not dest.startswith(_DEST):
            continue
        key = dest.removeprefix(_DEST)
        if key.startswith("server."):
            server[key.removeprefix("server.")] = value
        else:
            engine[key] = value
    return Overrides(engine, server, bool(getattr(args, EXPERT_PARALLEL_DEST, False)))


def _vllm_flag(flag: VllmFlag, given: Any) -> tuple[str | None, Any]:
    """(config key, value) a vLLM flag sets, or (None, None) for one that changes nothing
    here (noted in the log); ValueError for a value this engine cannot honour."""
    if flag.option == "--distributed-executor-backend":
        if given in _EXECUTORS:
            return "parallel.launcher", _EXECUTORS[given]
        raise ValueError(f"{flag.option} {given}: not supported here; {flag.why}")
    if flag.sets is not None:
        return flag.sets
    if flag.option == "--quantization" and str(given) not in ("none", "None"):
        return "vllm:quantization", str(given)  # checked against the checkpoint (below)
    if not flag.takes_value or flag.neutral is None or str(given) in flag.neutral:
        shown = flag.option if not flag.takes_value else f"{flag.option} {given}"
        log.info("%s: changes nothing in Lockstep (%s)", shown, flag.why)
        return None, None
    allowed = " or ".join(flag.neutral)
    raise ValueError(
        f"{flag.option} {given}: not supported here ({flag.why}); leave it out or give {allowed}"
    )


def unknown_arguments_error(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    """argparse's error for ``unknown``, naming the closest known flag of each (exits 2)."""
    known = [o for action in parser._actions for o in action.option_strings]
    hints = []
    for item in unknown:
        if not item.startswith("-"):
            continue
        flag = item.partition("=")[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        if close:
            hints.append(f"{flag}: did you mean {close[0]}?")
    message = f"unrecognized arguments: {' '.join(unknown)}"
    parser.error(message + (f" ({'; '.join(hints)})" if hints else ""))


def add_common_arguments(parser: argparse.ArgumentParser, *, server: bool) -> None:
    """MODEL, --config and --set, then every settings flag (``server``: the server's too)."""
    parser.add_argument(
        "model_argument",
        nargs="?",
        default=argparse.SUPPRESS,
        metavar="MODEL",
        help="Hugging Face checkpoint directory or hub id org/name (default: --config's "
        "model; with neither, the built-in tiny model and job)",
    )
    what = "YAML engine config" + (", optionally with a server: section" if server else "")
    parser.add_argument("--config", help=f"{what} (flags and --set override it)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a setting by its config key, the value read as YAML (flags override --set)",
    )
    add_settings_arguments(parser, server=server)


def load_settings(
    args: argparse.Namespace, *, server: bool, builtin: Callable[[], dict[str, Any]]
) -> tuple[EngineConfig, dict[str, Any]]:
    """The engine config and the server's values (``server``) a command line gives:
    the YAML of ``--config`` (else MODEL with every default, else ``builtin()``: the built-in
    job), then ``--set``, then the flags. ValueError names the file, key or flag at fault."""
    given = overrides(args)
    model = _model_argument(args, given)
    server_values: dict[str, Any] = {}
    if args.config:
        values = _read_yaml(args.config)
        if server:
            server_values = values.pop("server", None) or {}
            if not isinstance(server_values, dict):
                raise ValueError(f"{args.config}: server must be a mapping, got {server_values!r}")
    elif model is not None:
        values = {"model": model}
    else:
        values = builtin()
    set_values: dict[str, Any] = {}
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
        key = key.strip()
        name = key.removeprefix("server.")
        if server and (key.startswith("server.") or name in _SERVER_KEYS):
            server_values[name] = _yaml_value(text)
        else:
            set_values[key] = _yaml_value(text)
    quantization = given.engine.pop("vllm:quantization", None)
    engine_overrides = {**set_values, **given.engine}
    if model is not None:  # a flag: over --set, and a YAML without a model is complete with it
        engine_overrides["model"] = values["model"] = model
    engine = EngineConfig.from_dict(values)
    if engine_overrides:
        engine = engine.with_overrides(**engine_overrides)
    server_values.update(given.server)
    if quantization is not None:
        _check_quantization(quantization, engine.model)
    if given.enable_expert_parallel:
        log.info(
            "--enable-expert-parallel: expert parallelism is always on in Lockstep (the experts "
            "are spread over the %d DP rank(s)); the flag changes nothing",
            engine.parallel.dp_size,
        )
    return engine, server_values


def _check_quantization(method: str, model: str) -> None:
    """vLLM's `--quantization METHOD`: accepted where it names the checkpoint's own
    quantization (a block-FP8 release and `fp8`); quantizing while loading is not built."""
    config = Path(model) / "config.json"
    if not config.is_file():
        raise ValueError(
            f"--quantization {method}: the checkpoint's config.json is read for its own "
            f"quantization, and {model} is not a local checkpoint directory yet; leave the flag "
            "out (a quantized release is recognised from its config)"
        )
    import json

    found = (json.loads(config.read_text()).get("quantization_config") or {}).get("quant_method")
    if found != method:
        what = f"quantized with {found!r}" if found else "not quantized"
        raise ValueError(
            f"--quantization {method}: the checkpoint is {what}, and quantizing a model while "
            "loading it is not built; leave the flag out"
        )
    log.info("--quantization %s: the checkpoint is %s already; changes nothing", method, method)


def _model_argument(args: argparse.Namespace, given: Overrides) -> str | None:
    positional = getattr(args, "model_argument", None)
    flag = given.engine.pop("model", None)
    if positional is not None and flag is not None and positional != flag:
        raise ValueError(f"MODEL {positional!r} and --model {flag!r} differ; give one")
    return positional if positional is not None else flag


def _read_yaml(path_text: str) -> dict[str, Any]:
    import yaml

    path = Path(path_text)
    if not path.is_file():
        raise ValueError(f"--config {path_text}: no such file")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: the top level must be a mapping, got {type(values).__name__}")
    return values


def _yaml_value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


# -- building one flag --------------------------------------------------------------------------
def _add(group: Any, setting: Setting) -> None:
    annotation, optional = _unwrap_optional(setting.annotation)
    kwargs: dict[str, Any] = {"dest": _DEST + setting.key, "default": argparse.SUPPRESS}
    if annotation is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif get_origin(annotation) is Literal or setting.key in CHOICES:
        literal = get_args(annotation) if get_origin(annotation) is Literal else ()
        kwargs["choices"] = literal or CHOICES[setting.key]
    elif get_origin(annotation) is tuple and get_args(annotation)[1:] == (Ellipsis,):
        member = _scalar(get_args(annotation)[0], setting.key)
        kwargs.update(nargs="+", type=member, metavar=_METAVARS[member])
    else:
        scalar = _scalar(annotation, setting.key)
        kwargs.update(type=_or_none(scalar) if optional else scalar, metavar=_METAVARS[scalar])
    default = "none" if setting.default is None else setting.default
    if isinstance(default, bool):
        default = str(default).lower()
    takes_none = "; none allowed" if optional and "nargs" not in kwargs and "type" in kwargs else ""
    where = f"[{setting.key} = {default}{takes_none}]" if setting.key != "model" else "[model]"
    description = DESCRIPTIONS.get(setting.key)
    text = f"{description} {where}" if description else where
    kwargs["help"] = text.replace("%", "%%")
    group.add_argument(*setting.option_strings, **kwargs)


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def _scalar(annotation: Any, key: str) -> type:
    if annotation in (int, float, str):
        return annotation
    raise TypeError(f"config field {key!r} has type {annotation!r}, which has no flag form")


def _or_none(convert: type) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "null") else convert(text)

    parse.__name__ = convert.__name__  # argparse names it in "invalid int value"
    return parse


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (itself, False)."""
    if get_origin(annotation) in (types.UnionType, typing.Union):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1 and len(get_args(annotation)) == 2:
            return members[0], True
    return annotation, False


def _default(item: Field) -> Any:
    if item.default is not MISSING:
        return item.default
    if item.default_factory is not MISSING:
        return item.default_factory()
    return None  # `model`: required, no default


def _check_unique(found: list[Setting]) -> None:
    seen: dict[str, str] = {}
    for setting in found:
        for name in setting.option_strings:
            if name in seen:
                raise RuntimeError(
                    f"config fields {seen[name]!r} and {setting.key!r} would both be {name}; "
                    "give one an alias in launcher/flags.py"
                )
            seen[name] = setting.key
