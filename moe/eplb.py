"""Expert-parallel load balancing (EPLB): which logical experts get the redundant slots, and
which rank holds each slot, so that the busiest rank of every MoE layer carries few tokens.

Shape legend: L = MoE layers, E = logical experts, P = physical slots, N = ranks of the EP
group, S = P // N slots per rank, G = expert groups, X = rows balanced independently (layers,
or layers x nodes), n = items per row, R_max = most replicas of any logical expert.

The algorithm is DeepSeek's EPLB, written here as batched tensor ops over rows:

1. replicate: the P - E redundant slots go one at a time to the logical expert whose replicas
   carry the most tokens each (an expert's tokens split evenly over its replicas, as
   `moe.placement.choose_replicas` spreads them). This greedy minimises the largest load of any
   replica (it is the highest-averages apportionment).
2. pack: the P replicas are dealt onto ranks, S each, heaviest first, each to the currently
   lightest rank that still has room.

The hierarchical policy (num_nodes > 1 and num_nodes divides G) first packs whole expert groups
onto nodes, balancing tokens per node, then replicates and packs within each node: a group and
all its replicas stay on one node, so group-limited routing (DeepSeek-V3 sends a token to at
most `topk_group` groups) bounds how many nodes a token's rows reach. Each node gets P /
num_nodes slots whatever its load, so a node holding the hottest groups stays the bottleneck.
Otherwise the global policy replicates and packs over all ranks at once. (DeepSeek's code also
takes the hierarchical branch with one node, where it equals the global one.)

Slot numbering: the output is rank-major like `ExpertPlacement` (rank r holds slots
[r * S, (r + 1) * S)), with the ranks of a node contiguous (rank r on node r // (N / num_nodes)).
DeepSeek's reference output is numbered the same way (node, then GPU within the node, then slot
within the GPU), so no conversion is needed; the hierarchical policy is only right if the
launcher really numbers ranks node by node.

Determinism: every rank computing from the same load must get the same maps. Loads are
float64 on CPU; sorts are stable and every tie has a fixed rule (in the end the lowest index);
the only sums are written as sequential additions (never a vectorised reduction, whose order
may depend on thread count or SIMD width); nothing is random. The one departure from DeepSeek's
choices is a tie rule: between equally loaded experts, replication prefers the one with fewer
replicas (DeepSeek's takes the lowest index), so an all-zero layer spreads its spare slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moe.placement import ExpertPlacement

HIERARCHICAL = "hierarchical"
GLOBAL = "global"

# Default for `worth_adopting`: moving experts costs a weight transfer, and the window's load
# only estimates the next window's, so a proposal must remove a clear share of the critical path.
DEFAULT_MIN_GAIN = 0.05


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deal the n weighted items of each row into `num_packs` packs of n / num_packs items.

    weight: [X, n] non-negative. Returns (pack [X, n], position [X, n]) int64: each item's pack
    and its place in that pack, 0 .. n / num_packs - 1. Items go heaviest first (equal weights
    in index order), each to the lightest pack that still has room (equal loads: the lowest
    pack). With one item per pack, item i goes to pack i (any such deal is equally balanced).
    A greedy for an NP-hard problem: optimal with one or two items per pack, not always with
    more.
    """
    num_rows, num_items = weight.shape
    if num_packs < 1 or num_items % num_packs != 0:
        raise ValueError(f"num_packs={num_packs} must be >= 1 and divide the {num_items} items")
    capacity = num_items // num_packs
    if capacity == 1:
        pack = torch.arange(num_items).expand(num_rows, num_items).clone()
        return pack, torch.zeros(num_rows, num_items, dtype=torch.int64)
    weight = weight.to(torch.float64)
    rows = torch.arange(num_rows)
    order = torch.sort(weight, dim=1, descending=True, stable=True).indices
    pack_load = torch.zeros(num_rows, num_packs, dtype=torch.float64)
    pack_size = torch.zeros(num_rows, num_packs, dtype=torch.int64)
    pack = torch.empty(num_rows, num_items, dtype=torch.int64)
    position = torch.empty(num_rows, num_items, dtype=torch.int64)
    full = torch.tensor(float("inf"), dtype=torch.float64)
    for step in range(num_items):
        item = order[:, step]
        chosen = torch.where(pack_size < capacity, pack_load, full).argmin(dim=1)
        pack[rows, item] = chosen
        position[rows, item] = pack_size[rows, chosen]
        pack_load[rows, chosen] += weight[rows, item]
        pack_size[rows, chosen] += 1
    return pack, position


