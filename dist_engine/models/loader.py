"""Build a model from its config and load a Hugging Face checkpoint directory into it,
reading only the experts this rank hosts.

A directory holds `config.json` and either `model.safetensors`, or shards listed by
`model.safetensors.index.json`, or (no index) any number of `*.safetensors` files. Tensors are
read lazily by name through `safetensors.safe_open`, so a rank touches only the attention/dense
weights and the experts `placement.hosted_logical(rank)` names; other experts' bytes are never
read.

Block-FP8 checkpoints (models/block_fp8.py) load dequantized: each quantized weight and its
`weight_scale_inv` are read together and multiplied out to the run dtype on the target device,
one tensor at a time, so float32 never holds more than a block row of a weight; a rank reads
the scales of only the experts it hosts. The reader unmaps its files every
`MAX_MAPPED_BYTES` of tensor data: a file page a read touched otherwise stays in the process's
resident set until the load ends, as much again as the checkpoint bytes the rank reads (a
rank's peak RSS was then twice its weights for a bf16 checkpoint; reopening a shard costs only
its header).

Each rank logs its progress over the shards it reads from (`ShardProgress`: a tqdm line every
`PROGRESS_INTERVAL_S` while it loads, then one line with the shards, bytes and seconds).

Policy on unexpected tensors: an error. A tensor we do not know (shared experts, biases, a
different architecture under the same `model_type`) would otherwise be dropped silently and the
model would produce wrong tokens with no warning. Only tensors HF itself ignores are skipped:
`lm_head.weight` when embeddings are tied, and `rotary_emb.inv_freq` buffers.
"""

from __future__ import annotations

import io
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from dist_engine.backends import Backends, LayerOps, resolve_backends
from dist_engine.layers.moe import ExpertParallelContext
from dist_engine.log import get_logger
from dist_engine.models import block_fp8
from dist_engine.models.block_fp8 import BlockFP8Format
from dist_engine.models.config import ModelConfig
from dist_engine.models.decoder import MoECausalLM
from dist_engine.models.registry import get_architecture, load_config
from dist_engine.models.weights import CheckpointLayout
from moe import MoELayer

INDEX_FILE = "model.safetensors.index.json"
_MAX_NAMES_IN_ERROR = 10
MAX_MAPPED_BYTES = 64 * 2**20
# How often a rank's progress line is logged while it loads (a quicker load logs only its end).
PROGRESS_INTERVAL_S = 10.0


