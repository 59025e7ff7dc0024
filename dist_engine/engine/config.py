"""Engine settings: frozen dataclasses, one per YAML section, checked on construction.

    model: /path/to/hf_dir       # or a hub id, org/name (with revision: a branch, tag or commit)
    dtype: auto                  # the checkpoint's where the device runs it well, else float32
    attention_backend: auto      # and expert_backend, norm_backend, linear_backend,
                                 # sampler_backend (backends.py)
    parallel: {dp_size: 2, launcher: ray, backend: auto}
    scheduler: {max_num_seqs: 64, block_size: 16, ...}      # scheduler.SchedulerConfig
    moe: {ll_max_tokens_per_rank: 64}
    check_lockstep: false

Errors name the key, the value and what is allowed. Importing this module does not import
torch: the command line builds its flags from these dataclasses (launcher/flags.py), and
`lockstep --help` must answer at once. A setting with a fixed set of values has a `Literal`
type; its tuple of values (`LAUNCHERS`, `BACKEND_CHOICES`, ...) is read from that type.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from scheduler import SchedulerConfig

if TYPE_CHECKING:
    import torch

Launcher = Literal["ray", "torchrun", "local"]
Backend = Literal["auto", "nccl", "gloo"]
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
MoEExchange = Literal["auto", "shared_memory", "process_group"]
# torch's names for them; auto: the checkpoint's where the device runs it well (engine/dtype.py)
Dtype = Literal["auto", "float32", "bfloat16", "float16", "float64"]
# Which implementation runs each kind of op (dist_engine/backends.py resolves them).
AttentionBackend = Literal["auto", "native", "torch"]
ExpertBackend = Literal["auto", "native", "torch", "grouped_mm"]
NormBackend = Literal["auto", "native", "torch"]
LinearBackend = Literal["auto", "torch", "onednn", "onednn_t", "onednn_packed"]
SamplerBackend = Literal["auto", "native", "torch"]
# What the driver does when a rank dies or stops answering (launcher/healing.py).
OnRankFailure = Literal["heal", "shrink", "fail"]
# Where EPLB reads the experts new to a rank: a rank that holds them, the checkpoint, or
# whichever the group measured faster as it formed (dist_engine/engine/eplb.py).
ExpertSource = Literal["auto", "peer", "checkpoint"]
# Decode steps replayed from CUDA graphs (dist_engine/engine/decode_graphs.py).
CudaGraphs = Literal["off", "auto", "on"]

LAUNCHERS = get_args(Launcher)
BACKENDS = get_args(Backend)
PLACEMENT_STRATEGIES = get_args(PlacementStrategy)
MOE_EXCHANGES = get_args(MoEExchange)
ON_RANK_FAILURE = get_args(OnRankFailure)
EXPERT_SOURCES = get_args(ExpertSource)
CUDA_GRAPHS = get_args(CudaGraphs)
DTYPES = get_args(Dtype)
BACKEND_CHOICES = {
    "attention_backend": get_args(AttentionBackend),
    "expert_backend": get_args(ExpertBackend),
    "norm_backend": get_args(NormBackend),
    "linear_backend": get_args(LinearBackend),
    "sampler_backend": get_args(SamplerBackend),
}
EPLB_KEYS = (
    "enable_eplb",
    "eplb_num_redundant_experts",
    "eplb_window_steps",
    "eplb_interval_steps",
    "eplb_expert_source",
)
# generation_config: the model's generation_config.json ("auto"), none ("vllm"), or a directory
# holding one (vLLM's --generation-config; launcher/generation_config.py reads it).
GENERATION_CONFIG_MODES = ("auto", "vllm")


@dataclass(frozen=True)
class ParallelConfig:
    dp_size: int = 1
    launcher: Launcher = "ray"
    backend: Backend = "auto"  # of the MoE group; the vote group is always gloo (CPU)
    placement_strategy: PlacementStrategy = "PACK"
    collective_timeout_s: float = 60.0
    # Torch threads of each rank. None: under Ray the host's cores split evenly over the ranks
    # (at least 1 each); under torchrun or local, the process's own setting.
    threads_per_rank: int | None = None
    # CPU ranks that share a host each pinned to their own cores, under Ray and torchrun
    # (dist_engine/distributed/cpu_binding.py).
    cpu_binding: bool = True
    # How the MoE all-to-alls travel: `shared_memory` between CPU ranks on one host
    # (dist_engine/distributed/shm_exchange.py), `process_group` through the MoE group's
    # backend; `auto` takes shared memory where every rank is on one host and the backend is
    # gloo.
    moe_exchange: MoEExchange = "auto"
    # A rank that dies or stops answering: `heal` re-forms the group under Ray with a
    # replacement rank, or, when none can be placed and started, shrinks it onto the
    # survivors (they take over its experts) and grows it back once replacements can start;
    # `shrink` goes on with the survivors at once and never replaces; either way every
    # unfinished request resumes from its committed tokens. `fail` ends every unfinished
    # request with an error naming the rank. A group of one (local) and torchrun cannot heal,
    # so they fail either way (docs/design.md, "Failure model").
    on_rank_failure: OnRankFailure = "heal"
    # How long a heal waits for a replacement rank to be placed and its process to start
    # (its model load not included) before the group shrinks onto the survivors.
    replacement_wait_s: float = 60.0
    # Past this many recoveries within the last hour the next failure fails the group.
    max_recoveries_per_hour: int = 3
    # A request outstanding in this many failures in a row, without a token committed in
    # between, is ended alone with an error naming it (it may be what kills the group).
    poison_failure_threshold: int = 2

    def __post_init__(self) -> None:
        _positive_int("parallel.dp_size", self.dp_size)
        _choice("parallel.on_rank_failure", self.on_rank_failure, ON_RANK_FAILURE)
        _positive_int("parallel.max_recoveries_per_hour", self.max_recoveries_per_hour)
        _positive_int("parallel.poison_failure_threshold", self.poison_failure_threshold)
        if not isinstance(self.cpu_binding, bool):
            raise ValueError(
                f"parallel.cpu_binding must be true or false, got {self.cpu_binding!r}"
            )
        if self.threads_per_rank is not None:
            _positive_int("parallel.threads_per_rank", self.threads_per_rank)
        _choice("parallel.launcher", self.launcher, LAUNCHERS)
        _choice("parallel.backend", self.backend, BACKENDS)
        _choice("parallel.placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)
        _choice("parallel.moe_exchange", self.moe_exchange, MOE_EXCHANGES)
        if self.moe_exchange == "shared_memory" and self.backend == "nccl":
            raise ValueError(
                "parallel.moe_exchange 'shared_memory' moves CPU tensors; with parallel.backend "
                "'nccl' use auto or process_group"
            )
        for name in ("collective_timeout_s", "replacement_wait_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"parallel.{name} must be > 0 seconds, got {value!r}")


@dataclass(frozen=True)
class MoEConfig:
    # Tokens each rank may send in a low-latency (decode) dispatch; None = max_num_seqs.
    ll_max_tokens_per_rank: int | None = None
    # Expert-parallel load balancing while serving (dist_engine/engine/eplb.py): every layer
    # counts the tokens routed to each expert; every `eplb_interval_steps` forward steps the
    # group sums the last `eplb_window_steps` steps' counts, places the experts anew over
    # E + `eplb_num_redundant_experts` slots (a multiple of dp_size) and moves the weights.
    enable_eplb: bool = False
    eplb_num_redundant_experts: int = 0
    eplb_window_steps: int = 1000
    eplb_interval_steps: int = 3000
    # Where a rank gets the experts a new placement gives it: "peer" (sent by a rank that
    # holds them, over a gloo group of EPLB's own), "checkpoint" (read from the model's
    # files), "auto" (the one measured faster, on every rank, as the group forms).
    eplb_expert_source: ExpertSource = "auto"

    def __post_init__(self) -> None:
        if self.ll_max_tokens_per_rank is not None:
            _positive_int("moe.ll_max_tokens_per_rank", self.ll_max_tokens_per_rank)
        if not isinstance(self.enable_eplb, bool):
            raise ValueError(f"moe.enable_eplb must be true or false, got {self.enable_eplb!r}")
        redundant = self.eplb_num_redundant_experts
        if not isinstance(redundant, int) or isinstance(redundant, bool) or redundant < 0:
            raise ValueError(
                f"moe.eplb_num_redundant_experts must be an int >= 0, got {redundant!r}"
            )
        _positive_int("moe.eplb_window_steps", self.eplb_window_steps)
        _positive_int("moe.eplb_interval_steps", self.eplb_interval_steps)
        if self.eplb_expert_source not in EXPERT_SOURCES:
            raise ValueError(
                f"moe.eplb_expert_source must be one of {', '.join(EXPERT_SOURCES)}, got "
                f"{self.eplb_expert_source!r}"
            )
        if self.eplb_num_redundant_experts and not self.enable_eplb:
            raise ValueError(
                f"moe.eplb_num_redundant_experts is {self.eplb_num_redundant_experts}, but "
                f"moe.enable_eplb is false: redundant slots exist only for EPLB to fill; set "
                f"enable_eplb: true or leave it at 0"
            )

    def eplb_settings(self) -> dict[str, object]:
        """The EPLB keys, under their dotted names (every rank must share them)."""
        return {f"moe.{name}": getattr(self, name) for name in EPLB_KEYS}


@dataclass(frozen=True)
class EngineConfig:
    # A checkpoint directory, or a Hugging Face hub id (org/name) that the driver resolves
    # through the hub's cache before any rank starts (`with_local_model`).
    model: str
    dtype: Dtype = "auto"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    check_lockstep: bool = False
    # Seeds the per-request seeds of requests that do not give their own (each rank draws them
    # in arrival order from this and its rank), so a rerun of the same job samples alike;
    # null: a random seed per request.
    seed: int | None = 0
    # When set, each rank's KV pool gets as many blocks as fit in this many bytes, replacing
    # scheduler.num_blocks.
    kv_cache_bytes: int | None = None
    # Which implementation runs each kind of op (dist_engine/backends.py): auto (measured on
    # this host), native, torch, for the experts grouped_mm, for the dense linears onednn
    # (onednn_t: oneDNN over weights stored transposed, [in, out]; onednn_packed: bf16 over
    # a copy of each weight packed once in oneDNN's layout).
    attention_backend: AttentionBackend = "auto"
    expert_backend: ExpertBackend = "auto"
    norm_backend: NormBackend = "auto"
    linear_backend: LinearBackend = "auto"
    # native: the sampler's unfiltered rows (vLLM's default sampling) drawn by a compiled CPU
    # kernel in one pass per row.
    sampler_backend: SamplerBackend = "auto"
    # Decode steps replayed from CUDA graphs, one per padded batch size and block-table width:
    # on, off, or auto (captured and timed against the eager forward at the first decode
    # step). A CUDA device at DP = 1 without EPLB only; off by default until a GPU run has
    # shown them (decode_graphs.py).
    cuda_graphs: CudaGraphs = "off"
    # The front ends' settings (the LLM API, `lockstep run`, `lockstep serve`); the ranks take
    # token ids and read none of them.
    # A directory whose tokenizer files (tokenizer.json, tokenizer_config.json) encode prompts
    # and decode outputs; null: the model's own.
    tokenizer: str | None = None
    # The default sampling of requests that set none: "auto" the model's generation_config.json,
    # "vllm" none (temperature 1.0), or a directory holding a generation_config.json.
    generation_config: str = "auto"
    # vLLM's KV sizing by a share of GPU memory: accepted, but the engine sizes its pool by
    # num_blocks or kv_cache_bytes; the front ends say it does not apply on a CPU group and
    # refuse it on a GPU one (launcher/llm.py, check_gpu_memory_utilization).
    gpu_memory_utilization: float | None = None
    # A hub id's branch, tag or commit (null: its main branch). The driver pins it to the
    # commit it resolved, so every rank loads the same files.
    revision: str | None = None
    # Recorded by the driver when `model` was a hub id: that id, with `model` then the snapshot
    # directory on the driver's host and `revision` its commit. A rank on a host without that
    # directory resolves the same id and commit into its own host's cache.
    hub_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(
                f"model must be a checkpoint directory or a hub id (org/name), got {self.model!r}"
            )
        for key in ("revision", "hub_id"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{key} must be a non-empty string or null, got {value!r}")
        _choice("dtype", self.dtype, DTYPES)
        for key, allowed in BACKEND_CHOICES.items():
            _choice(key, getattr(self, key), allowed)
        if isinstance(self.cuda_graphs, bool):  # YAML reads a bare on / off as a boolean
            object.__setattr__(self, "cuda_graphs", "on" if self.cuda_graphs else "off")
        _choice("cuda_graphs", self.cuda_graphs, CUDA_GRAPHS)
        if self.kv_cache_bytes is not None:
            _positive_int("kv_cache_bytes", self.kv_cache_bytes)
        tokenizer = self.tokenizer
        if tokenizer is not None and (not isinstance(tokenizer, str) or not tokenizer):
            raise ValueError(
                f"tokenizer must be a directory with tokenizer files or null, got {tokenizer!r}"
            )
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(
                f"generation_config must be one of {list(GENERATION_CONFIG_MODES)} or a "
                f"directory holding a generation_config.json, got {self.generation_config!r}"
            )
        value = self.gpu_memory_utilization
        if value is not None and (
            not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1
        ):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1] or null, got {value!r}")
        if not isinstance(self.check_lockstep, bool):
            raise ValueError(f"check_lockstep must be true or false, got {self.check_lockstep!r}")
        for key, (neutral, why) in _SCHEDULER_ONLY.items():
            value = getattr(self.scheduler, key)
            if value != neutral:
                raise ValueError(
                    f"scheduler.{key} is {value!r}, but the engine has nothing that uses it "
                    f"({why}); leave it at {neutral!r}"
                )
        if self.seed is not None:
            _nonnegative_int("seed", self.seed)
        capacity = self.ll_capacity
        if capacity < self.scheduler.max_num_seqs:
            # A decode step sends one token per running sequence; a smaller capacity would
            # have to drop tokens, so refuse to start instead.
            raise ValueError(
                f"moe.ll_max_tokens_per_rank ({capacity}) must be >= scheduler.max_num_seqs "
                f"({self.scheduler.max_num_seqs})"
            )

    def with_local_model(self) -> EngineConfig:
        """This config with `model` a checkpoint directory on this host.

        The driver calls it before any rank starts: a hub id is resolved through the hub's
        cache (`models/hub.py`: downloaded unless HF_HUB_OFFLINE; HF_HOME, HF_TOKEN honoured)
        and pinned: `model` becomes the snapshot directory, `revision` its commit, `hub_id`
        the id. A rank calls it too: where the driver's directory is missing (another host),
        it resolves `hub_id` at that commit into this host's cache; where it exists, nothing
        changes. A directory stays as it is. FileNotFoundError or ValueError say what is
        missing and what to do."""
        from dist_engine.models.hub import resolve_model

        if self.hub_id is not None:
            if Path(self.model).is_dir():
                return self
            resolved = resolve_model(self.hub_id, self.revision)
            return dataclasses.replace(self, model=resolved.path)
        resolved = resolve_model(self.model, self.revision)
        if resolved.repo_id is None:
            return self
        return dataclasses.replace(
            self, model=resolved.path, revision=resolved.commit, hub_id=resolved.repo_id
        )

    @property
    def ll_capacity(self) -> int:
        return self.moe.ll_max_tokens_per_rank or self.scheduler.max_num_seqs

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            raise ValueError("dtype 'auto' is resolved by each rank at start-up (engine/dtype.py)")
        return getattr(torch, self.dtype)

    @property
    def backend_settings(self) -> dict[str, str]:
        return {
            "attention_backend": self.attention_backend,
            "expert_backend": self.expert_backend,
            "norm_backend": self.norm_backend,
            "linear_backend": self.linear_backend,
            "sampler_backend": self.sampler_backend,
        }

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        values = dict(values)
        _reject_unknown("", values, {f.name for f in fields(cls)})
        sections = {"parallel": ParallelConfig, "scheduler": SchedulerConfig, "moe": MoEConfig}
        for name, section_cls in sections.items():
            section = values.get(name) or {}
            if not isinstance(section, dict):
                raise ValueError(f"{name} must be a mapping, got {section!r}")
            _reject_unknown(f"{name}.", section, {f.name for f in fields(section_cls)})
            try:
                values[name] = section_cls(**section)
            except ValueError as error:
                message = str(error)
                prefixed = message if message.startswith(name) else f"{name}.{message}"
                raise ValueError(prefixed) from None
        if "model" not in values:
            raise ValueError("model is required: a Hugging Face checkpoint directory or hub id")
        values["model"] = str(values["model"])
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        import yaml

        text = Path(path).read_text()
        try:
            values = yaml.safe_load(text) or {}
        except yaml.YAMLError as error:
            raise ValueError(f"{path}: not valid YAML: {error}") from error
        if not isinstance(values, dict):
            raise ValueError(
                f"{path}: the top level must be a mapping, got {type(values).__name__}"
            )
        return cls.from_dict(values)

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """Flat overrides: a top-level field, or any field of a section by its own name
        (``max_num_seqs=8``, ``dp_size=2``) or dotted (``scheduler.max_num_seqs``)."""
        values = self.to_dict()
        for key, value in overrides.items():
            section, name = _locate(key)
            (values[section] if section else values)[name] = value
        return EngineConfig.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def group_agreed(self, model_identity: str) -> dict[str, object]:
        """Settings every rank must share, compared at start-up: with them the code each rank
        runs, Lockstep's and torch's (whose collectives the ranks speak to each other)."""
        import torch

        return {
            **{f"scheduler.{k}": v for k, v in self.scheduler.group_agreed().items()},
            "parallel.dp_size": self.parallel.dp_size,
            "moe.ll_max_tokens_per_rank": self.ll_capacity,
            **self.moe.eplb_settings(),
            "dtype": self.dtype,
            "check_lockstep": self.check_lockstep,
            "model": model_identity,
            "code": code_identity(),
            "torch": torch.__version__,
        }


# Lockstep's packages, and the files of theirs that are code (Python, and the C++ the kernels
# are built from).
CODE_PACKAGES = ("dist_engine", "scheduler", "moe", "launcher")
_CODE_SUFFIXES = frozenset({".py", ".cpp", ".h", ".cu", ".cuh"})


@functools.cache
def code_identity() -> str:
    """A short hash of this process's Lockstep code (`code_digest` of `CODE_PACKAGES` where
    they are imported from). The front end and every rank must run the same code: requests
    and outputs cross between them as the front end's objects, and the ranks' votes and
    exchanges assume one protocol. A node left on another version otherwise fails each
    request with an error about some attribute, or worse. ~4 ms, once per process."""
    return code_digest({package: code_root(package) for package in CODE_PACKAGES})


def code_digest(roots: Mapping[str, Path]) -> str:
    """Every code file under each package's root, by its path inside the package and its
    bytes: where the packages are installed does not matter, nor do caches of compiled
    bytecode or other files beside them."""
    digest = hashlib.blake2b(digest_size=8)
    for package, root in sorted(roots.items()):
        for path in sorted(root.rglob("*")):
            if path.suffix not in _CODE_SUFFIXES or "__pycache__" in path.parts:
                continue
            data = path.read_bytes()
            name = f"{package}/{path.relative_to(root).as_posix()}"
            digest.update(f"{name}\0{len(data)}\0".encode())
            digest.update(data)
    return digest.hexdigest()


def code_root(package: str) -> Path:
    """Where ``package`` (one of CODE_PACKAGES) is imported from, without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"Lockstep's package {package!r} cannot be found")
    return Path(spec.origin).parent


