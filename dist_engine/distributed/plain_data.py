"""Exchanging plain data between ranks: JSON in byte tensors, never pickle.

torch.distributed's `*_object` collectives unpickle whatever arrives on the socket, and a
process group's sockets (like the rendezvous store beside them) may be reachable from outside
the job; unpickling turns that into code execution. Everything the ranks swap that is not a
tensor (settings, names, results) goes through these two functions instead: JSON values only,
decoded with `json.loads`.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def all_gather_json(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `value` (JSON-serialisable), in rank order. Collective over `group`.

    A group of one answers alone (the value through JSON, as a peer would get it): its
    collective would only copy the bytes on gloo's worker thread, and a large copy there
    starts an OpenMP pool beside the engine thread's, which slows every parallel op of the
    rank (docs/benchmark_notes.md, "A Ray rank against the same engine in-process").
    """
    world = dist.get_world_size(group)
    if world == 1:
        return [json.loads(json.dumps(value))]
    payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    sizes = torch.empty(world, dtype=torch.int64)
    dist.all_gather_single(sizes, torch.tensor([payload.numel()]), group=group)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = torch.empty(world * longest, dtype=torch.uint8)
    dist.all_gather_single(gathered, padded, group=group)
    rows = gathered.view(world, longest)
    return [
        json.loads(bytes(rows[rank, : int(sizes[rank])].tolist()).decode()) for rank in range(world)
    ]


def broadcast_json(value: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """`src`'s `value` on every rank (other ranks pass anything, e.g. None)."""
    return all_gather_json(value if dist.get_rank(group) == src else None, group)[src]