class CheckpointReader:
    """Name-indexed, lazy access to the tensors of a checkpoint directory.

    `tensors_read` records every read (`name`, or `name[e]` for one expert's slice of a fused
    tensor) so callers and tests can see exactly what a rank touched. Tensors come back on
    `device` (safetensors reads them there), in their stored dtype.
    """

    def __init__(self, model_dir: str | Path, device: torch.device | str | None = None) -> None:
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
        self.device = torch.device("cpu" if device is None else device)
        self._handles: dict[str, Any] = {}
        self._bytes_since_unmap = 0
        self._file_of: dict[str, str] = self._index_tensors()
        self.tensors_read: list[str] = []
        self.num_bytes_read = 0
        # Called with each entry `tensors_read` records, after the read (`ShardProgress`).
        self.on_read: Callable[[str], None] | None = None

    def _index_tensors(self) -> dict[str, str]:
        index_path = self.model_dir / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text()).get("weight_map")
            except (json.JSONDecodeError, AttributeError) as error:
                raise ValueError(f"{index_path} is not a JSON object: {error}") from None
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index_path} has no 'weight_map' object")
            for file_name in sorted(set(weight_map.values())):
                if not (self.model_dir / file_name).is_file():
                    raise FileNotFoundError(
                        f"{index_path} lists shard {file_name!r}, which is not in {self.model_dir}"
                    )
            return dict(weight_map)
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.model_dir}")
        file_of: dict[str, str] = {}
        for path in files:
            for name in self._open(path.name).keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in file_of:
                    raise ValueError(
                        f"tensor {name!r} appears in both {file_of[name]} and {path.name}"
                    )
                file_of[name] = path.name
        return file_of

    def _open(self, file_name: str) -> Any:
        if file_name not in self._handles:
            path = self.model_dir / file_name
            try:
                handle = safe_open(str(path), "pt", device=str(self.device))
                handle.__enter__()
            except Exception as error:  # safetensors' own error types: a bad or cut-short file
                raise ValueError(f"{path} is not a readable safetensors file: {error}") from None
            self._handles[file_name] = handle
        return self._handles[file_name]

    def _unmap(self) -> None:
        """Close every file (a tensor still referenced keeps its own mapping alive); the next
        read reopens what it needs."""
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()
        self._bytes_since_unmap = 0

    def _count(self, tensor: torch.Tensor) -> torch.Tensor:
        num_bytes = tensor.numel() * tensor.element_size()
        self._bytes_since_unmap += num_bytes
        self.num_bytes_read += num_bytes
        if self.on_read is not None:
            self.on_read(self.tensors_read[-1])
        return tensor

    def open_all(self) -> None:
        """Open every file now: a truncated or corrupt one fails here, before any weight."""
        for file_name in sorted(set(self._file_of.values())):
            self._open(file_name)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._unmap()

    def names(self) -> set[str]:
        return set(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def file_of(self, name: str) -> str:
        """The file (shard) that holds tensor `name`."""
        return self._file(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._file(name)).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype, in safetensors' spelling ("BF16", "F8_E4M3", ...), from the
        header alone."""
        return self._open(self._file(name)).get_slice(name).get_dtype()

    def read(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole tensor `name`, after checking it has `shape`."""
        self.check_shape(name, shape)
        if self._bytes_since_unmap >= MAX_MAPPED_BYTES:
            self._unmap()
        self.tensors_read.append(name)
        return self._count(self._open(self._file(name)).get_tensor(name))

    def read_row(self, name: str, row: int) -> torch.Tensor:
        """`name[row]` of a stacked tensor, reading only that row's bytes (check the whole
        tensor's shape with `check_shape` first)."""
        if self._bytes_since_unmap >= MAX_MAPPED_BYTES:
            self._unmap()
        self.tensors_read.append(f"{name}[{row}]")
        return self._count(self._open(self._file(name)).get_slice(name)[row])

    def require(self, name: str) -> None:
        """Raise ValueError naming `name` if the checkpoint lacks it (reads nothing)."""
        self._file(name)

    def _file(self, name: str) -> str:
        if name not in self._file_of:
            raise ValueError(f"checkpoint {self.model_dir} is missing tensor {name!r}")
        return self._file_of[name]

    def check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        actual = self.shape(name)
        if actual != tuple(shape):
            raise ValueError(
                f"tensor {name!r} in {self.model_dir} has shape {list(actual)}, "
                f"expected {list(shape)}"
            )


def build_model(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    ep_context: ExpertParallelContext | None = None,
    backends: Backends | None = None,
    max_decode_tokens: int = 256,
) -> MoECausalLM:
    """The model `config` describes, with empty weights, built by its architecture's module.

    backends: which implementation runs each op (None: `auto`'s choice for this dtype and
    device); a backend the model's attention kind lacks runs `torch`. max_decode_tokens: the
    most tokens a decode step holds (see `LayerOps.build`).
    """
    device = torch.device(device) if device is not None else None
    kind = config.attention_kind
    if backends is None:
        backends = resolve_backends({}, dtype, device, attention_kind=kind)
    ops = LayerOps.build(backends.for_attention_kind(kind), max_decode_tokens)
    architecture = get_architecture(config.model_type)
    model = architecture.build(config, dtype, device, ep_context or ExpertParallelContext(), ops)
    model.use_linear_kernel(ops.linear)
    return model


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    ep_context: ExpertParallelContext | None = None,
    backends: Backends | None = None,
    max_decode_tokens: int = 256,
) -> MoECausalLM:
    """Build the model described by `model_dir/config.json` and load this rank's weights,
    logging the progress over its shards to the rank's log."""
    config = load_config(model_dir)
    model = build_model(config, dtype, device, ep_context, backends, max_decode_tokens)
    context = ep_context or ExpertParallelContext()
    with CheckpointReader(model_dir, device) as reader:
        planned = planned_reads(config, reader, context)
        with ShardProgress(reader, planned, get_logger(context.rank)):
            load_weights(model, reader, context)
    model.pack_linears()
    return model


