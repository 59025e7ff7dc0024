"""Decode steps replayed from graphs (`cuda_graphs`, dist_engine/engine/decode_graphs.py).

No CUDA here, so `ReplayedDecode` is driven through stand-in graphs. `RerunGraph` is what a
CUDA graph does with its inputs: it keeps the tensors it was captured with and, at each
replay, reruns the forward on whatever they hold then, into one output tensor. A step whose
inputs were not at the captured addresses (a `DecodeInputs` view that moved) would get another
step's logits, so the replayed steps matching the eager forward checks the address contract
that a CUDA graph relies on, across batch sizes and a block boundary. The other stand-ins
check `auto`'s decision and its fallbacks; the settings and the engine's refusals are checked
as a user meets them.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import yaml
from model_fixtures import TINY_SIZES

from dist_engine.attention.metadata import AttentionMetadata
from dist_engine.engine.config import EngineConfig
from dist_engine.engine.decode_graphs import ReplayedDecode, capture_sizes, graphs_refusal
from dist_engine.engine.runner import ModelRunner
from dist_engine.models.loader import load_model
from dist_engine.models.make_model import make_tiny_checkpoint
from launcher import LLM, SamplingParams
from launcher.cli import build_parser

BLOCK_SIZE = 4
LOG = logging.getLogger("lockstep.test_decode_graphs")


class RerunGraph:
    """A stand-in CUDA graph: replay reruns the forward on the captured tensors."""

    def __init__(self, forward, ids: torch.Tensor, attn: AttentionMetadata, shared) -> None:
        self.forward, self.ids, self.attn = forward, ids, attn
        self.output = forward(ids, attn).clone()
        self.replays = 0

    def replay(self) -> torch.Tensor:
        self.replays += 1
        self.output.copy_(self.forward(self.ids, self.attn))
        return self.output


class FrozenGraph(RerunGraph):
    """Replays in no time, giving the logits of the step it was captured at."""

    def replay(self) -> torch.Tensor:
        return self.output


class WrongGraph(RerunGraph):
    def replay(self) -> torch.Tensor:
        return self.output + 1.0


def failing_graph(forward, ids, attn, shared):
    raise RuntimeError("operation not permitted when stream is capturing")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(
        "qwen3_moe", tmp_path_factory.mktemp("graphs"), seed=5, **TINY_SIZES, num_layers=2
    )


def padded_runner(model_dir) -> ModelRunner:
    model = load_model(model_dir, max_decode_tokens=8)
    model.attach_kv_cache(model.new_kv_cache(64, BLOCK_SIZE))
    return ModelRunner(
        model, BLOCK_SIZE, max_model_len=64, max_num_seqs=8, decode_batch_sizes=capture_sizes(8)
    )


def fill(runner: ModelRunner, cached: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    """A decode step of len(cached) sequences, sequence b with cached[b] tokens in its blocks
    (3 + 4b onwards)."""
    tables = [[3 + 4 * b + column for column in range(4)] for b in range(len(cached))]
    token_ids = [(11 * b + 7 * sum(cached)) % TINY_SIZES["vocab_size"] for b in range(len(cached))]
    assert runner.decode_inputs is not None
    return runner.decode_inputs.fill(token_ids, tables, cached)


def test_capture_sizes_pad_every_batch_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(64) == (1, 2, 4, *range(8, 65, 8))
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        capture_sizes(0)


def test_graphs_are_refused_where_they_cannot_run() -> None:
    assert graphs_refusal("cuda", 1, False) is None
    assert "CUDA device" in graphs_refusal(None, 1, False)
    assert "CUDA device" in graphs_refusal("cpu", 1, False)
    assert "DP = 1" in graphs_refusal("cuda:0", 2, False)
    assert "EPLB" in graphs_refusal("cuda", 1, True)


def test_replays_give_the_eager_logits_across_sizes_and_a_block_boundary(model_dir) -> None:
    """Mode `on`: one graph per (Bp, MB), each replay on the step's own inputs."""
    runner = padded_runner(model_dir)
    replayed = ReplayedDecode(runner.decode_logits, "on", LOG, make_graph=RerunGraph)
    steps = [[5, 2, 9], [6, 3, 10], [11, 12, 3], [12, 13, 4], [1, 2, 3, 4, 5], [2, 3, 4, 5, 6]]
    keys = []
    for cached in steps:
        ids, attn = fill(runner, cached)
        keys.append((ids.shape[0], attn.block_tables.shape[1]))
        expected = runner.decode_logits(ids, attn).clone()
        assert torch.equal(replayed(ids, attn), expected), cached
    # 3 rows pad to 4; the longest context crosses from 3 blocks (2 columns) to 4 (4 columns).
    assert keys == [(4, 4), (4, 4), (4, 4), (4, 4), (8, 2), (8, 2)]
    assert sorted(replayed.graphs) == [(4, 4), (8, 2)]
    assert [g.replays for g in replayed.graphs.values()] == [4, 2]