def replicate_experts(weight: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Give each row's E experts `num_slots` replicas in all, minimising the largest
    weight / replicas over the experts.

    weight: [X, E] non-negative. Returns (phy2log [X, num_slots], logcnt [X, E]) int64: slot j < E
    holds expert j, each later slot the expert whose replicas were then the most loaded (ties:
    the one with fewer replicas, then the lowest index, so an all-zero row spreads evenly).
    """
    num_rows, num_experts = weight.shape
    if num_slots < num_experts:
        raise ValueError(f"num_slots={num_slots} must be >= the {num_experts} logical experts")
    weight = weight.to(torch.float64)
    rows = torch.arange(num_rows)
    phy2log = torch.empty(num_rows, num_slots, dtype=torch.int64)
    phy2log[:, :num_experts] = torch.arange(num_experts)
    logcnt = torch.ones(num_rows, num_experts, dtype=torch.int64)
    for slot in range(num_experts, num_slots):
        per_replica = weight / logcnt
        hottest = per_replica == per_replica.max(dim=1, keepdim=True).values
        fewest = torch.where(hottest, logcnt, torch.iinfo(torch.int64).max).argmin(dim=1)
        phy2log[:, slot] = fewest
        logcnt[rows, fewest] += 1
    return phy2log, logcnt


def _replicate_and_pack(weight: torch.Tensor, num_slots: int, num_ranks: int) -> torch.Tensor:
    """weight: [X, e] → phy2log [X, num_slots] of row-local expert ids, rank-major over
    `num_ranks` ranks of num_slots / num_ranks slots each."""
    phy2log, logcnt = replicate_experts(weight, num_slots)
    slot_load = weight.to(torch.float64).gather(1, phy2log) / logcnt.gather(1, phy2log)
    rank, position = balanced_packing(slot_load, num_ranks)
    placed = torch.empty_like(phy2log)
    placed.scatter_(1, rank * (num_slots // num_ranks) + position, phy2log)
    return placed


def rebalance_global(load: torch.Tensor, num_physical: int, num_ranks: int) -> torch.Tensor:
    """The global policy: replicate over all P slots, then pack them onto all N ranks.

    load: [L, E] tokens per logical expert. Returns phy2log [L, P], rank-major.
    """
    return _replicate_and_pack(load.to(torch.float64), num_physical, num_ranks)


def rebalance_hierarchical(
    load: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> torch.Tensor:
    """The hierarchical policy: groups packed onto nodes, then replicate and pack per node.

    load: [L, E] tokens per logical expert, expert e in group e // (E / G). Needs G % num_nodes
    == 0, E % G == 0, N % num_nodes == 0 (checked by `rebalance`). Returns phy2log [L, P],
    rank-major, node n holding ranks [n * N / num_nodes, (n + 1) * N / num_nodes).
    """
    num_layers, num_experts = load.shape
    weight = load.to(torch.float64)
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_experts // num_nodes
    by_group = weight.view(num_layers, num_groups, group_size)
    group_load = by_group[:, :, 0].clone()
    for member in range(1, group_size):  # sequential sum: see the module note on determinism
        group_load += by_group[:, :, member]
    node, position = balanced_packing(group_load, num_nodes)
    # node_groups[l, i]: the group in place i when nodes' groups are laid out node after node.
    node_groups = torch.empty_like(node)
    groups = torch.arange(num_groups).expand(num_layers, num_groups)
    node_groups.scatter_(1, node * groups_per_node + position, groups)
    node_experts = (node_groups.unsqueeze(-1) * group_size + torch.arange(group_size)).flatten(1)
    node_weight = weight.gather(1, node_experts).view(num_layers * num_nodes, experts_per_node)
    local = _replicate_and_pack(node_weight, num_physical // num_nodes, num_ranks // num_nodes)
    # Node-local expert ids back to logical ids; nodes one after another keep slots rank-major.
    node_experts = node_experts.view(num_layers, num_nodes, experts_per_node)
    phy2log = node_experts.gather(2, local.view(num_layers, num_nodes, -1))
    return phy2log.flatten(1)


@dataclass(frozen=True, eq=False)
class RebalanceResult:
    """Per-layer maps from `rebalance`, on CPU, int64.

    phy2log: [L, P] — logical expert of each physical slot (slots rank-major).
    log2phy: [L, E, R_max] — slots of each logical expert, ascending, padded with -1.
    logcnt:  [L, E] — replicas of each logical expert (>= 1).
    num_ranks: N; policy: `HIERARCHICAL` or `GLOBAL`, whichever `rebalance` used.
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor
    num_ranks: int
    policy: str

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    def placement(self, layer: int) -> ExpertPlacement:
        """The `ExpertPlacement` of MoE layer `layer` (0-based among the MoE layers)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} outside [0, num_layers={self.num_layers})")
        return ExpertPlacement.from_phy2log(
            self.phy2log[layer], self.logcnt.shape[1], self.num_ranks
        )


def rebalance(
    load: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> RebalanceResult:
    """EPLB placement of every MoE layer for the given load.

    load: [L, E] tokens routed to each logical expert of each MoE layer (any real dtype, any
    device; summed over every rank of the group, so each rank passes the same tensor).
    num_physical: P slots in all, a multiple of N and >= E. num_groups: G expert groups of the
    router (1 for routers without groups). num_nodes: nodes the N ranks span. Returns the maps
    of every layer; the same input gives the same output on every rank.
    """
    _check_rebalance_args(load, num_physical, num_groups, num_nodes, num_ranks)
    load = load.detach().to("cpu", torch.float64)
    if num_nodes > 1 and num_groups % num_nodes == 0:
        policy = HIERARCHICAL
        phy2log = rebalance_hierarchical(load, num_physical, num_groups, num_nodes, num_ranks)
    else:
        policy = GLOBAL
        phy2log = rebalance_global(load, num_physical, num_ranks)
    log2phy, logcnt = _maps_from_phy2log(phy2log, load.shape[1])
    return RebalanceResult(phy2log, log2phy, logcnt, num_ranks, policy)


def _check_rebalance_args(
    load: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> None:
    if load.dim() != 2 or load.shape[1] == 0:
        raise ValueError(f"load must be [L, E] with E >= 1, got shape {tuple(load.shape)}")
    if load.is_complex() or load.dtype == torch.bool:
        raise ValueError(f"load must be real token counts, got dtype {load.dtype}")
    num_experts = load.shape[1]
    bad = ~torch.isfinite(load.double()) | (load < 0)
    if bool(bad.any()):
        layer, expert = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"load must be finite and >= 0; load[{layer}, {expert}]={load[layer, expert].item()}"
        )
    if num_ranks < 1 or num_physical < num_experts or num_physical % num_ranks != 0:
        raise ValueError(
            f"num_physical={num_physical} must be >= num_experts={num_experts} and a multiple "
            f"of num_ranks={num_ranks} (>= 1)"
        )
    if num_nodes < 1 or num_ranks % num_nodes != 0:
        raise ValueError(f"num_nodes={num_nodes} must be >= 1 and divide num_ranks={num_ranks}")
    if num_groups < 1 or num_experts % num_groups != 0:
        raise ValueError(
            f"num_groups={num_groups} must be >= 1 and divide num_experts={num_experts}"
        )


def _maps_from_phy2log(phy2log: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """phy2log: [L, P] → (log2phy [L, E, R_max] ascending, -1 padded; logcnt [L, E])."""
    num_layers, num_physical = phy2log.shape
    logcnt = torch.zeros(num_layers, num_experts, dtype=torch.int64)
    logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    # Slots sorted by (expert, slot): a stable sort on the expert id keeps slots ascending.
    slots = torch.sort(phy2log, dim=1, stable=True).indices
    experts = phy2log.gather(1, slots)
    first = torch.cumsum(logcnt, dim=1) - logcnt  # where each expert's run starts
    replica = torch.arange(num_physical) - first.gather(1, experts)
    max_replicas = int(logcnt.max())
    log2phy = torch.full((num_layers, num_experts, max_replicas), -1, dtype=torch.int64)
    layers = torch.arange(num_layers).unsqueeze(1).expand(num_layers, num_physical)
    log2phy[layers, experts, replica] = slots
    return log2phy, logcnt


def rank_loads(load: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """Tokens each rank's experts compute for one layer: load: [E] → [N] float64.

    A logical expert's tokens are split evenly over its replicas. Dispatch picks replica
    (token_offset + t + k) % logcnt[e] (`choose_replicas`), a round robin over the global token
    index, so each replica gets its share once many distinct indices have passed (a layer's
    running offset, `MoELayer.next_token_offset`, starts at its rank and advances by its
    tokens, so ranks with a few decode tokens each still spread). Counts (token, expert) pairs,
    the experts' work; normal dispatch sends a token to a rank once even when it picked two
    slots there.
    """
    if load.shape != (placement.num_experts,):
        raise ValueError(f"load must be [E={placement.num_experts}], got shape {tuple(load.shape)}")
    load = load.detach().to("cpu", torch.float64)
    per_slot = load[placement.phy2log] / placement.logcnt[placement.phy2log]
    per_slot = per_slot.view(placement.num_ranks, placement.slots_per_rank)
    total = per_slot[:, 0].clone()
    for slot in range(1, placement.slots_per_rank):  # sequential: the same sum on every rank
        total += per_slot[:, slot]
    return total


def balancedness(load: torch.Tensor, placement: ExpertPlacement) -> float:
    """Mean over max of tokens per rank for one layer (`rank_loads`): 1.0 is perfect balance,
    1 / N the worst. load: [E]. A layer with no tokens counts as balanced (1.0)."""
    per_rank = rank_loads(load, placement)
    busiest = float(per_rank.max())
    return 1.0 if busiest == 0.0 else float(per_rank.mean()) / busiest


def rebalance_gain(
    load: torch.Tensor,
    current: Sequence[ExpertPlacement],
    proposed: Sequence[ExpertPlacement],
) -> float:
    """The share of the expert phase's critical path a move would remove, under `load`.

    load: [L, E]; current, proposed: one placement per layer. A layer's expert time follows its
    busiest rank (every rank waits for it at combine), so the measure is
    1 - sum_l max_rank proposed_l / sum_l max_rank current_l: 0.2 means the busiest ranks of
    all layers together compute a fifth fewer tokens; negative when the proposal is worse.
    0.0 when the current placement carries no tokens.
    """
    if not len(current) == len(proposed) == load.shape[0]:
        raise ValueError(
            f"need one current and one proposed placement per layer of load "
            f"[L={load.shape[0]}, E]; got {len(current)} current, {len(proposed)} proposed"
        )
    now = sum(float(rank_loads(load[i], p).max()) for i, p in enumerate(current))
    after = sum(float(rank_loads(load[i], p).max()) for i, p in enumerate(proposed))
    return 0.0 if now == 0.0 else 1.0 - after / now


def worth_adopting(
    load: torch.Tensor,
    current: Sequence[ExpertPlacement],
    proposed: Sequence[ExpertPlacement],
    min_gain: float = DEFAULT_MIN_GAIN,
) -> bool:
    """Whether to move to `proposed`: its `rebalance_gain` under `load` is at least `min_gain`.

    load: [L, E], normally the window the proposal was computed from, which makes the gain an
    optimistic estimate; `min_gain` keeps noise from moving weights back and forth. A
    rebalance that cannot improve balance (gain <= 0, e.g. already balanced, or no tokens) is
    never adopted, whatever `min_gain`.
    """
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain={min_gain} must be in [0, 1)")
    gain = rebalance_gain(load, current, proposed)
    return gain > 0.0 and gain >= min_gain


class ExpertLoadWindow:
    """Tokens per logical expert per MoE layer over the last W recorded steps, on the device.

    A ring buffer counts: [W, L, E] int64; `record` overwrites the oldest step in place and
    `window_sum` reduces on the device, so neither waits for the device (no host sync). Integer
    counts make the sum exact and order-free. Each rank records its own tokens; the engine
    all-reduces `window_sum()` over the group before `rebalance`, so every rank balances the
    same load. Python state (next row, steps seen) is the same on every rank that records
    every step.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        window_steps: int,
        device: torch.device | str | None = None,
    ) -> None:
        if num_layers < 1 or num_experts < 1 or window_steps < 1:
            raise ValueError(
                f"need num_layers, num_experts and window_steps >= 1, got {num_layers}, "
                f"{num_experts}, {window_steps}"
            )
        self.counts = torch.zeros(
            window_steps, num_layers, num_experts, dtype=torch.int64, device=device
        )
        self.next_row = 0
        self.num_recorded = 0

    @property
    def window_steps(self) -> int:
        return self.counts.shape[0]

    @property
    def num_steps(self) -> int:
        """Steps the window holds now: min(steps recorded, W)."""
        return min(self.num_recorded, self.window_steps)

    def record(self, step_load: torch.Tensor) -> None:
        """Add one step's counts, step_load: [L, E] (integers; e.g. stacked
        `MoELayer.take_expert_load()`), dropping the step W steps back."""
        if step_load.shape != self.counts.shape[1:]:
            raise ValueError(
                f"step_load must be [L, E]={tuple(self.counts.shape[1:])}, got "
                f"{tuple(step_load.shape)}"
            )
        self.counts[self.next_row].copy_(step_load)
        self.next_row = (self.next_row + 1) % self.window_steps
        self.num_recorded += 1

    def window_sum(self) -> torch.Tensor:
        """[L, E] int64 tokens per expert per layer over the window, on the buffer's device."""
        return self.counts.sum(dim=0)

    def clear(self) -> None:
        """Forget every step (e.g. after a rebalance, whose old window no longer applies)."""
        self.counts.zero_()
        self.next_row = 0
        self.num_recorded = 0
