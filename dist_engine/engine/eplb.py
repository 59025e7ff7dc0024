"""EPLB while serving: expert load measured in the forward, placements the group agrees on,
weights staged in the background and swapped at one agreed step.

Shape legend: L = MoE layers, E = logical experts, P = physical slots (E + redundant),
N = ranks, S = P / N slots per rank, M = experts new to a rank in one layer, D = hidden,
I = expert intermediate size.

Time is counted in *forward steps* F: steps that ran a forward (placeholders included), i.e.
every step but the known-empty ones and the shutdown step. The last vote decides both, so F is
the same on every rank, and so is everything below that is scheduled by it.

- Every forward step each MoE layer has counted the (token, choice) pairs it routed to each
  logical expert into one [L, E] tensor on the device (`MoELayer.count_load_into`); the
  balancer copies it into the `ExpertLoadWindow` and zeroes it: two device ops, no host sync.
- **Decision**, at F % eplb_interval_steps == 0 with no proposal pending: one SUM all-reduce
  of the window's [L, E] counts on the vote group (every rank then holds the group's load),
  `rebalance` over P slots (hierarchical when the ranks span several nodes), each layer's
  proposal reordered within each rank so that kept experts keep their slots
  (`keep_hosted_slots`), and `worth_adopting` — or the proposal is skipped. All of it is a
  function of the summed load and the current maps, so every rank decides alike.
- **Staging**, on a thread of its own: this rank takes the experts new to it into spare
  buffers [M, D, 2I] and [M, I, D] per layer, and puts the new maps on the device. They come
  from the group's *expert source* (`moe.eplb_expert_source`): "peer", a rank that holds them
  sends them (`moe.plan_transfers`: one plan every rank computes alike, each expert from the
  holder that sends least, layer by layer over a gloo group of EPLB's own,
  `distributed/groups.side_group`, so the step's collectives never wait behind a transfer);
  "checkpoint", the rank reads them (models/loader.py `read_experts`, block-FP8 dequantized
  there); "auto", the one the group measured faster as it formed (one expert each way on
  every rank; the slowest rank's rates decide). Staging writes nothing a step reads. Extra
  memory: the staged experts, M <= S per layer, so at most one more copy of this rank's
  expert weights (usually far less), held from the decision to the commit; a sender sends
  from its live slots (on a GPU through a host copy of one expert at a time).
- **Commit check**, at F = decision + 1, then after gaps of 2, 4, 8, ... forward steps (at
  most `_MAX_CHECK_GAP`): one MIN all-reduce of each rank's staging state. All ready: every
  layer adopts at this step boundary (`MoELayer.adopt`: the changed slots' weights copied in
  on the device, the maps rebound), so no forward ever sees half a placement. Any rank
  failed: the proposal is dropped everywhere, the old placement stays, and the failure is
  logged; nothing crashes. Otherwise the group looks again later.

Results do not change: the routing is untouched and every replica holds the same weights;
only which rank computes a (token, choice) pair moves, so a token's partial sums may group
differently, as between DP sizes (the multi-rank tests compare greedy tokens, across
rebalances, with a single-process reference).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dist_engine.distributed.plain_data import all_gather_json
from dist_engine.engine.config import MoEConfig
from dist_engine.engine.stats import RankExpertStats, as_replacement
from dist_engine.layers.moe import MoEBlock
from dist_engine.models.decoder import MoECausalLM
from dist_engine.models.loader import CheckpointReader, read_experts
from moe import (
    ExpertLoadWindow,
    ExpertPlacement,
    ExpertTransfer,
    MoELayer,
    StagedPlacement,
    balancedness,
    fill_expert,
    keep_hosted_slots,
    plan_transfers,
    rebalance,
    rebalance_gain,
    slot_moves,
    worth_adopting,
)
from scheduler import Vote

# A fault-injection point for tests (tests/launcher/test_heal.py): the first rank whose staging
# finds the file this names removes it and stops its own process (SIGSTOP) after reading its
# first layer's experts, so that a test can kill it half-way through a weight transfer.
STOP_IN_STAGING_ENV = "LOCKSTEP_STOP_IN_EPLB_STAGING"
# A rank's staging state in the commit check's MIN all-reduce.
_FAILED, _STAGING, _READY = -1, 0, 1
# Commit checks back off (gaps of 1, 2, 4, ... forward steps) up to this gap: a fast staging
# commits at once, a slow one costs one small collective per gap.
_MAX_CHECK_GAP = 64
# Gloo tags are C ints: the tags of proposal k's transfers start at k * (2 P L), k taken
# modulo this many (a wrap comes back to tags last used some 30,000 proposals ago).
_TAG_LIMIT = 2**30
# The start-up measurement of each expert source: the fastest of this many tries.
_PROBE_TRIES = 3


def initial_placement(settings: MoEConfig, num_experts: int, num_ranks: int) -> ExpertPlacement:
    """The placement a group starts with: the even one, or with EPLB's redundant slots
    (`ExpertPlacement.with_redundancy`). Raises ValueError naming the key when the slots
    cannot be split evenly over the ranks."""
    check_slots(settings, num_experts, num_ranks)
    redundant = settings.eplb_num_redundant_experts if settings.enable_eplb else 0
    return ExpertPlacement.with_redundancy(num_experts, num_ranks, redundant)


def check_slots(settings: MoEConfig, num_experts: int, num_ranks: int) -> None:
    """Every rank must hold as many slots: E + eplb_num_redundant_experts a multiple of N."""
    redundant = settings.eplb_num_redundant_experts if settings.enable_eplb else 0
    if (num_experts + redundant) % num_ranks == 0:
        return
    step = num_ranks
    fits = [r for r in range(0, 2 * step) if (num_experts + r) % num_ranks == 0][:2]
    if not settings.enable_eplb:
        raise ValueError(
            f"the model's {num_experts} experts do not split evenly over parallel.dp_size="
            f"{num_ranks} ranks; enable moe.enable_eplb with moe.eplb_num_redundant_experts "
            f"in {fits}, ... (every rank then holds as many slots), or change dp_size"
        )
    raise ValueError(
        f"moe.eplb_num_redundant_experts is {redundant}: the model's {num_experts} experts plus "
        f"the redundant slots ({num_experts + redundant}) must be a multiple of "
        f"parallel.dp_size={num_ranks}, so that every rank holds as many slots; allowed: "
        f"{fits[0]}, {fits[1]}, ... (steps of {step})"
    )


def moe_layers(model: MoECausalLM) -> list[MoELayer]:
    """The routed-expert layers of `model`, in layer order."""
    return [layer.mlp.experts for layer in model.model.layers if isinstance(layer.mlp, MoEBlock)]


def count_nodes(group: dist.ProcessGroup | None, rank: int, num_ranks: int) -> int:
    """How many nodes the group spans, for the hierarchical policy, which needs each node's
    ranks contiguous and equally many; 1 (the global policy) otherwise. Collective."""
    if group is None:
        return 1
    hosts = all_gather_json(socket.gethostname(), group)
    blocks = [hosts[0]]
    for host in hosts[1:]:
        if host != blocks[-1]:
            blocks.append(host)
    if len(set(blocks)) != len(blocks) or num_ranks % len(blocks):
        return 1  # a node's ranks are not contiguous: only the global policy is right
    per_node = num_ranks // len(blocks)
    if any(hosts[i] != hosts[i - i % per_node] for i in range(num_ranks)):
        return 1
    return len(blocks)


@dataclass
class _Proposal:
    """A placement being staged: decided at forward step `decided_at`, the same on every rank.
    The thread writes `staged`, `staging_s` and `error`, then `state` last."""

    decided_at: int
    step_index: int
    number: int  # proposals decided in this group before it, plus one (the transfers' tags)
    # The group its peer transfers run on: the one of the group it was decided in, even if a
    # re-formed group's join replaces the balancer's while this one's thread still runs.
    transfer: dist.ProcessGroup | None
    current: list[ExpertPlacement]
    proposed: list[ExpertPlacement]
    balancedness_before: list[float]
    balancedness_after: list[float]
    group_slots: int  # slots rewritten over the whole group
    decide_s: float
    next_check: int
    check_gap: int = 1
    cancel: threading.Event = field(default_factory=threading.Event)
    state: int = _STAGING
    staged: list[StagedPlacement] = field(default_factory=list)
    staging_s: float = 0.0
    num_bytes: int = 0  # expert weights this rank writes into its slots
    staged_bytes: int = 0  # of which written into spare buffers
    received_bytes: int = 0  # of which sent by peers
    error: str = ""


class ExpertBalancer:
    """EPLB for one rank's model. `after_forward` is called by the engine once per forward
    step, on every rank, after the step's outputs are out; it takes the group's collectives
    at the agreed steps (decision: a SUM all-reduce; commit check: a MIN vote)."""

    def __init__(
        self,
        settings: MoEConfig,
        model: MoECausalLM,
        model_dir: str,
        rank: int,
        num_ranks: int,
        group: dist.ProcessGroup | None,
        log: logging.Logger,
        num_nodes: int = 1,
        transfer_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("moe.enable_eplb is true but the model has no MoE layers")
        self.config = model.config
        self.layer_indices = [
            i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, MoEBlock)
        ]
        num_experts = self.config.num_experts
        self.num_physical = num_experts + settings.eplb_num_redundant_experts
        for layer in self.layers:
            placement = layer.placement
            if (placement.num_physical, placement.num_ranks) != (self.num_physical, num_ranks):
                raise ValueError(
                    f"the model's MoE layers have {placement.num_physical} slots over "
                    f"{placement.num_ranks} rank(s); moe.eplb_num_redundant_experts="
                    f"{settings.eplb_num_redundant_experts} needs {self.num_physical} over "
                    f"{num_ranks} (build the model with `initial_placement`)"
                )
        self.settings = settings
        self.model_dir = model_dir
        self.rank = rank
        self.num_ranks = num_ranks
        self.group = group
        self.log = log
        self.num_nodes = num_nodes
        self.num_groups = self.config.routing.num_groups
        self.device = self.layers[0].log2phy.device
        self.dtype = self.layers[0].experts.w13.dtype
        # Every layer counts into its row: one copy and one zero per step read them all.
        self.step_counts = torch.zeros(
            len(self.layers), num_experts, dtype=torch.int64, device=self.device
        )
        for row, layer in zip(self.step_counts, self.layers, strict=True):
            layer.count_load_into(row)
        self.window = ExpertLoadWindow(
            len(self.layers), num_experts, settings.eplb_window_steps, self.device
        )
        self.num_forward_steps = 0
        self.pending: _Proposal | None = None
        self.stats = RankExpertStats()
        self._stats_lock = threading.Lock()
        self.transfer = transfer_group
        self.source = "checkpoint"
        self.num_proposals = 0
        if group is not None:  # a replacement built before its group chooses at the join
            self._choose_source()

    # -- the step -----------------------------------------------------------------------------
    def after_forward(self, step_index: int, votes: Vote) -> str:
        """Record this forward step's counts; at the agreed steps decide or check the commit.
        Returns what happened, for the step trace: "" (nothing), "decided", "skipped",
        "waiting", "adopted" or "dropped"."""
        self.window.record(self.step_counts)
        self.step_counts.zero_()
        self.num_forward_steps += 1
        forward_step = self.num_forward_steps
        pending = self.pending
        if pending is not None:
            if forward_step < pending.next_check:
                return ""
            return self._check_commit(pending, step_index, votes)
        if forward_step % self.settings.eplb_interval_steps == 0:
            return self._decide(forward_step, step_index)
        return ""

    def _decide(self, forward_step: int, step_index: int) -> str:
        load = self.window.window_sum().cpu()  # the one host sync, at a decision step only
        if self.group is not None:
            dist.all_reduce(load, op=dist.ReduceOp.SUM, group=self.group)
        # The pause counts EPLB's own work, not the collectives' wait for the slowest rank.
        start = time.perf_counter()
        current = [layer.placement for layer in self.layers]
        result = rebalance(load, self.num_physical, self.num_groups, self.num_nodes, self.num_ranks)
        proposed = [keep_hosted_slots(current[i], result.placement(i)) for i in range(len(current))]
        before = [balancedness(load[i], p) for i, p in enumerate(current)]
        after = [balancedness(load[i], p) for i, p in enumerate(proposed)]
        skip = not worth_adopting(load, current, proposed)
        self._update_stats(
            balancedness=before,
            window_steps=self.window.num_steps,
            num_skipped=self.stats.num_skipped + skip,
        )
        if skip:
            if self.rank == 0:
                self.log.info(
                    "EPLB at step %d: kept the placement (balancedness %.3f; the proposal "
                    "would reach %.3f, removing %.1f%% of the busiest ranks' tokens)",
                    step_index,
                    statistics.fmean(before),
                    statistics.fmean(after),
                    100 * rebalance_gain(load, current, proposed),
                )
            return "skipped"
        changed = sum(
            int((p.phy2log != c.phy2log).sum()) for p, c in zip(proposed, current, strict=True)
        )
        self.num_proposals += 1
        proposal = _Proposal(
            decided_at=forward_step,
            step_index=step_index,
            number=self.num_proposals,
            transfer=self.transfer,
            current=current,
            proposed=proposed,
            balancedness_before=before,
            balancedness_after=after,
            group_slots=changed,
            decide_s=time.perf_counter() - start,
            next_check=forward_step + 1,
        )
        self.pending = proposal
        threading.Thread(
            target=self._stage, args=(proposal,), name="lockstep-eplb-staging", daemon=True
        ).start()
        return "decided"

    def _check_commit(self, proposal: _Proposal, step_index: int, votes: Vote) -> str:
        agreed = votes.allreduce_min([proposal.state])[0]
        start = time.perf_counter()
        if agreed == _STAGING:
            proposal.check_gap = min(2 * proposal.check_gap, _MAX_CHECK_GAP)
            proposal.next_check = self.num_forward_steps + proposal.check_gap
            return "waiting"
        self.pending = None
        if agreed == _FAILED:
            proposal.cancel.set()
            self._update_stats(num_failed=self.stats.num_failed + 1)
            self.log.warning(
                "EPLB: the placement decided at step %d was dropped (%s); the old one stays",
                proposal.step_index,
                f"staging failed here: {proposal.error}"
                if proposal.error
                else "another rank's staging failed",
            )
            return "dropped"
        for layer, staged in zip(self.layers, proposal.staged, strict=True):
            layer.adopt(staged)
            if self.device.type == "cuda":
                # Staged on the thread's stream, read on the step's: the allocator must not
                # hand this memory out again before the step's stream is done with it.
                stream = torch.cuda.current_stream(self.device)
                for tensor in (staged.w13, staged.w2, staged.log2phy, staged.logcnt):
                    tensor.record_stream(stream)
        proposal.staged = []  # the spare buffers go
        commit_s = time.perf_counter() - start
        self._update_stats(
            num_rebalances=self.stats.num_rebalances + 1,
            last_decided_step=proposal.step_index,
            last_adopted_step=step_index,
            last_balancedness_before=proposal.balancedness_before,
            last_balancedness_after=proposal.balancedness_after,
            last_staging_s=proposal.staging_s,
            last_pause_s=proposal.decide_s + commit_s,
            last_bytes=proposal.num_bytes,
            last_staged_bytes=proposal.staged_bytes,
            last_received_bytes=proposal.received_bytes,
        )
        if self.rank == 0:
            bytes_per_slot = self.layers[0].experts.bytes_per_slot
            self.log.info(
                "EPLB rebalance %d (decided at step %d): balancedness %.3f -> %.3f on its "
                "window (mean of %d MoE layers; worst layer %.3f -> %.3f); %d expert slots "
                "rewritten over the group (%.1f MiB), new experts from the %s; staging %.0f ms "
                "here, steps paused %.1f ms",
                self.stats.num_rebalances,
                proposal.step_index,
                statistics.fmean(proposal.balancedness_before),
                statistics.fmean(proposal.balancedness_after),
                len(self.layers),
                min(proposal.balancedness_before),
                min(proposal.balancedness_after),
                proposal.group_slots,
                proposal.group_slots * bytes_per_slot / 2**20,
                "peers" if self.source == "peer" else "checkpoint",
                1e3 * proposal.staging_s,
                1e3 * (proposal.decide_s + commit_s),
            )
        return "adopted"

    # -- the staging thread ---------------------------------------------------------------------
    def _stage(self, proposal: _Proposal) -> None:
        """Build every layer's `StagedPlacement` for this rank; sets `proposal.state` last."""
        # One torch thread, so this one does not compete with the step's OpenMP pool. torch
        # also keeps the count process-wide for threads that start later: put it back after.
        process_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        start = time.perf_counter()
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                staged = self._stage_layers(proposal)
            if stream is not None:
                stream.synchronize()  # the commit reads the buffers on the step's stream
        except Exception as error:  # any failure keeps the old placement; never a crash
            proposal.error = f"{type(error).__name__}: {error}"
            if not proposal.cancel.is_set():
                self.log.warning("EPLB staging failed: %s", proposal.error)
            proposal.state = _FAILED
            return
        finally:
            torch.set_num_threads(process_threads)
        proposal.staged = staged
        proposal.staging_s = time.perf_counter() - start
        proposal.state = _READY

    def _stage_layers(
        self, proposal: _Proposal, may_stop: bool = True, source: str | None = None
    ) -> list[StagedPlacement]:
        """Every layer's `StagedPlacement`, its new experts from `source` (the group's by
        default: a peer transfer is collective over the transfer group, layer by layer)."""
        from_peers = (source or self.source) == "peer"
        staged = []
        with contextlib.ExitStack() as stack:
            reader = None if from_peers else stack.enter_context(CheckpointReader(self.model_dir))
            for index, layer in enumerate(self.layers):
                if proposal.cancel.is_set():
                    raise RuntimeError("cancelled")
                current, proposed = proposal.current[index], proposal.proposed[index]
                moves = slot_moves(current, proposed, self.rank)
                experts = layer.experts
                shape13, shape2 = experts.w13.shape[1:], experts.w2.shape[1:]
                w13 = torch.empty(len(moves.load), *shape13, dtype=self.dtype, device=self.device)
                w2 = torch.empty(len(moves.load), *shape2, dtype=self.dtype, device=self.device)
                if from_peers:
                    plan = plan_transfers(current, proposed)
                    tag = self._tag_base(proposal.number, index)
                    received = self._transfer(proposal.transfer, layer, plan, w13, w2, tag)
                    proposal.received_bytes += received * experts.bytes_per_slot
                else:
                    wanted = [expert for _, expert in moves.load]
                    read = read_experts(
                        reader, self.config, self.layer_indices[index], wanted, self.dtype
                    )
                    for row, (_, gate, up, down) in enumerate(read):
                        if proposal.cancel.is_set():
                            raise RuntimeError("cancelled")
                        fill_expert(w13[row], w2[row], gate, up, down)
                if index == 0 and moves.load and may_stop:
                    _stop_here_if_asked()
                staged.append(
                    StagedPlacement(
                        placement=proposed,
                        log2phy=proposed.log2phy.to(self.device),
                        logcnt=proposed.logcnt.to(self.device),
                        slots=self._index([slot for slot, _ in moves.load]),
                        w13=w13,
                        w2=w2,
                        copy_to=self._index([slot for slot, _ in moves.copy]),
                        copy_from=self._index([source for _, source in moves.copy]),
                    )
                )
                proposal.num_bytes += moves.num_slots * experts.bytes_per_slot
                proposal.staged_bytes += len(moves.load) * experts.bytes_per_slot
        return staged

    def _tag_base(self, number: int, layer_index: int) -> int:
        span = 2 * self.num_physical  # a layer's plan has at most P transfers, 2 tags each
        per_proposal = span * len(self.layers)
        return (number % (_TAG_LIMIT // per_proposal)) * per_proposal + layer_index * span

    def _transfer(
        self,
        group: dist.ProcessGroup,
        layer: MoELayer,
        plan: tuple[ExpertTransfer, ...],
        w13: torch.Tensor,
        w2: torch.Tensor,
        tag: int,
    ) -> int:
        """This rank's part of one layer's `plan`: it receives its rows of `w13` [M, D, 2I]
        and `w2` [M, I, D] from their sources, copies those it holds itself, and sends what
        others take from it, from its live slots (unchanged until the commit, which waits for
        every rank's staging). Collective over the transfer group for the ranks the plan
        names; raises if a peer fails or the group's timeout passes. Returns the experts
        received from peers."""
        experts, me = layer.experts, self.rank
        on_host = self.device.type == "cpu"
        works, arrived, sending, received = [], [], [], 0
        for index, move in enumerate(plan):
            tags = (tag + 2 * index, tag + 2 * index + 1)
            if move.dst == me and move.src == me:
                w13[move.row].copy_(experts.w13[move.src_slot])
                w2[move.row].copy_(experts.w2[move.src_slot])
            elif move.dst == me:
                received += 1
                for tensor, each in zip((w13[move.row], w2[move.row]), tags, strict=True):
                    buffer = tensor if on_host else torch.empty(tensor.shape, dtype=tensor.dtype)
                    works.append(group.recv([buffer], move.src, each))
                    if not on_host:
                        arrived.append((tensor, buffer))
            elif move.src == me:
                for weights, each in zip((experts.w13, experts.w2), tags, strict=True):
                    buffer = weights[move.src_slot].contiguous().cpu()  # no copy on the CPU
                    sending.append(buffer)  # alive until its send is done
                    works.append(group.send([buffer], move.dst, each))
        for work in works:
            work.wait()
        for tensor, buffer in arrived:
            tensor.copy_(buffer)
        return received

    # -- the expert source --------------------------------------------------------------------
    def _choose_source(self) -> None:
        """Settle where new experts come from (`moe.eplb_expert_source`): under "auto" and
        "peer" every rank times one expert sent by a peer (a ring: each rank receives the
        previous rank's first slot of the first MoE layer) and one read from the checkpoint,
        and the slowest rank's times decide, alike on every rank. Collective over the vote
        group and the transfer group."""
        wanted = self.settings.eplb_expert_source
        if self.transfer is None or wanted == "checkpoint":
            self.source = "checkpoint"
            self._update_stats(
                expert_source="checkpoint", peer_bytes_per_s=0.0, checkpoint_bytes_per_s=0.0
            )
            return
        mine = [self._time_peer(), self._time_checkpoint()]
        everyone = all_gather_json(mine, self.group)
        peer_s = max(times[0] for times in everyone)
        checkpoint_s = max(times[1] for times in everyone)
        self.source = "peer" if wanted == "peer" or peer_s < checkpoint_s else "checkpoint"
        size = self.layers[0].experts.bytes_per_slot
        self._update_stats(
            expert_source=self.source,
            peer_bytes_per_s=size / peer_s,
            checkpoint_bytes_per_s=size / checkpoint_s,
        )
        if self.rank == 0:
            self.log.info(
                "EPLB: experts new to a rank come from the %s (%s): %.0f MB/s from a peer, "
                "%.0f MB/s from the checkpoint (one %.2f MiB expert, the slowest rank)",
                "peers" if self.source == "peer" else "checkpoint",
                "moe.eplb_expert_source=peer" if wanted == "peer" else "measured",
                size / peer_s / 1e6,
                size / checkpoint_s / 1e6,
                size / 2**20,
            )

    def _scratch(self) -> tuple[torch.Tensor, torch.Tensor]:
        experts = self.layers[0].experts
        shape13, shape2 = experts.w13.shape[1:], experts.w2.shape[1:]
        return (
            torch.empty(1, *shape13, dtype=self.dtype, device=self.device),
            torch.empty(1, *shape2, dtype=self.dtype, device=self.device),
        )

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time_peer(self) -> float:
        """Seconds one expert takes from a peer (the fastest of a few tries). Collective."""
        placement = self.layers[0].placement
        ring = []  # rank r takes the first slot of rank r - 1
        for rank in range(self.num_ranks):
            src = (rank - 1) % self.num_ranks
            expert = placement.local_phy2log(src)[0]
            ring.append(ExpertTransfer(dst=rank, row=0, expert=expert, src=src, src_slot=0))
        w13, w2 = self._scratch()
        times = []
        for _ in range(_PROBE_TRIES):
            self._sync()
            start = time.perf_counter()
            self._transfer(
                self.transfer, self.layers[0], tuple(ring), w13, w2, self._tag_base(0, 0)
            )
            self._sync()
            times.append(time.perf_counter() - start)
        return min(times)

    def _time_checkpoint(self) -> float:
        """Seconds one expert takes from the checkpoint (the fastest of a few tries)."""
        expert = self.layers[0].placement.local_phy2log(self.rank)[0]
        w13, w2 = self._scratch()
        times = []
        with CheckpointReader(self.model_dir) as reader:
            for _ in range(_PROBE_TRIES):
                self._sync()
                start = time.perf_counter()
                read = read_experts(
                    reader, self.config, self.layer_indices[0], [expert], self.dtype
                )
                for _, gate, up, down in read:
                    fill_expert(w13[0], w2[0], gate, up, down)
                self._sync()
                times.append(time.perf_counter() - start)
        return min(times)

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    # -- a re-formed group -------------------------------------------------------------------
    def join(
        self,
        group: dist.ProcessGroup,
        replacement: bool,
        transfer_group: dist.ProcessGroup | None = None,
        rank: int | None = None,
        num_ranks: int | None = None,
    ) -> None:
        """Take the balancer into a group re-formed after a failure (`DPEngine.join_group`;
        collective over the new vote group). A proposal being staged is dropped (it was
        decided in the old group, and a replacement knows nothing of it). Every rank then
        takes the placement of the lowest kept rank (a replacement started from the initial
        one; a kept rank may differ only if the failure split a commit), reading the experts
        new to it from the checkpoint before the group's first step, and the kept rank's
        forward-step count and group-wide stats, so that the group decides at the same steps
        and reports as one. The expert source is then chosen anew for the new group (over
        `transfer_group`, EPLB's gloo group of it).

        ``rank``, ``num_ranks``: this rank's place in the new group, where the group changed
        size (the engine has moved the layers there already, engine/resize.py)."""
        self.close()  # a staging thread still running gives up
        self.pending = None
        self.group = group
        self.transfer = transfer_group  # a staging thread still running keeps the old one
        self.num_proposals = 0
        if num_ranks is not None:
            self.rank, self.num_ranks = rank, num_ranks
            self.num_physical = self.layers[0].placement.num_physical
        self.num_nodes = count_nodes(group, self.rank, self.num_ranks)
        mine = {
            "kept": not replacement,
            "forward_steps": self.num_forward_steps,
            "maps": [layer.placement.phy2log.tolist() for layer in self.layers],
            "stats": dataclasses.asdict(self.snapshot()),
        }
        everyone = all_gather_json(mine, group)
        kept = [rank for rank, state in enumerate(everyone) if state["kept"]]
        if not kept:
            raise RuntimeError("no rank of the re-formed group was kept: nothing to join")
        source = everyone[kept[0]]
        self.num_forward_steps = max(everyone[rank]["forward_steps"] for rank in kept)
        start = time.perf_counter()
        current = [layer.placement for layer in self.layers]
        agreed = [
            ExpertPlacement.from_phy2log(maps, self.config.num_experts, self.num_ranks)
            for maps in source["maps"]
        ]
        moved = 0
        if any(bool((a.phy2log != c.phy2log).any()) for a, c in zip(agreed, current, strict=True)):
            proposal = _Proposal(
                decided_at=self.num_forward_steps, step_index=-1, number=0, transfer=None,
                current=current, proposed=agreed, balancedness_before=[],
                balancedness_after=[], group_slots=0, decide_s=0.0, next_check=0,
            )  # fmt: skip
            # From the checkpoint: a peer sends only while a proposal stages.
            staged_layers = self._stage_layers(proposal, may_stop=False, source="checkpoint")
            for layer, staged in zip(self.layers, staged_layers, strict=True):
                layer.adopt(staged)
            moved = proposal.staged_bytes
        if not replacement and kept[0] != self.rank and moved:
            self.log.warning(
                "EPLB: this rank's placement differed from rank %d's after the failure (a "
                "commit the failure split); took rank %d's", kept[0], kept[0],
            )  # fmt: skip
        if replacement:
            kept_stats = RankExpertStats(**source["stats"])
            self._update_stats(**dataclasses.asdict(as_replacement(kept_stats)))
        self._choose_source()
        self.log.info(
            "EPLB joined the re-formed group at forward step %d with rank %d's placement "
            "(%.1f MiB read from the checkpoint here, %.0f ms)",
            self.num_forward_steps, kept[0], moved / 2**20,
            1e3 * (time.perf_counter() - start),
        )  # fmt: skip

    # -- outside the loop -------------------------------------------------------------------------
    def _update_stats(self, **changes: object) -> None:
        with self._stats_lock:
            self.stats = dataclasses.replace(self.stats, **changes)

    def snapshot(self) -> RankExpertStats:
        """This rank's EPLB stats (an immutable snapshot), safe from any thread."""
        with self._stats_lock:
            return self.stats

    def close(self) -> None:
        """The engine stops: a staging thread still running gives up at its next expert."""
        if self.pending is not None:
            self.pending.cancel.set()


def _stop_here_if_asked() -> None:
    """`STOP_IN_STAGING_ENV`: stop this process if its file is there (taking it, so one rank
    of one group stops, once)."""
    path = os.environ.get(STOP_IN_STAGING_ENV)
    if not path:
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        return
    os.kill(os.getpid(), signal.SIGSTOP)