def test_a_step_at_moved_inputs_would_be_caught(model_dir) -> None:
    """The contract the test above holds `DecodeInputs` to, shown able to fail: a step whose
    inputs sit elsewhere than the captured tensors gets what those hold, not its own logits."""
    runner = padded_runner(model_dir)
    replayed = ReplayedDecode(runner.decode_logits, "on", LOG, make_graph=RerunGraph)
    replayed(*fill(runner, [5, 2, 9]))
    ids, attn = fill(runner, [6, 3, 10])
    moved = dataclasses.replace(
        attn,
        **{
            f.name: getattr(attn, f.name).clone()
            for f in dataclasses.fields(attn)
            if isinstance(getattr(attn, f.name), torch.Tensor)
        },
    )
    moved_ids = ids.clone()
    expected = runner.decode_logits(moved_ids, moved).clone()
    fill(runner, [1, 4, 2])  # the captured buffers now hold another step
    assert not torch.equal(replayed(moved_ids, moved), expected)


def test_auto_keeps_graphs_that_match_and_are_faster(model_dir, caplog) -> None:
    runner = padded_runner(model_dir)
    replayed = ReplayedDecode(
        runner.decode_logits, "auto", LOG, make_graph=FrozenGraph, synchronize=lambda: None
    )
    ids, attn = fill(runner, [5, 2, 9])
    expected = runner.decode_logits(ids, attn).clone()
    with caplog.at_level(logging.INFO, logger=LOG.name):
        assert torch.equal(replayed(ids, attn), expected)
    assert replayed.enabled is True and list(replayed.graphs) == [(4, 4)]
    assert replayed.decision.startswith("graphs on: a replay took")
    assert "cuda_graphs auto: graphs on" in caplog.text


@pytest.mark.parametrize(
    ("make_graph", "why", "level"),
    [
        (RerunGraph, "graphs off: a replay took", logging.INFO),  # slower than the eager one
        (WrongGraph, "graphs off: a replay's logits were 1 from", logging.WARNING),
        (failing_graph, "graphs off: capturing the decode step failed", logging.WARNING),
    ],
)
def test_auto_falls_back_to_the_eager_forward(model_dir, caplog, make_graph, why, level) -> None:
    runner = padded_runner(model_dir)
    replayed = ReplayedDecode(
        runner.decode_logits, "auto", LOG, make_graph=make_graph, synchronize=lambda: None
    )
    if make_graph is RerunGraph:  # a rerun plus a copy: slower than the forward alone
        replayed._time = lambda run: 2.0 if run.__name__ == "replay" else 1.0
    with caplog.at_level(logging.INFO, logger=LOG.name):
        for cached in ([5, 2, 9], [6, 3, 10], [1, 2, 3, 4, 5]):
            ids, attn = fill(runner, cached)
            expected = runner.decode_logits(ids, attn).clone()
            assert torch.equal(replayed(ids, attn), expected)
    assert replayed.enabled is False and replayed.graphs == {}
    assert replayed.decision.startswith(why), replayed.decision
    (record,) = [r for r in caplog.records if "cuda_graphs auto" in r.getMessage()]
    assert record.levelno == level