def planned_reads(
    config: ModelConfig, reader: CheckpointReader, ep_context: ExpertParallelContext
) -> list[str]:
    """What `load_weights` will read for rank `ep_context.rank`, in order, as
    `reader.tensors_read` records it (a name, or `name[e]` for expert e's row of a fused
    tensor), from the headers alone: every dense tensor, the hosted experts' tensors, and a
    block-FP8 weight's scales after it."""
    layout = get_architecture(config.model_type).layout(config)
    reads: list[str] = []

    def weight(name: str) -> None:
        reads.append(name)
        if is_quantized(reader, config.quantization, name):
            assert config.quantization is not None
            reads.append(config.quantization.scale_name(name))

    for name in layout.dense_tensor_shapes():
        weight(_source_name(layout, reader, name))
    hosted = ep_context.resolve_placement(config.num_experts).hosted_logical(ep_context.rank)
    for layer_idx in config.moe_layer_indices:
        names = layout.expert_names(layer_idx)
        if reader.has(names.fused_gate_up) or reader.has(names.fused_down):
            for expert in hosted:
                reads += [f"{names.fused_gate_up}[{expert}]", f"{names.fused_down}[{expert}]"]
            continue
        for expert in hosted:
            for name in names.per_expert(expert):
                weight(name)
    return reads


class ShardProgress:
    """A rank's progress over the shards it reads from, in its log: a shard counts as done
    once every tensor the rank reads from it (`planned`, see `planned_reads`) has been read.
    One tqdm line every `PROGRESS_INTERVAL_S` while the load lasts (none for a quicker one),
    then one line with the shards, the bytes read and the time. A context manager; it hooks
    itself into `reader.on_read`."""

    def __init__(self, reader: CheckpointReader, planned: list[str], log: Any) -> None:
        self.reader = reader
        self.log = log
        self._left = Counter(reader.file_of(entry.partition("[")[0]) for entry in planned)
        self.num_shards = len(self._left)
        self._start = time.monotonic()
        self._bar = tqdm(
            total=self.num_shards,
            desc=f"loading {reader.model_dir.name}",
            unit="shard",
            file=_LogLines(log),
            mininterval=PROGRESS_INTERVAL_S,
            delay=PROGRESS_INTERVAL_S,
            ncols=100,
            ascii=True,
            leave=False,
        )

    def __enter__(self) -> ShardProgress:
        self.reader.on_read = self._read
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.reader.on_read = None
        self._bar.close()
        if exc_type is None:
            self.log.info(
                "loaded its weights: %d of %d shard(s) of %s, %s read in %.1f s",
                self._bar.n,
                self.num_shards,
                self.reader.model_dir,
                _size(self.reader.num_bytes_read),
                time.monotonic() - self._start,
            )

    def _read(self, entry: str) -> None:
        shard = self.reader.file_of(entry.partition("[")[0])
        self._left[shard] -= 1
        if self._left[shard] == 0:
            self._bar.set_postfix_str(_size(self.reader.num_bytes_read), refresh=False)
            self._bar.update(1)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


class _LogLines(io.TextIOBase):
    """tqdm's output as log lines: a log has no carriage returns, so each refresh of the bar
    becomes a line of its own (at most one per `PROGRESS_INTERVAL_S`)."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self._last = ""

    def write(self, text: str) -> int:
        line = text.strip("\r\n ")
        if line and line != self._last:
            self.log.info("%s", line)
            self._last = line
        return len(text)


def load_weights(
    model: MoECausalLM, reader: CheckpointReader, ep_context: ExpertParallelContext
) -> None:
    """Copy every dense tensor and this rank's hosted experts from `reader` into `model`."""
    config = model.config
    layout = get_architecture(config.model_type).layout(config)
    params = dict(model.named_parameters(remove_duplicate=False))
    expected: set[str] = set()
    filled: set[str] = set()
    for name, shape in layout.dense_tensor_shapes().items():
        source = _source_name(layout, reader, name)
        expected.add(source)
        target, rows = layout.parameter_for(name)
        weight = read_weight(reader, config.quantization, source, shape, params[target].dtype)
        with torch.no_grad():
            params[target][rows].copy_(weight)
        del weight  # before the next read: at most one tensor's copy is alive at a time
        filled.add(target)
    for layer_idx in config.moe_layer_indices:
        expected |= _load_layer_experts(model, layout, reader, layer_idx, ep_context)
    _check_no_extra_tensors(config, layout, reader, expected | _scale_names(config, expected))
    if config.tie_word_embeddings:
        filled.add("lm_head.weight")
    unfilled = [
        n for n in params if n not in filled and ".mlp.experts." not in n and "rotary" not in n
    ]
    assert not unfilled, f"parameters with no checkpoint mapping: {unfilled}"


