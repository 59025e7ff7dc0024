"""Decode steps replayed from CUDA graphs (the `cuda_graphs` setting).

A decode step's forward (`ModelRunner.decode_logits`) has fixed shapes for a given padded batch
Bp and block-table width MB, runs no op the host waits for, and reads its inputs from
persistent buffers at fixed addresses (`DecodeInputs`; tests/engine/test_decode_capture.py
holds it to that). So on a GPU it can be captured once per (Bp, MB) and replayed: one launch
of the recorded kernels instead of the host issuing each of them, which is most of a small
model's decode step there.

`ReplayedDecode` captures a size the first time a step of that size comes (a capture costs
about one forward plus the warm-up forward before it), keeps one graph per size in a memory
pool they share, and replays. The logits a replay returns are the graph's own output tensor:
valid until the next replay, which is when the runner has sampled them (the sampler runs on
the same stream, so the next replay's kernels are queued after it).

`auto` decides at the first decode step: the first graph's replay must give the eager forward's
logits (an error while capturing, or logits apart, leaves graphs off, with a warning that says
why) and must be faster than the eager forward on the same inputs, timed over a few runs of
each; the decision is logged and kept. `on` uses the graphs without timing them. A capture that
fails, in either mode, leaves the eager forward for that step and every later one, with a
warning: a setting must not end the requests of a running group.

Where graphs apply: a CUDA device, DP = 1 (a group's MoE all-to-alls inside a captured forward
would need every rank to capture the same sizes at the same steps, which this does not
arrange yet), no EPLB (its per-step expert counts would count pad rows). Elsewhere `auto` is
off, and `on` is refused at start-up with the reason (`graphs_refusal`).

Not yet run on a GPU: the CPU tests drive this class through a stand-in graph that re-runs
the forward on the captured tensors (so they check the address contract, the keys, the
decision and its fallbacks), and scripts/gpu_check.sh compares tokens and times with graphs
off and on where a device is lent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from dist_engine.attention.metadata import AttentionMetadata

DecodeForward = Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]
_AUTO_RUNS = 5  # timed runs of each, eager and replayed, at the `auto` decision


def graphs_refusal(device: torch.device | str | None, dp_size: int, eplb: bool) -> str | None:
    """Why decode steps cannot be replayed from CUDA graphs here, or None where they can."""
    if device is None or torch.device(device).type != "cuda":
        return "CUDA graphs need a CUDA device"
    if dp_size > 1:
        return (
            "CUDA graphs run at DP = 1 only for now (a group's ranks would have to capture "
            "their MoE all-to-alls at the same steps)"
        )
    if eplb:
        return "CUDA graphs do not run with EPLB (its expert counts would count pad rows)"
    return None


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The padded batch sizes decode steps run at: 1, 2, 4, 8, then every multiple of 8 up to
    max_num_seqs, which is always one of them (a step pads to the next size)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {size for size in (1, 2, 4) if size < max_num_seqs}
    sizes.update(range(8, max_num_seqs, 8))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


class DecodeGraph(Protocol):
    """One captured decode forward: `replay()` reruns it on the tensors it was captured with
    (whatever they hold now) and returns its output tensor."""

    def replay(self) -> torch.Tensor: ...


# (forward, ids, attn, shared) -> a captured graph; `shared` is one dict per ReplayedDecode,
# for what its graphs share (the CUDA graphs' memory pool).
GraphFactory = Callable[[DecodeForward, torch.Tensor, AttentionMetadata, dict], DecodeGraph]


class CudaDecodeGraph:
    """A CUDA graph of `forward(ids, attn)`, captured into the memory pool of `shared`, which
    every size of one runner shares (its graphs replay one at a time, each output read before
    the next replay); another runner's graphs get a pool of their own."""

    def __init__(
        self, forward: DecodeForward, ids: torch.Tensor, attn: AttentionMetadata, shared: dict
    ):
        if "pool" not in shared:
            shared["pool"] = torch.cuda.graph_pool_handle()
        # Warm up off the capture (lazy initialisation, library workspaces, autotuning) on a
        # side stream, as a capture needs; it writes this step's K/V, which the replay writes
        # again with the same values.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(ids, attn)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls from the process's other threads do not void the capture.
        with torch.cuda.graph(self.graph, pool=shared["pool"], capture_error_mode="thread_local"):
            self.output = forward(ids, attn)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class ReplayedDecode:
    """`forward` (a decode step's, over `DecodeInputs` views) replayed from one graph per
    (Bp, MB). ``mode``: "on" or "auto" (see the module's doc); `auto`'s decision goes to
    ``log``. ``make_graph`` captures one graph; ``synchronize`` waits for the device (both the
    CUDA ones unless given)."""

    def __init__(
        self,
        forward: DecodeForward,
        mode: str,
        log: logging.Logger,
        make_graph: GraphFactory = CudaDecodeGraph,
        synchronize: Callable[[], None] = torch.cuda.synchronize,
    ) -> None:
        if mode not in ("on", "auto"):
            raise ValueError(f"ReplayedDecode mode must be 'on' or 'auto', got {mode!r}")
        self.forward = forward
        self.mode = mode
        self.log = log
        self.make_graph = make_graph
        self.synchronize = synchronize
        self.graphs: dict[tuple[int, int], DecodeGraph] = {}
        self.shared: dict = {}  # what this runner's graphs share (make_graph's `shared`)
        self.enabled: bool | None = True if mode == "on" else None  # auto: decided at first use
        self.decision = "graphs on (set)" if mode == "on" else ""

    def __call__(self, ids: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        if self.enabled is False:
            return self.forward(ids, attn)
        key = (ids.shape[0], attn.block_tables.shape[1])
        graph = self.graphs.get(key)
        if graph is None:
            if self.enabled is None:
                return self._decide(key, ids, attn)
            try:
                graph = self.make_graph(self.forward, ids, attn, self.shared)
                self.graphs[key] = graph
            except Exception as error:  # the step still runs, eagerly, and so do the next
                why = f"capturing a decode step of batch {key[0]}, {key[1]} block columns failed"
                return self._off(f"{why}: {error!r}", ids, attn, True)
        return graph.replay()

    def _decide(self, key: tuple[int, int], ids: torch.Tensor, attn: AttentionMetadata):
        """`auto`'s one decision, at the first decode step; returns that step's logits."""
        try:
            graph = self.make_graph(self.forward, ids, attn, self.shared)
            replayed = graph.replay().clone()
            eager = self.forward(ids, attn)
        except Exception as error:  # a capture that fails leaves the eager forward
            return self._off(f"capturing the decode step failed: {error!r}", ids, attn, True)
        if not torch.allclose(replayed, eager, rtol=1e-3, atol=1e-3):
            apart = (replayed - eager).abs().max().item()
            why = f"a replay's logits were {apart:.3g} from the eager forward's"
            return self._off(why, ids, attn, True)
        eager_s = self._time(lambda: self.forward(ids, attn))
        replay_s = self._time(graph.replay)
        if replay_s >= eager_s:
            return self._off(
                f"a replay took {1e3 * replay_s:.3f} ms against the eager forward's "
                f"{1e3 * eager_s:.3f} ms",
                ids,
                attn,
            )
        self.graphs[key] = graph
        self.enabled = True
        self.decision = (
            f"graphs on: a replay took {1e3 * replay_s:.3f} ms against the eager forward's "
            f"{1e3 * eager_s:.3f} ms at batch {key[0]}, {key[1]} block columns"
        )
        self.log.info("cuda_graphs auto: %s", self.decision)
        return graph.replay()

    def _off(
        self, why: str, ids: torch.Tensor, attn: AttentionMetadata, fault: bool = False
    ) -> torch.Tensor:
        """Graphs off for good (``fault``: for something that should not happen, a warning);
        this step's logits from the eager forward."""
        self.enabled = False
        self.graphs.clear()
        self.decision = f"graphs off: {why}"
        (self.log.warning if fault else self.log.info)(
            "cuda_graphs %s: %s", self.mode, self.decision
        )
        return self.forward(ids, attn)

    def _time(self, run: Callable[[], object]) -> float:
        """Median seconds of one run, device work included."""
        times = []
        for _ in range(_AUTO_RUNS):
            self.synchronize()
            start = time.perf_counter()
            run()
            self.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]