def test_a_capture_that_fails_under_on_leaves_the_eager_forward(model_dir, caplog) -> None:
    runner = padded_runner(model_dir)
    replayed = ReplayedDecode(runner.decode_logits, "on", LOG, make_graph=failing_graph)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        for cached in ([5, 2, 9], [1, 2, 3, 4, 5]):
            ids, attn = fill(runner, cached)
            expected = runner.decode_logits(ids, attn).clone()
            assert torch.equal(replayed(ids, attn), expected)
    assert replayed.enabled is False
    (record,) = [r for r in caplog.records if "cuda_graphs" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "cuda_graphs on: graphs off: capturing a decode step of batch 4, 4 block columns" in (
        record.getMessage()
    )


def test_the_setting_and_vllm_enforce_eager() -> None:
    assert EngineConfig(model="m").cuda_graphs == "off"
    with pytest.raises(ValueError, match="cuda_graphs must be one of"):
        EngineConfig(model="m", cuda_graphs="yes")
    # YAML (a config file, --set) reads a bare on / off as a boolean.
    for text, mode in (("on", "on"), ("off", "off"), ("true", "on"), ("auto", "auto")):
        assert (
            EngineConfig.from_dict(yaml.safe_load(f"{{model: m, cuda_graphs: {text}}}")).cuda_graphs
            == mode
        )
    parser, _ = build_parser()
    args = parser.parse_args(["serve", "m", "--cuda-graphs", "auto"])
    assert getattr(args, "setting:cuda_graphs") == "auto"
    args = parser.parse_args(["serve", "m", "--cuda-graphs", "on", "--enforce-eager"])
    assert getattr(args, "setting:cuda_graphs") == "off"


def test_graphs_on_a_cpu_engine(model_dir, caplog) -> None:
    """`on` is refused before the model loads, with the reason; `auto` runs eager and says so,
    with the same tokens as `off`."""
    with pytest.raises(Exception, match="cuda_graphs is 'on', but CUDA graphs need a CUDA"):
        LLM(model=str(model_dir), launcher="local", cuda_graphs="on")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    outputs = {}
    for mode in ("off", "auto"):
        with (
            caplog.at_level(logging.INFO),
            LLM(model=str(model_dir), launcher="local", cuda_graphs=mode) as llm,
        ):
            got = llm.generate(prompts, params, use_tqdm=False)
            outputs[mode] = [o.output_token_ids for o in got]
    assert outputs["auto"] == outputs["off"]
    assert "cuda_graphs auto: off (CUDA graphs need a CUDA device)" in caplog.text


def test_on_is_refused_by_the_driver_before_a_group_starts(model_dir, monkeypatch) -> None:
    """What the driver knows (the group's size, EPLB, a CPU group) refuses `on` before any
    rank starts, with the ranks' own reason; a Ray group's GPUs are the ranks' to find."""
    import launcher.ray_launcher as ray_launcher
    from launcher.llm import check_cuda_graphs

    def started(*args, **kwargs):
        raise AssertionError("a group started")

    monkeypatch.setattr(ray_launcher.RayClient, "__init__", started)
    with pytest.raises(ValueError, match=r"cuda_graphs is 'on', but .* DP = 1 only"):
        LLM(model=str(model_dir), launcher="ray", dp_size=2, cuda_graphs="on")
    config = EngineConfig(model="m", cuda_graphs="on")
    check_cuda_graphs(config)  # Ray's ranks may have GPUs: theirs to say
    with pytest.raises(ValueError, match="EPLB"):
        check_cuda_graphs(config.with_overrides(**{"moe.enable_eplb": True}))
    with pytest.raises(ValueError, match="need a CUDA device"):
        check_cuda_graphs(config.with_overrides(**{"parallel.backend": "gloo"}))
    check_cuda_graphs(EngineConfig(model="m", cuda_graphs="auto", parallel={"dp_size": 2}))