def model_identity(model_dir: str | Path) -> str:
    """A short hash of the checkpoint's config.json: same architecture on every rank."""
    text = (Path(model_dir) / "config.json").read_bytes()
    canonical = json.dumps(json.loads(text), sort_keys=True).encode()
    return hashlib.sha256(canonical).hexdigest()[:16]


_SECTION_FIELDS = {
    "parallel": {f.name for f in fields(ParallelConfig)},
    "scheduler": {f.name for f in fields(SchedulerConfig)},
    "moe": {f.name for f in fields(MoEConfig)},
}
_TOP_FIELDS = {f.name for f in fields(EngineConfig)} - set(_SECTION_FIELDS)


def _locate(key: str) -> tuple[str, str]:
    if "." in key:
        section, name = key.split(".", 1)
        if section in _SECTION_FIELDS and name in _SECTION_FIELDS[section]:
            return section, name
    elif key in _TOP_FIELDS:
        return "", key
    else:
        owners = [section for section, names in _SECTION_FIELDS.items() if key in names]
        if len(owners) == 1:
            return owners[0], key
    known = sorted(_TOP_FIELDS) + sorted(
        f"{s}.{n}" for s, ns in _SECTION_FIELDS.items() for n in ns
    )
    raise ValueError(f"unknown setting {key!r}; known settings: {', '.join(known)}")


def _reject_unknown(prefix: str, values: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"unknown setting(s) {[prefix + k for k in unknown]}; allowed: "
            f"{sorted(prefix + k for k in known)}"
        )


# Scheduler settings the reference design has and this engine does not serve: the scheduler
# honours them (its tests exercise them), but a job that set one would only get its side
# effects, so the engine refuses them by name.
_SCHEDULER_ONLY = {
    "cp_size": (1, "context parallelism is not implemented; it would only realign chunks"),
    "lookahead_tokens": (0, "no speculative decoding; it would only set a minimum chunk"),
    "num_state_slots": (0, "no supported architecture keeps per-sequence recurrent state"),
}


def _nonnegative_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 or null, got {value!r}")


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
