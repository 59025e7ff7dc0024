"""The MoE layer as model code sees it, plus the dense reference it must equal.

Shape legend: T = tokens on this rank, E = logical experts, P = physical slots,
S = slots per rank, K = top-k, D = hidden, I = expert intermediate.

Model code is single-device: it routes, then calls `forward` with logical expert ids. EP is
applied here, from outside the model: replica choice, dispatch, local experts, combine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe.dispatch import DispatchMode, combine, dispatch, run_local_experts
from moe.dispatch_common import ReceivedRouting
from moe.dispatch_low_latency import check_capacity
from moe.exchange import Exchange, as_exchange
from moe.experts import ExpertImpl, LocalExperts
from moe.placement import ExpertPlacement, choose_replicas_from_maps, reshard_moves


@dataclass(frozen=True, eq=False)
class StagedPlacement:
    """A new placement of one MoE layer on one rank, with everything the swap needs already on
    the layer's device, so that `MoELayer.adopt` only copies weights there and rebinds maps.

    placement: the new maps (the same E, P and N as the layer's).
    log2phy: [E, R_max] and logcnt: [E], its maps on the layer's device.
    slots: [M] int64 local slots that take new weights from w13: [M, D, 2I] and w2: [M, I, D]
        (input-major, `moe.experts.fill_expert`).
    copy_to, copy_from: [C] int64 local slots filled from slots that keep their expert.
    """

    placement: ExpertPlacement
    log2phy: torch.Tensor
    logcnt: torch.Tensor
    slots: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    copy_to: torch.Tensor
    copy_from: torch.Tensor


class MoELayer(nn.Module):
    """Routed experts of one MoE layer, sharded over an EP group by `placement`.

    `group` is the EP group: a torch.distributed process group, or any `moe.exchange.Exchange`
    (the engine passes a shared-memory one where its ranks share a host). With `group=None`
    the layer is single-process: the placement must have one rank, and the same LocalExperts
    path runs with no collectives.

    The placement can change between forwards (`adopt`, EPLB); dispatch reads only
    `slots_per_rank`, which `adopt` never changes, and the replica maps, which it rebinds at
    once, so a forward sees the old placement or the new one, never a mix. A group that
    shrinks onto its survivors or grows back changes the rank, the group and the slot count
    together (`reshard`), between forwards.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        placement: ExpertPlacement,
        rank: int = 0,
        group: dist.ProcessGroup | Exchange | None = None,
        dtype: torch.dtype = torch.float32,
        ll_max_tokens_per_rank: int = 256,
        count_expert_load: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if placement.num_experts != num_experts:
            raise ValueError(
                f"num_experts={num_experts} but the placement maps "
                f"{placement.num_experts} logical experts"
            )
        exchange = None if group is None else as_exchange(group)
        num_group_ranks = 1 if exchange is None else exchange.size
        if placement.num_ranks != num_group_ranks:
            raise ValueError(
                f"placement is for num_ranks={placement.num_ranks} but the group has "
                f"{num_group_ranks} rank(s) (group={'None' if group is None else 'set'})"
            )
        if exchange is not None and exchange.rank != rank:
            raise ValueError(f"rank={rank} but this process is rank {exchange.rank}")
        if ll_max_tokens_per_rank < 1:
            raise ValueError(f"ll_max_tokens_per_rank must be >= 1, got {ll_max_tokens_per_rank}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.placement = placement
        self.rank = rank
        self.exchange = exchange
        self.ll_max_tokens_per_rank = ll_max_tokens_per_rank
        self.hosted_slots = placement.hosted_slots(rank)
        # On the target device from the start: a GPU rank never fills its experts on the host
        # (DeepSeek-V3's are tens of GB per rank).
        self.experts = LocalExperts(
            len(self.hosted_slots), hidden_size, intermediate_size, dtype, device
        )
        # The implementation of the expert side per dispatch mode (None: PyTorch's ops).
        self.expert_impls: dict[DispatchMode, ExpertImpl | None] = dict.fromkeys(DispatchMode)
        # Device copies of the replica maps: they follow `.to(device)`, so replica choice never
        # copies from the host in the forward pass. Not persistent: the placement is config.
        self.register_buffer("log2phy", placement.log2phy.clone(), persistent=False)
        self.register_buffer("logcnt", placement.logcnt.clone(), persistent=False)
        self.count_expert_load = count_expert_load
        # The token_offset of a forward that passes none: this rank's running token index,
        # started at its rank. Ranks with one decode token each then pick different replicas of
        # an expert, and a rank cycles through them from step to step; a fixed offset would send
        # every rank's first token to the same, lowest replica. On the device, advanced there:
        # a Python int would be a constant of a compiled or captured step, wrong at the next.
        self.register_buffer(
            "running_token_offset", torch.tensor(rank, dtype=torch.int64), persistent=False
        )
        # Statistics, not weights: not saved with the model, but they follow `.to(device)`.
        self.register_buffer(
            "expert_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False
        )

    @property
    def next_token_offset(self) -> int:
        """The token_offset the next forward without one uses (reads the device)."""
        return int(self.running_token_offset)

    def load_expert(
        self, logical_id: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
    ) -> None:
        """Copy one logical expert's weights into every local slot that hosts it.

        gate: [I, D]; up: [I, D]; down: [D, I] (the Hugging Face Linear layouts).
        """
        size_i, size_d = self.intermediate_size, self.hidden_size
        if gate.shape != (size_i, size_d) or up.shape != (size_i, size_d):
            raise ValueError(
                f"gate and up must be [I={size_i}, D={size_d}], got {tuple(gate.shape)} and "
                f"{tuple(up.shape)} for expert {logical_id}"
            )
        if down.shape != (size_d, size_i):
            raise ValueError(
                f"down must be [D={size_d}, I={size_i}], got {tuple(down.shape)} "
                f"for expert {logical_id}"
            )
        phy2log = self.placement.phy2log[self.hosted_slots].tolist()
        local_slots = [slot for slot, logical in enumerate(phy2log) if logical == logical_id]
        if not local_slots:
            raise ValueError(
                f"rank {self.rank} does not host logical expert {logical_id}; it hosts "
                f"{self.placement.hosted_logical(self.rank)}"
            )
        for slot in local_slots:
            self.experts.load_slot(slot, gate, up, down)

    def set_expert_impl(self, impl: ExpertImpl | None, mode: DispatchMode | None = None) -> None:
        """Run the expert side of `mode`'s steps (every mode when None) through `impl`."""
        for each in DispatchMode if mode is None else (mode,):
            self.expert_impls[each] = impl

    def join(self, group: dist.ProcessGroup | Exchange) -> None:
        """Swap rows through `group` from now on: a group re-formed after a failure (the
        same rank and size, new processes or connections). Call it where no forward runs."""
        exchange = as_exchange(group)
        if self.exchange is None or (exchange.rank, exchange.size) != (
            self.exchange.rank,
            self.exchange.size,
        ):
            now = "none" if self.exchange is None else (self.exchange.rank, self.exchange.size)
            raise ValueError(
                f"a layer placed for (rank, size) {now} cannot join a group as "
                f"{(exchange.rank, exchange.size)}"
            )
        self.exchange = exchange

    @torch.no_grad()
    def reshard(
        self,
        placement: ExpertPlacement,
        rank: int,
        group: dist.ProcessGroup | Exchange | None,
        read: Callable[[list[int]], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
    ) -> int:
        """Take a placement over another number of ranks (a group that shrank onto its
        survivors, or grew back): this rank becomes `rank` of `group` (None: a group of one)
        with `placement.slots_per_rank` slots. Experts it holds are copied from its weights;
        the others come from `read(logical ids)` -> [(gate [I, D], up [I, D], down [D, I])]
        in that order (the checkpoint's layouts). Call it where no forward runs. Returns how
        many experts were read."""
        exchange = None if group is None else as_exchange(group)
        size = 1 if exchange is None else exchange.size
        if placement.num_experts != self.num_experts or placement.num_ranks != size:
            raise ValueError(
                f"the placement maps E={placement.num_experts} over N={placement.num_ranks}; "
                f"this layer has E={self.num_experts} and the group {size} rank(s)"
            )
        if exchange is not None and exchange.rank != rank:
            raise ValueError(f"rank={rank} but this process is rank {exchange.rank} of the group")
        moves = reshard_moves(
            self.placement.local_phy2log(self.rank), placement.local_phy2log(rank)
        )
        old = self.experts
        device = old.w13.device
        with torch.device(device):
            new = LocalExperts(
                placement.slots_per_rank, self.hidden_size, self.intermediate_size, old.w13.dtype
            )
        if moves.kept:
            to = torch.tensor([new_slot for new_slot, _ in moves.kept], device=device)
            source = torch.tensor([old_slot for _, old_slot in moves.kept], device=device)
            new.w13.index_copy_(0, to, old.w13.index_select(0, source))
            new.w2.index_copy_(0, to, old.w2.index_select(0, source))
        weights = read([expert for _, expert in moves.load]) if moves.load else []
        if len(weights) != len(moves.load):
            raise ValueError(f"read returned {len(weights)} experts for {len(moves.load)}")
        for (slot, _), (gate, up, down) in zip(moves.load, weights, strict=True):
            new.load_slot(slot, gate, up, down)
        for slot, source in moves.copy:
            new.w13[slot].copy_(new.w13[source])
            new.w2[slot].copy_(new.w2[source])
        self.experts = new
        self.placement = placement
        self.rank = rank
        self.exchange = exchange
        self.hosted_slots = placement.hosted_slots(rank)
        self.log2phy = placement.log2phy.to(device)
        self.logcnt = placement.logcnt.to(device)
        return len(moves.load)

    def count_load_into(self, counts: torch.Tensor) -> None:
        """Count routed pairs into `counts` ([E] int64 on the layer's device, e.g. one row of a
        [L, E] tensor that holds every layer's) from now on, so one op reads or resets every
        layer's counts."""
        if counts.shape != (self.num_experts,) or counts.dtype != torch.int64:
            raise ValueError(
                f"counts must be [E={self.num_experts}] int64, got {tuple(counts.shape)} "
                f"{counts.dtype}"
            )
        self.expert_load = counts
        self.count_expert_load = True

    def adopt(self, staged: StagedPlacement) -> None:
        """Switch to `staged.placement` between two forwards: the changed slots' weights are
        copied in on the device, then the maps are rebound. Call it where no forward runs (the
        engine does, at a step boundary)."""
        new = staged.placement
        now = self.placement
        if (new.num_experts, new.num_physical, new.num_ranks) != (
            now.num_experts,
            now.num_physical,
            now.num_ranks,
        ):
            raise ValueError(
                f"the new placement has E={new.num_experts}, P={new.num_physical}, "
                f"N={new.num_ranks}; this layer has E={now.num_experts}, P={now.num_physical}, "
                f"N={now.num_ranks}"
            )
        self.experts.write_slots(
            staged.slots, staged.w13, staged.w2, staged.copy_to, staged.copy_from
        )
        self.placement = new
        self.log2phy = staged.log2phy
        self.logcnt = staged.logcnt

    def take_expert_load(self) -> torch.Tensor:
        """[E] int64 (token, choice) pairs this rank routed to each logical expert since the
        last take, on the layer's device; resets the count. Queues device work only."""
        load = self.expert_load.clone()
        self.expert_load.zero_()
        return load

    def forward(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        mode: DispatchMode,
        token_offset: int | None = None,
    ) -> torch.Tensor:
        """hidden: [T, D]; topk_weights, topk_ids: [T, K] (logical ids) → [T, D].

        token_offset: index of this rank's first token, only used to spread tokens over
        replicas deterministically (`choose_replicas`); None: the layer's running index
        (`next_token_offset`), which then advances by T. Every rank of the group must call
        this with the same mode, even with T = 0.
        """
        num_tokens = hidden.shape[0]
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(
                f"hidden must be [T, D={self.hidden_size}], got shape {tuple(hidden.shape)}"
            )
        if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
            raise ValueError(
                f"topk_ids must be [T={num_tokens}, K], got shape {tuple(topk_ids.shape)}"
            )
        if topk_weights.shape != topk_ids.shape:
            raise ValueError(
                f"topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape "
                f"{tuple(topk_ids.shape)}"
            )
        if not isinstance(mode, DispatchMode):
            raise ValueError(f"mode must be a DispatchMode, got {mode!r}")
        if mode is DispatchMode.LOW_LATENCY:
            check_capacity(num_tokens, self.ll_max_tokens_per_rank)
        if self.count_expert_load:
            flat_ids = topk_ids.reshape(-1).long()
            self.expert_load.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        offset = self.running_token_offset if token_offset is None else token_offset
        physical_ids = choose_replicas_from_maps(topk_ids, self.log2phy, self.logcnt, offset)
        if token_offset is None:
            self.running_token_offset.add_(num_tokens)
        if self.exchange is None:
            local = ReceivedRouting(local_slots=physical_ids, weights=topk_weights.float())
            return run_local_experts(self.experts, hidden, local, self.expert_impls[mode])
        recv_hidden, recv_routing, meta = dispatch(
            mode,
            hidden,
            topk_weights,
            physical_ids,
            self.placement.slots_per_rank,
            self.exchange,
            self.ll_max_tokens_per_rank,
        )
        expert_out = run_local_experts(
            self.experts, recv_hidden, recv_routing, self.expert_impls[mode]
        )
        return combine(expert_out, meta, self.exchange)


def dense_reference_moe(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Obviously-correct MoE: every expert on every token, masked by the routing weights.

    hidden: [T, D]; topk_weights, topk_ids: [T, K]; gate, up: [E, I, D]; down: [E, D, I].
    Returns [T, D] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]).
    """
    num_experts = gate.shape[0]
    # dense_weights[t, e] = sum of the weights token t gives expert e (0 if not chosen).
    dense_weights = hidden.new_zeros(hidden.shape[0], num_experts)
    dense_weights.scatter_add_(1, topk_ids, topk_weights.to(hidden.dtype))
    out = torch.zeros_like(hidden)
    for expert in range(num_experts):
        expert_out = F.linear(
            F.silu(F.linear(hidden, gate[expert])) * F.linear(hidden, up[expert]), down[expert]
        )
        out += dense_weights[:, expert : expert + 1] * expert_out
    return out
