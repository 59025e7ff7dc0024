"""How the EP group's ranks swap rows: the one collective dispatch and combine use.

`Exchange` is that collective, `all_to_all_single` with `torch.distributed`'s signature, plus
the caller's rank and the group size. `GroupExchange` runs it on a `torch.distributed` process
group (gloo, NCCL); the engine may hand the MoE layer another implementation instead, such as
a shared-memory exchange for ranks on one host (`dist_engine.distributed.shm_exchange`). moe/
only calls the protocol: it never learns how the rows travel.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist


@runtime_checkable
class Exchange(Protocol):
    rank: int
    size: int

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        """Rows input[splits_in[r]] go to rank r; output receives, in rank order, what each
        rank sent here. Split sizes count rows along dim 0; None means equal splits. Every
        rank of the group calls it, in the same order, like any collective."""
        ...


class GroupExchange:
    """`Exchange` over a torch.distributed process group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=self.group
        )


class Unjoined:
    """The `Exchange` of a rank whose group does not exist yet: a replacement rank loads its
    share of the experts before it joins the group it replaces a rank of. It knows its rank
    and the group's size (a layer checks its placement against them) and refuses to swap rows
    until the layer is given the real exchange (`MoELayer.join`)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        raise RuntimeError(
            f"rank {self.rank} has not joined its group of {self.size} yet: no rows can be "
            "exchanged"
        )


def as_exchange(group: dist.ProcessGroup | Exchange) -> Exchange:
    """A process group wrapped in `GroupExchange`; an `Exchange` as is."""
    if isinstance(group, dist.ProcessGroup):
        return GroupExchange(group)
    # Not isinstance(group, Exchange): a runtime protocol check is far slower than this attribute
    # look-up, and it would run per layer call (docs/benchmark_notes.md, "MoE layer").
    if not callable(getattr(group, "all_to_all_single", None)):
        raise TypeError(f"expected a torch.distributed ProcessGroup or an Exchange, got {group!r}")
    return group
