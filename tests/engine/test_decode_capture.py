"""A decode step a GPU can replay: fixed shapes, no host sync, inputs in persistent buffers.

The runner's decode forward (`ModelRunner.decode_logits` over `DecodeInputs`) at DP=1 must
trace whole with `torch.compile(fullgraph=True)`, keep its shapes (so its graph) across a block
boundary, compile once per padded batch size, and run no op whose result the host must wait
for. The compile needs the bf16 model: `torch._grouped_mm`'s shape function (which Dynamo runs
on fake tensors) takes bf16 only, and the experts go through `grouped_mm`, the one expert path
without a host sync. Dynamo's own tracing is what proves the graph whole; the backend here
(`CapturedGraphs`) runs the traced graph as it is (no Inductor code generation, which would
cost minutes here and proves nothing more about capturability).

`fullgraph=True` alone does not exclude host syncs: torch 2.13's Dynamo traces `nonzero` and
`bincount` into the graph with a size the host reads at run time (an unbacked symbol). So the
backend also looks at every node's traced value and names any whose shape is data-dependent.

At DP=2 (a real gloo group) each rank's padded decode forward, its MoE rows exchanged in the
low-latency mode, must run no such op either, and give a single process's logits.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from model_fixtures import TINY_SIZES
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._python_dispatch import TorchDispatchMode

from dist_engine.attention.decode_inputs import DecodeInputs
from dist_engine.attention.metadata import AttentionMetadata
from dist_engine.backends import Backends, RegimeChoice
from dist_engine.distributed.spawn import run_multirank
from dist_engine.engine.runner import ModelRunner
from dist_engine.layers.moe import ExpertParallelContext
from dist_engine.models.loader import load_model
from dist_engine.models.make_model import make_tiny_checkpoint
from moe import ExpertPlacement

BLOCK_SIZE = 4
CAPTURE_BACKENDS = Backends(
    RegimeChoice("torch", "torch"),
    RegimeChoice("grouped_mm", "grouped_mm"),
    RegimeChoice("torch", "torch"),
)


class DataDependentOps(TorchDispatchMode):
    """Every op that reaches the dispatcher whose output shape or value the host must read:
    each is a device sync on a GPU, and breaks a graph. A CPU `.tolist()` never reaches the
    dispatcher, so `Tensor.tolist` is counted at the Python level too."""

    FLAGGED = frozenset(
        {
            "nonzero",
            "argwhere",
            "_local_scalar_dense",  # .item(), int(t), bool(t)
            "is_nonzero",
            "equal",
            "bincount",
            "masked_select",
            "masked_scatter",
            "unique",
            "_unique",
            "_unique2",
            "unique_dim",
            "unique_consecutive",
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in self.FLAGGED:
            self.found.append(name)
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.found.append("repeat_interleave without output_size")
        elif name in ("index", "index_put", "index_put_") and _has_bool_index(args[1]):
            self.found.append(f"{name} with a boolean mask")
        return func(*args, **kwargs)


def _has_bool_index(indices) -> bool:
    return any(i is not None and i.dtype == torch.bool for i in indices)


class CapturedGraphs:
    """A torch.compile backend that keeps each graph Dynamo traced and runs it unchanged."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs):
        self.graphs.append(graph)
        return graph.forward

    def data_dependent_nodes(self) -> list[str]:
        """Nodes whose traced shape or value is known only at run time, i.e. read by the host:
        by the op they call, or by an unbacked symbol in what they produce."""
        flagged = DataDependentOps.FLAGGED | {"item", "tolist", "_assert_scalar"}
        return [
            node.format_node()
            for graph in self.graphs
            for node in graph.graph.nodes
            if _target_name(node.target) in flagged
            or free_unbacked_symbols(node.meta.get("example_value"))
        ]


def _target_name(target) -> str:
    if isinstance(target, str):  # call_method, placeholder, ...
        return target
    packet = getattr(target, "overloadpacket", None)  # an aten op
    return getattr(packet or target, "__name__", "")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(
        "qwen3_moe", tmp_path_factory.mktemp("capture"), seed=11, **TINY_SIZES, num_layers=2
    )


