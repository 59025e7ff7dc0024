"""Rotary tables: what a runner's model looks up equals what it would compute, to the bit."""

from __future__ import annotations

import pytest
import torch

from dist_engine.layers.rotary import RotaryEmbedding, YarnScaling

YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                   mscale_all_dim=1.0)  # fmt: skip


@pytest.mark.parametrize(
    ("rotary_dim", "theta", "scaling", "dtype"),
    [
        (64, 1e6, None, torch.float32),
        (32, 1e4, None, torch.bfloat16),
        (24, 1e4, None, torch.float16),  # not a multiple of any vector width
        (64, 1e4, YARN, torch.float32),
        (64, 1e4, YARN, torch.bfloat16),
    ],
)
def test_looked_up_rows_equal_computed_ones(rotary_dim, theta, scaling, dtype) -> None:
    computed = RotaryEmbedding(rotary_dim, theta, scaling=scaling)
    tabled = RotaryEmbedding(rotary_dim, theta, scaling=scaling)
    tabled.cache(3000, dtype)
    generator = torch.Generator().manual_seed(rotary_dim)
    for num_tokens in (1, 5, 31, 64, 257, 2999):
        positions = torch.randint(0, 3000, (num_tokens,), generator=generator)
        for got, expected in zip(
            tabled.cos_sin(positions, dtype), computed.cos_sin(positions, dtype), strict=True
        ):
            assert got.dtype == dtype and got.shape == (num_tokens, rotary_dim)
            assert torch.equal(got, expected), num_tokens


def test_tables_only_grow_and_follow_the_dtype() -> None:
    rotary = RotaryEmbedding(16, 1e4)
    rotary.cache(100, torch.float32)
    table = rotary.cos_table
    rotary.cache(50, torch.float32)  # a shorter runner keeps the longer table
    assert rotary.cos_table is table and table.shape == (100, 16)
    rotary.cache(200, torch.float32)
    assert rotary.cos_table.shape == (200, 16)
    positions = torch.tensor([0, 199])
    cos, _ = rotary.cos_sin(positions, torch.bfloat16)  # another dtype: computed, not looked up
    assert cos.dtype == torch.bfloat16
    with pytest.raises(IndexError):
        rotary.cos_sin(torch.tensor([200]), torch.float32)
