"""A group that changes size as it re-forms: shrunk onto the ranks that survived a failure
(no replacement could start), or grown back to its full size once replacements could.

Each rank of a re-formed group says who it was (`Member`); every rank then computes the same
target placement of the experts (`target_placements`), checks as a group that the slots it
must add fit in memory (`check_fit`), and moves its MoE layers there (`MoELayer.reshard`),
copying the experts it holds and reading only the others from the checkpoint.

DP ranks and group ranks: a DP rank is a request-facing slot (routing, outputs, metrics); it
never changes. A group rank is a position in the process groups of the current generation:
the live DP ranks in ascending order. They are equal until a group shrinks.

    shrink: shrink_placement(lowest kept rank's placement, old group ranks of the members)
            (each survivor keeps its slots; the lost ranks' experts are spread over them)
    grow:   initial_placement of the full size (a survivor keeps the experts it started
            with: shrink added slots after them, and the grown group drops those)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from dist_engine.engine.config import MoEConfig
from dist_engine.engine.eplb import initial_placement, moe_layers
from dist_engine.layers.moe import MoEBlock
from dist_engine.models.decoder import MoECausalLM
from dist_engine.models.loader import CheckpointReader, read_experts
from moe import Exchange, ExpertPlacement, shrink_placement

# Of the memory a rank reports free, the share a resize may take: the rest is left for the
# allocator's slack and for what the rank's other threads allocate meanwhile.
USABLE_FRACTION = 0.9


@dataclass(frozen=True)
class Member:
    """One rank of a re-formed group, as it was before the join.

    dp_rank: its request-facing DP rank. group_rank, group_size: its place in the group it
    left (a replacement: where it was built for). kept: it served in the failed group (a
    replacement did not). maps: each MoE layer's phy2log as it holds it (kept ranks only)."""

    dp_rank: int
    group_rank: int
    group_size: int
    kept: bool
    maps: list[list[int]] | None = None

    def as_json(self) -> dict:
        return asdict(self)


def is_resize(members: list[Member], new_size: int) -> bool:
    """Whether the group's shape changes: a member comes from a group of another size or
    takes another place (every rank computes the same answer from the gathered members)."""
    return any((m.group_rank, m.group_size) != (rank, new_size) for rank, m in enumerate(members))


def target_placements(
    members: list[Member], settings: MoEConfig, num_experts: int, full_size: int, num_layers: int
) -> list[ExpertPlacement]:
    """The placement of each of the ``num_layers`` MoE layers in the re-formed group of
    ``len(members)`` ranks (members in new group-rank order).

    Full size: the initial placement (a grown group). Smaller: the lowest member's placement
    shrunk onto the members, who must all be kept ranks of one group, in their old order;
    every layer then gets as many slots as the one that needs most (EPLB's replicas can leave
    layers with fewer orphans), the others padded with replicas of a rank's own experts.
    Raises ValueError for any other shape (a partial grow, a replacement in a shrink)."""
    new_size = len(members)
    if new_size == full_size:
        return [initial_placement(settings, num_experts, full_size)] * num_layers
    if new_size > full_size:
        raise ValueError(f"a group of {new_size} ranks exceeds parallel.dp_size={full_size}")
    if not all(m.kept for m in members):
        raise ValueError(
            f"a group smaller than parallel.dp_size={full_size} is made of survivors only; "
            f"members {[m.dp_rank for m in members if not m.kept]} are replacements"
        )
    old_sizes = {m.group_size for m in members}
    survivors = [m.group_rank for m in members]
    if len(old_sizes) != 1 or survivors != sorted(set(survivors)):
        raise ValueError(
            f"the survivors must come from one group in their old order; got (rank, size) "
            f"{[(m.group_rank, m.group_size) for m in members]}"
        )
    (old_size,) = old_sizes
    source = members[0].maps
    assert source is not None and len(source) == num_layers, "a kept member sends its maps"
    shrunk = [
        shrink_placement(ExpertPlacement.from_phy2log(maps, num_experts, old_size), survivors)
        for maps in source
    ]
    slots = max(placement.slots_per_rank for placement in shrunk)
    return [pad_placement(placement, slots) for placement in shrunk]


def pad_placement(placement: ExpertPlacement, slots_per_rank: int) -> ExpertPlacement:
    """``placement`` with ``slots_per_rank`` slots on every rank, the added ones replicas of
    the rank's own experts in turn (copies: nothing is read for them)."""
    extra = slots_per_rank - placement.slots_per_rank
    if extra == 0:
        return placement
    assert extra > 0, (placement.slots_per_rank, slots_per_rank)
    phy2log: list[int] = []
    for rank in range(placement.num_ranks):
        local = placement.local_phy2log(rank)
        phy2log.extend(local + [local[i % len(local)] for i in range(extra)])
    return ExpertPlacement.from_phy2log(phy2log, placement.num_experts, placement.num_ranks)


def resize_bytes(old_slots: int, new_slots: int, expert_bytes: int, num_layers: int) -> int:
    """The memory a rank needs beyond what it holds to move every layer from ``old_slots`` to
    ``new_slots`` local slots, one layer at a time: every layer's growth, and the peak of the
    last layer's move (its old and new tensors both alive)."""
    growth = max(0, new_slots - old_slots) * expert_bytes * num_layers
    return growth + min(old_slots, new_slots) * expert_bytes


def check_fit(needed: list[int], available: list[int], dp_ranks: list[int]) -> None:
    """Every rank's need against ``USABLE_FRACTION`` of its free memory (bytes, in group-rank
    order); raises ValueError naming each rank that cannot fit, the same on every rank."""
    short = [
        f"DP rank {dp} needs {need / 2**20:.1f} MiB, {avail / 2**20:.1f} MiB free"
        for dp, need, avail in zip(dp_ranks, needed, available, strict=True)
        if need > USABLE_FRACTION * avail
    ]
    if short:
        raise ValueError(
            "the re-formed group's experts do not fit: "
            + "; ".join(short)
            + f" (a resize may use {USABLE_FRACTION:.0%} of the free memory)"
        )


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors on ``device``: the device's free memory, or the host's
    available memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def reshard_model(
    model: MoECausalLM,
    model_dir: str,
    targets: list[ExpertPlacement],
    rank: int,
    group: Exchange | None,
) -> int:
    """Move every MoE layer of ``model`` to its target placement as group rank ``rank`` of
    ``group`` (None: a group of one), reading the experts this rank lacks from the checkpoint
    at ``model_dir`` (block-FP8 ones dequantized); returns how many experts were read."""
    indices = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, MoEBlock)]
    layers = moe_layers(model)
    num_read = 0
    with CheckpointReader(model_dir) as reader:
        for index, layer, placement in zip(indices, layers, targets, strict=True):

            def read(experts: list[int], index: int = index, layer=layer) -> list[tuple]:
                dtype = layer.experts.w13.dtype
                found = read_experts(reader, model.config, index, experts, dtype)
                return [(gate, up, down) for _, gate, up, down in found]

            num_read += layer.reshard(placement, rank, group, read)
    return num_read