def read_weight(
    reader: CheckpointReader,
    quantization: BlockFP8Format | None,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Checkpoint tensor `name`, checked to have `shape`: a block-FP8 weight read with its
    scales and dequantized to `dtype`; any other tensor as stored (the caller's copy into its
    parameter converts it, with no second copy)."""
    reader.check_shape(name, shape)
    if not is_quantized(reader, quantization, name):
        return reader.read(name, shape)
    assert quantization is not None
    weight = reader.read(name, shape)
    scale_inv = reader.read(quantization.scale_name(name), quantization.scale_shape(shape))
    return block_fp8.dequantize(weight, scale_inv, quantization.block_size, dtype)


def is_quantized(reader: CheckpointReader, quantization: BlockFP8Format | None, name: str) -> bool:
    """Whether `name` is a block-FP8 weight, from the headers alone (`block_fp8.is_quantized`:
    ValueError naming the tensor for one the format cannot read)."""
    scale_name = name + block_fp8.SCALE_SUFFIX
    scale = (reader.dtype(scale_name), reader.shape(scale_name)) if reader.has(scale_name) else None
    return block_fp8.is_quantized(quantization, name, reader.dtype(name), reader.shape(name), scale)


def _scale_names(config: ModelConfig, names: set[str]) -> set[str]:
    """The scale tensors `names` may have (every rank checks the tensors it does not read
    against these; `check_checkpoint` checked each one before any rank started)."""
    if config.quantization is None:
        return set()
    return {config.quantization.scale_name(name) for name in names}


def _load_layer_experts(
    model: MoECausalLM,
    layout: CheckpointLayout,
    reader: CheckpointReader,
    layer_idx: int,
    context: ExpertParallelContext,
) -> set[str]:
    """Load the hosted experts of one layer; return every expert tensor name of the layer."""
    config = model.config
    experts = model.model.layers[layer_idx].mlp.experts
    assert isinstance(experts, MoELayer)
    names = layout.expert_names(layer_idx)
    hosted = context.resolve_placement(config.num_experts).hosted_logical(context.rank)
    for expert, gate, up, down in read_experts(reader, config, layer_idx, hosted, model.dtype):
        experts.load_expert(expert, gate, up, down)
    if reader.has(names.fused_gate_up) or reader.has(names.fused_down):
        return {names.fused_gate_up, names.fused_down}
    for expert in range(config.num_experts):
        for name in names.per_expert(expert):
            # Presence only (no read): a checkpoint missing any expert is broken on some rank,
            # so every rank reports it rather than just the one hosting it.
            reader.require(name)
    return {name for e in range(config.num_experts) for name in names.per_expert(e)}


def read_experts(
    reader: CheckpointReader,
    config: ModelConfig,
    layer_idx: int,
    experts: Iterable[int],
    dtype: torch.dtype,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The weights of the given logical experts of decoder layer `layer_idx`, one expert at a
    time: (expert, gate [I, D], up [I, D], down [D, I]) in the Hugging Face layout, checked
    against the config's shapes. Reads only those experts' bytes (one row each of a fused
    [E, ...] tensor, or their own tensors); block-FP8 weights come dequantized to `dtype`,
    others as stored. Used at load and by EPLB, which reads the experts newly assigned to a
    rank while it serves."""
    layout = get_architecture(config.model_type).layout(config)
    names = layout.expert_names(layer_idx)
    gate_shape, up_shape, down_shape = layout.expert_shapes()
    size, num_experts = gate_shape[0], config.num_experts
    if reader.has(names.fused_gate_up) or reader.has(names.fused_down):
        reader.check_shape(names.fused_gate_up, (num_experts, 2 * size, gate_shape[1]))
        reader.check_shape(names.fused_down, (num_experts, *down_shape))
        for name in (names.fused_gate_up, names.fused_down):
            is_quantized(reader, config.quantization, name)  # raises for FP8: not a release form
        for expert in experts:
            gate_up = reader.read_row(names.fused_gate_up, expert)
            down = reader.read_row(names.fused_down, expert)
            yield expert, gate_up[:size], gate_up[size:], down
        return
    for expert in experts:
        gate_name, up_name, down_name = names.per_expert(expert)
        yield (
            expert,
            read_weight(reader, config.quantization, gate_name, gate_shape, dtype),
            read_weight(reader, config.quantization, up_name, up_shape, dtype),
            read_weight(reader, config.quantization, down_name, down_shape, dtype),
        )


def _check_no_extra_tensors(
    config: ModelConfig, layout: CheckpointLayout, reader: CheckpointReader, expected: set[str]
) -> None:
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    extra = sorted(
        name
        for name in reader.names() - expected
        if name not in ignorable
        and not name.endswith("rotary_emb.inv_freq")
        and not layout.ignored(name)
    )
    if extra:
        shown = extra[:_MAX_NAMES_IN_ERROR]
        more = f" (and {len(extra) - len(shown)} more)" if len(extra) > len(shown) else ""
        raise ValueError(
            f"checkpoint {reader.model_dir} has {len(extra)} tensor(s) the {config.model_type} "
            f"model does not use: {shown}{more}"
        )


def check_checkpoint(model_dir: str | Path) -> ModelConfig:
    """What can be checked about a checkpoint without reading a weight, for the driver to do
    before any rank starts: config.json parses for a supported architecture (and a supported
    `quantization_config`), every file opens (not truncated or corrupt), every tensor the
    config implies is there with its shape, every block-FP8 weight is float8_e4m3fn with its
    scales of the right shape (and no tensor is FP8 without them), and there is no tensor it
    does not use. Raises ValueError or FileNotFoundError naming the problem in one line;
    returns the config."""
    config = load_config(model_dir)
    layout = get_architecture(config.model_type).layout(config)
    with CheckpointReader(model_dir) as reader:
        reader.open_all()
        expected = _expected_tensors(config, layout, reader)
        for name, shape in expected.items():
            reader.check_shape(name, shape)
        scales = {
            name + block_fp8.SCALE_SUFFIX
            for name in expected
            if is_quantized(reader, config.quantization, name)
        }
        _check_no_extra_tensors(config, layout, reader, set(expected) | scales)
    return config


def _expected_tensors(
    config: ModelConfig, layout: CheckpointLayout, reader: CheckpointReader
) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, under its name there, with its shape: what
    `load_weights` reads (all experts, where a rank reads only its own)."""
    expected = {
        _source_name(layout, reader, name): shape
        for name, shape in layout.dense_tensor_shapes().items()
    }
    gate_shape, up_shape, down_shape = layout.expert_shapes()
    num_experts = config.num_experts
    for layer_idx in config.moe_layer_indices:
        names = layout.expert_names(layer_idx)
        if reader.has(names.fused_gate_up) or reader.has(names.fused_down):
            expected[names.fused_gate_up] = (num_experts, 2 * gate_shape[0], gate_shape[1])
            expected[names.fused_down] = (num_experts, *down_shape)
            continue
        for expert in range(num_experts):
            shapes = (gate_shape, up_shape, down_shape)
            expected.update(zip(names.per_expert(expert), shapes, strict=True))
    return expected


def _source_name(layout: CheckpointLayout, reader: CheckpointReader, name: str) -> str:
    """The name a tensor has in this checkpoint: its own, or the first alias present."""
    return next((n for n in (name, *layout.aliases(name)) if reader.has(n)), name)