def capture_runner(
    model_dir, dtype: torch.dtype, ep_context: ExpertParallelContext | None = None
) -> ModelRunner:
    model = load_model(
        model_dir,
        dtype=dtype,
        ep_context=ep_context,
        backends=CAPTURE_BACKENDS,
        max_decode_tokens=8,
    )
    model.attach_kv_cache(model.new_kv_cache(64, BLOCK_SIZE))
    return ModelRunner(
        model, BLOCK_SIZE, max_model_len=64, max_num_seqs=8, decode_batch_sizes=(4, 8)
    )


def decode_step(runner: ModelRunner, cached: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    """A decode step of len(cached) sequences, sequence b with cached[b] tokens in its blocks
    (3 + 4b onwards), through the runner's persistent buffers."""
    tables = [[3 + 4 * b + column for column in range(4)] for b in range(len(cached))]
    token_ids = [(7 * b + 5) % TINY_SIZES["vocab_size"] for b in range(len(cached))]
    assert runner.decode_inputs is not None
    return runner.decode_inputs.fill(token_ids, tables, cached)


def test_decode_forward_compiles_whole_once_per_batch_size(model_dir) -> None:
    """Two padded batch sizes (3 → 4 rows, 6 → 8), each across a block boundary (the longest
    context from 3 blocks to 4): one graph per batch size, no break, no other recompile."""
    torch._dynamo.reset()
    runner = capture_runner(model_dir, torch.bfloat16)
    captured = CapturedGraphs()
    compiled = torch.compile(runner.decode_logits, backend=captured, fullgraph=True, dynamic=False)
    steps = [[11, 5, 2], [12, 6, 3], [11, 1, 2, 9, 10, 4], [12, 2, 3, 10, 11, 5]]
    shapes = []
    for cached in steps:
        ids, attn = decode_step(runner, cached)
        shapes.append(tuple(attn.block_tables.shape))
        expected = runner.decode_logits(ids, attn)
        assert torch.equal(compiled(ids, attn), expected)
    assert shapes == [(4, 4), (4, 4), (8, 4), (8, 4)]
    assert len(captured.graphs) == 2, len(captured.graphs)
    assert captured.data_dependent_nodes() == []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for cached in ([13, 6, 3], [14, 2, 3, 12, 13, 5]):  # both sizes again, one more token
            compiled(*decode_step(runner, cached))
    torch._dynamo.reset()


def recorded_decode(
    runner: ModelRunner, ids: torch.Tensor, attn: AttentionMetadata
) -> tuple[list[str], list[tuple[int, ...]], torch.Tensor]:
    """`runner.decode_logits` under `DataDependentOps`, with `Tensor.tolist` counted too (a
    CPU `.tolist()` never reaches the dispatcher): (flagged ops, tolist shapes, logits)."""
    tolist_calls: list[tuple[int, ...]] = []
    tolist = torch.Tensor.tolist

    def counting_tolist(tensor: torch.Tensor):
        tolist_calls.append(tuple(tensor.shape))
        return tolist(tensor)

    torch.Tensor.tolist = counting_tolist
    try:
        with DataDependentOps() as recorder:
            logits = runner.decode_logits(ids, attn)
    finally:
        torch.Tensor.tolist = tolist
    return recorder.found, tolist_calls, logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_forward_has_no_data_dependent_op(model_dir, dtype) -> None:
    runner = capture_runner(model_dir, dtype)
    found, tolist_calls, logits = recorded_decode(runner, *decode_step(runner, [11, 5, 2]))
    assert found == [] and tolist_calls == [], (found, tolist_calls)
    assert logits.shape == (4, TINY_SIZES["vocab_size"]) and torch.isfinite(logits).all()


# Each rank's decode batch in the EP group: 3 rows padded to 4 on rank 0, 5 padded to 8 on
# rank 1 (ranks pad independently; the low-latency dispatch's capacity is the same on both).
EP_BATCHES = ([11, 5, 2], [7, 3, 9, 4, 6])


def ep_decode_worker(rank: int, world_size: int, model_dir) -> dict:
    """One rank of a DP=2 group (gloo, as NCCL would be on GPUs: the exchange is a dispatcher
    op, unlike the shared-memory one): its padded decode forward, experts dispatched over the
    group in the low-latency mode, recorded for data-dependent ops, in both dtypes."""
    num_experts = TINY_SIZES["num_experts"]
    context = ExpertParallelContext(
        placement=ExpertPlacement.even(num_experts, world_size),
        rank=rank,
        group=dist.group.WORLD,
        ll_max_tokens_per_rank=8,
    )
    report: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        runner = capture_runner(model_dir, dtype, context)
        report[str(dtype)] = recorded_decode(runner, *decode_step(runner, EP_BATCHES[rank]))
    return report


@pytest.mark.multirank
def test_ep_decode_forward_has_no_data_dependent_op(model_dir) -> None:
    """At DP=2 the decode forward exchanges every MoE layer's rows with the other rank
    (fixed-capacity buffers, equal splits): still no op the host waits for, and the real rows'
    logits are a single process's."""
    reports = run_multirank(2, ep_decode_worker, (model_dir,), timeout_s=120)
    for rank, cached in enumerate(EP_BATCHES):
        for dtype in (torch.float32, torch.bfloat16):
            found, tolist_calls, logits = reports[rank][str(dtype)]
            assert found == [] and tolist_calls == [], (rank, dtype, found, tolist_calls)
            assert logits.shape == (4 if rank == 0 else 8, TINY_SIZES["vocab_size"])
            assert torch.isfinite(logits).all()
        reference = capture_runner(model_dir, torch.float32)  # a cache of its own, as the rank's
        expected = reference.decode_logits(*decode_step(reference, cached))[: len(cached)]
        logits = reports[rank][str(torch.float32)][2][: len(cached)]
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


def test_recorder_flags_the_ops_that_wait_for_the_host() -> None:
    values = torch.tensor([0, 2, 2, 5])
    with DataDependentOps() as recorder:
        values[0].item()
        torch.bincount(values)
        values.nonzero()
        values[values > 1]
        values.repeat_interleave(values)
        values.repeat_interleave(values, output_size=9)  # a known size: no sync
        torch.bincount(values, minlength=6)  # still sizes itself from the largest value
    assert recorder.found == [
        "_local_scalar_dense",
        "bincount",
        "nonzero",
        "index with a boolean mask",
        "repeat_interleave without output_size",
        "bincount",
    ]


def test_decode_inputs_match_the_metadata_builder_and_pad_on_block_zero() -> None:
    """The persistent buffers hold what `AttentionMetadata.build` would for the real rows,
    at the bucketed width; pad rows are token 0 at position 0 of block 0; the same batch size
    and width reuse the same memory."""
    inputs = DecodeInputs(max_num_seqs=6, max_columns=8, block_size=4, batch_sizes=(2, 8))
    tables = [[5, 9, 2], [7], [4, 3]]
    cached = [9, 2, 4]
    ids, attn = inputs.fill([11, 12, 13], tables, cached)
    built = AttentionMetadata.build(tables, cached, [1, 1, 1], 4, False, None, 4)
    assert ids.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert attn.num_tokens == 8 and attn.attn_mask is None and attn.max_query_len == 1
    for name in ("positions", "slot_mapping", "num_cached_tokens", "context_lens"):
        real = getattr(attn, name)[:3]
        assert torch.equal(real, getattr(built, name)), name
        assert getattr(attn, name)[3:].tolist() == [1 if name == "context_lens" else 0] * 5
    assert torch.equal(attn.block_tables[:3], built.block_tables)
    assert not attn.block_tables[3:].any()
    assert attn.query_start_loc.tolist() == list(range(9))
    assert attn.token_seq_idx.tolist() == list(range(8))
    assert not attn.token_query_idx.any()
    again_ids, again = inputs.fill([1, 2, 3, 4], [[6], [7], [8], [9, 10, 11, 1]], [0, 1, 2, 12])
    assert again.block_tables.shape == (8, 4)  # 13 tokens: 4 blocks, the same bucket
    assert again.block_tables.data_ptr() == attn.block_tables.data_ptr()
    assert again_ids.data_ptr() == ids.data_ptr()
    assert again.slot_mapping.tolist()[:4] == [24, 29, 34, 4]
    with pytest.raises(ValueError, match=r"decode step of 9 sequences; these buffers hold 1 to 8"):
        inputs.fill([0] * 9, [[1]] * 9, [0] * 9)
    with pytest.raises(ValueError, match=r"context of 6 tokens needs 2 blocks of 4"):
        inputs.fill([0], [[1]], [5])
    with pytest.raises(ValueError, match=r"must be >= 1 and reach max_num_seqs=6, got \[2, 4\]"):
        DecodeInputs(max_num_seqs=6, max_columns=8, block_size=4, batch_sizes=(2, 4))
