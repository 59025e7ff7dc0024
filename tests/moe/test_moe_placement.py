"""ExpertPlacement maps and validation; deterministic, spread-out replica choice."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe import ExpertPlacement, choose_replicas


def test_even_placement_is_contiguous_blocks() -> None:
    placement = ExpertPlacement.even(8, 4)
    assert placement.slots_per_rank == 2
    assert placement.phy2log.tolist() == list(range(8))
    assert placement.log2phy.tolist() == [[e] for e in range(8)]
    assert placement.logcnt.tolist() == [1] * 8
    assert placement.hosted_slots(2) == [4, 5]
    assert placement.hosted_logical(3) == [6, 7]


def test_from_phy2log_with_replicas() -> None:
    # 2 ranks x 3 slots; expert 0 has three replicas, expert 2 two.
    placement = ExpertPlacement.from_phy2log([0, 1, 0, 2, 0, 2], num_experts=3, num_ranks=2)
    assert placement.logcnt.tolist() == [3, 1, 2]
    assert placement.log2phy.tolist() == [[0, 2, 4], [1, -1, -1], [3, 5, -1]]
    assert placement.hosted_slots(1) == [3, 4, 5]
    assert placement.hosted_logical(0) == [0, 1]
    assert placement.hosted_logical(1) == [0, 2]


def test_placement_validation_names_values() -> None:
    with pytest.raises(ValueError, match=r"num_experts=6 .* num_ranks=4"):
        ExpertPlacement.even(6, 4)
    with pytest.raises(ValueError, match=r"logical experts \[1, 3\] have no physical slot"):
        ExpertPlacement.from_phy2log([0, 2, 0, 2], num_experts=4, num_ranks=2)
    with pytest.raises(ValueError, match=r"outside \[0, num_experts=3\): \[3, -1\]"):
        ExpertPlacement.from_phy2log([0, 1, 2, 3, -1, 0], num_experts=3, num_ranks=2)
    with pytest.raises(ValueError, match=r"num_ranks=4 must be >= 1 and divide .* P=6"):
        ExpertPlacement.from_phy2log([0, 1, 2, 0, 1, 2], num_experts=3, num_ranks=4)
    with pytest.raises(ValueError, match=r"non-empty 1-D"):
        ExpertPlacement.from_phy2log([], num_experts=3, num_ranks=1)
    with pytest.raises(ValueError, match=r"rank=2 outside \[0, num_ranks=2\)"):
        ExpertPlacement.even(4, 2).hosted_slots(2)


def test_choose_replicas_without_replicas_is_identity_map() -> None:
    placement = ExpertPlacement.from_phy2log([3, 1, 0, 2], num_experts=4, num_ranks=2)
    ids = torch.tensor([[0, 3], [2, 1]])
    assert choose_replicas(ids, placement, token_offset=17).tolist() == [[2, 0], [3, 1]]


def test_choose_replicas_spreads_evenly_over_replicas() -> None:
    placement = ExpertPlacement.from_phy2log([0, 1, 0, 2, 0, 2], num_experts=3, num_ranks=2)
    ids = torch.zeros(300, 1, dtype=torch.int64)  # every token wants expert 0 (3 replicas)
    physical = choose_replicas(ids, placement, token_offset=5)
    assert torch.bincount(physical.flatten(), minlength=6).tolist() == [100, 0, 100, 0, 100, 0]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    num_tokens=st.integers(0, 20),
    top_k=st.integers(1, 4),
    token_offset=st.integers(0, 10_000),
)
def test_choose_replicas_is_a_function_of_global_token_index(
    seed: int, num_tokens: int, top_k: int, token_offset: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_experts, num_ranks = 6, 3
    extra = torch.randint(num_experts, (9 - num_experts,), generator=gen)
    phy2log = torch.cat([torch.arange(num_experts), extra])[torch.randperm(9, generator=gen)]
    placement = ExpertPlacement.from_phy2log(phy2log, num_experts, num_ranks)
    ids = torch.rand(num_tokens + 1, num_experts, generator=gen).argsort(dim=1)[:, :top_k]

    physical = choose_replicas(ids, placement, token_offset)
    # Always a replica of the requested logical expert.
    assert torch.equal(placement.phy2log[physical], ids)
    # Reproducible, and the same choice for a token whichever batch split carries it.
    assert torch.equal(physical, choose_replicas(ids, placement, token_offset))
    shifted = choose_replicas(ids[1:], placement, token_offset + 1)
    assert torch.equal(shifted, physical[1:])


def test_choose_replicas_rejects_1d_ids() -> None:
    with pytest.raises(ValueError, match=r"topk_ids must be \[T, K\], got shape \(3,\)"):
        choose_replicas(torch.tensor([0, 1, 2]), ExpertPlacement.even(4, 1), 0)
