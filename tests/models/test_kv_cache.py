"""Paged KV cache: slot math, metadata, and paged attention against dense causal attention."""

from __future__ import annotations

import gc
import math
import threading
import warnings

import pytest
import torch

import dist_engine.attention.torch_backend as paged_attention_module
from dist_engine.attention import attention_backend
from dist_engine.attention.kv_cache import (
    KVCache,
    bytes_per_block,
    num_blocks_for_budget,
    slot_mapping_for,
)
from dist_engine.attention.metadata import AttentionMetadata, int64_tensor
from dist_engine.attention.torch_backend import paged_attention, write_kv
from dist_engine.backends import Backends, LayerOps, RegimeChoice, resolve_backends
from dist_engine.kernels import build, compute
from dist_engine.layers.rotary import RotaryEmbedding, apply_rotary
from dist_engine.models.config import ModelConfig
from dist_engine.models.registry import parse_config

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 8, 4


def test_slot_mapping_math() -> None:
    table = [7, 3, 9]
    # Positions 2..6 with BS=4: block 7 offsets 2,3 then block 3 offsets 0,1,2.
    assert slot_mapping_for(table, 2, 5, 4) == [30, 31, 12, 13, 14]
    attn = AttentionMetadata.build([table, [5]], [2, 0], [5, 1], 4, is_prefill=True)
    assert attn.slot_mapping.tolist() == [30, 31, 12, 13, 14, 20]
    assert attn.positions.tolist() == [2, 3, 4, 5, 6, 0]
    assert attn.context_lens.tolist() == [7, 1]
    assert attn.query_start_loc.tolist() == [0, 5, 6]
    # Only the columns the longest context needs; the short table is padded with block 0.
    assert attn.block_tables.tolist() == [[7, 3], [5, 0]]
    assert attn.max_query_len == 5 and attn.is_prefill


@pytest.mark.parametrize(
    "values", [[], [0], [3, -1, 2**62, -(2**63)], list(range(2560)), (5, 4), range(7)]
)
def test_int64_tensor_equals_torch_tensor(values) -> None:
    made = int64_tensor(values)
    assert made.dtype == torch.int64 and made.shape == (len(values),)
    assert torch.equal(made, torch.tensor(list(values), dtype=torch.int64))
    assert torch.equal(int64_tensor(values, "cpu"), made)


def test_int64_tensor_keeps_its_values_alive() -> None:
    made = [int64_tensor(list(range(i, i + 100))) for i in range(20)]
    gc.collect()
    _ = [torch.full((100,), 7) for _ in range(50)]  # reuse freed memory, if any was freed
    assert all(int(t[0]) == i and int(t[-1]) == i + 99 for i, t in enumerate(made))


def test_metadata_rejects_short_block_table_and_empty_queries() -> None:
    with pytest.raises(ValueError, match=r"needs 2 blocks of 4, but its block table has 1"):
        AttentionMetadata.build([[3]], [4], [1], 4, is_prefill=False)
    with pytest.raises(ValueError, match="num_new_tokens >= 1"):
        AttentionMetadata.build([[3]], [0], [0], 4, is_prefill=True)
    with pytest.raises(ValueError, match="one entry per sequence"):
        AttentionMetadata.build([[3], [4]], [0], [1, 1], 4, is_prefill=True)


def _dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int):
    """query [Q, H, Dh] at positions cached..cached+Q-1; keys/values [C, Hkv, Dh]."""
    groups = NUM_HEADS // NUM_KV_HEADS
    keys = keys.repeat_interleave(groups, dim=1)
    values = values.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, keys) / math.sqrt(HEAD_DIM)
    q_pos = torch.arange(cached, cached + query.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


@pytest.mark.parametrize(
    ("num_cached", "num_new"),
    [
        ([0, 5, 9, 3], [6, 3, 1, 1]),  # fresh prompt, chunk with prefix, two decodes
        ([0, 0, 0], [5, 9, 7]),  # prompts of similar lengths, not sorted: one causal group
        # Prompts of mixed lengths (three causal groups) around a chunk with a prefix.
        ([0, 0, 7, 0, 0, 0], [13, 2, 5, 6, 1, 12]),
        ([4, 11, 0], [1, 1, 1]),  # decode fast path (one is a one-token prompt)
        ([8], [8]),  # a chunk exactly on a block boundary
        ([30, 2, 17, 9, 0], [1, 1, 1, 1, 1]),  # five decodes of different lengths
    ],
)
@pytest.mark.parametrize("decode_path", ["fused", "torch", "torch_chunk1", "torch_chunk2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_paged_attention_matches_dense(
    num_cached: list[int],
    num_new: list[int],
    decode_path: str,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """decode_path picks how attention runs: the C++ kernels (decode, and prefill for float32),
    or the PyTorch paths, decode with its own chunking or forced chunks of 1 or 2 sequences."""
    if decode_path == "fused":
        require_fused_kernel()
    backend = attention_backend("native" if decode_path == "fused" else "torch")
    if decode_path.startswith("torch_chunk"):
        chunk = int(decode_path.removeprefix("torch_chunk"))
        monkeypatch.setattr(paged_attention_module, "_decode_chunk", lambda *_: chunk)
    gen = torch.Generator().manual_seed(sum(num_cached) + len(num_new))
    cache = KVCache(1, 64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)
    key_cache, value_cache = cache.layer(0)
    # Scattered, non-contiguous block tables that never use the reserved block 0.
    free = (torch.randperm(63, generator=gen) + 1).tolist()
    contexts = [c + n for c, n in zip(num_cached, num_new, strict=True)]
    tables = [[free.pop() for _ in range(-(-c // BLOCK_SIZE))] for c in contexts]
    full_k = [torch.randn(c, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=dtype) for c in contexts]
    full_v = [torch.randn(c, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=dtype) for c in contexts]

    prefix = [b for b, c in enumerate(num_cached) if c > 0]
    if prefix:  # an earlier step cached the prefixes
        before = AttentionMetadata.build(
            [tables[b] for b in prefix],
            [0] * len(prefix),
            [num_cached[b] for b in prefix],
            BLOCK_SIZE,
            is_prefill=True,
        )
        write_kv(
            torch.cat([full_k[b][: num_cached[b]] for b in prefix]),
            torch.cat([full_v[b][: num_cached[b]] for b in prefix]),
            key_cache,
            value_cache,
            before.slot_mapping,
        )

    attn = AttentionMetadata.build(tables, num_cached, num_new, BLOCK_SIZE, is_prefill=True)
    new_k = torch.cat([k[c:] for k, c in zip(full_k, num_cached, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(full_v, num_cached, strict=True)])
    write_kv(new_k, new_v, key_cache, value_cache, attn.slot_mapping)
    query = torch.randn(sum(num_new), NUM_HEADS, HEAD_DIM, generator=gen, dtype=dtype)
    out = backend.attend(query, key_cache, value_cache, attn)

    starts = attn.query_start_loc.tolist()
    for b in range(len(num_new)):
        q = query[starts[b] : starts[b + 1]]
        expected = _dense_attention(q, full_k[b], full_v[b], num_cached[b])
        torch.testing.assert_close(out[starts[b] : starts[b + 1]], expected)
    if max(num_new) == 1:  # a decode step's tables as the runner buckets them: wider, block 0
        width = attn.block_tables.shape[1] + 3
        wide = AttentionMetadata.build(tables, num_cached, num_new, BLOCK_SIZE, False, None, width)
        assert wide.attn_mask is None and wide.block_tables.shape[1] == width
        torch.testing.assert_close(backend.attend(query, key_cache, value_cache, wide), out)
    assert torch.count_nonzero(key_cache[0]) == 0, "block 0 is reserved and must stay untouched"


def require_fused_kernel():
    """The kernel; a failed build fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the build's fallback warning becomes a failure here
        kernel = compute.decode_attention()
    assert kernel is not None
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 2, 8, 16), (8, 4, 32, 16), (4, 4, 64, 16), (8, 2, 128, 16), (8, 4, 32, 8), (4, 2, 64, 32)],
)
def test_fused_decode_kernel_matches_torch_path(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """The kernel against the PyTorch decode path on the same cache: scattered blocks, contexts
    from 1 token to several blocks, GQA groups of 1 and more, the head sizes the kernel
    specialises (32, 64, 128: vector paths for float32 and bfloat16, which walk blocks in
    chunks of up to 16 tokens, so blocks of 8 and 32 too) and one it does not (8), float32 (its
    own exp), float64, and the half types (float accumulation)."""
    kernel = require_fused_kernel()
    gen = torch.Generator().manual_seed(head_dim + block_size)
    lengths = [1, 3, 16, 17, 40, 64, 95]
    cache = KVCache(1, 200, block_size, num_kv_heads, head_dim, dtype)
    key_cache, value_cache = cache.layer(0)
    key_cache.copy_(torch.randn(key_cache.shape, generator=gen, dtype=torch.float64) * 2)
    value_cache.copy_(torch.randn(value_cache.shape, generator=gen, dtype=torch.float64))
    free = (torch.randperm(199, generator=gen) + 1).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    attn = AttentionMetadata.build(
        tables, [n - 1 for n in lengths], [1] * len(lengths), block_size, False
    )
    query = torch.randn(len(lengths), num_heads, head_dim, generator=gen, dtype=torch.float64)
    query = query.to(dtype) * 2
    expected = paged_attention_module._decode(
        query, key_cache, value_cache, attn.block_tables, attn.context_lens
    )
    actual = kernel(
        query, key_cache, value_cache, attn.block_tables, attn.context_lens, head_dim**-0.5
    )
    if dtype in (torch.float32, torch.float64):
        tolerance = 1e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)
        return
    # Half types: both paths round their result once; the kernel must be at least as close as
    # the PyTorch path to the float64 answer on the same (rounded) inputs.
    exact = paged_attention_module._decode(
        query.double(),
        key_cache.double(),
        value_cache.double(),
        attn.block_tables,
        attn.context_lens,
    )
    kernel_error = (actual.double() - exact).abs().max()
    torch_error = (expected.double() - exact).abs().max()
    assert actual.dtype == dtype
    assert kernel_error <= 1.5 * torch_error + 1e-3, (kernel_error, torch_error)


def test_fused_decode_kernel_rejects_bad_input() -> None:
    kernel = require_fused_kernel()
    cache = KVCache(1, 8, 4, 2, 8, torch.float32)
    key_cache, value_cache = cache.layer(0)
    query = torch.zeros(1, 4, 8)
    lens = torch.tensor([5])
    with pytest.raises(RuntimeError, match=r"names block 8 of a cache with 8 blocks"):
        kernel(query, key_cache, value_cache, torch.tensor([[1, 8]]), lens, 1.0)
    with pytest.raises(RuntimeError, match=r"context length 9 of sequence 0 outside"):
        kernel(query, key_cache, value_cache, torch.tensor([[1, 2]]), torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match=r"share a dtype"):
        kernel(query.double(), key_cache, value_cache, torch.tensor([[1, 2]]), lens, 1.0)


def test_backends_come_from_the_config_keys() -> None:
    """Each key resolves to one implementation per regime; `torch` never touches a kernel,
    `auto` takes the kernels for float32 on the CPU, and `native` where it cannot run names
    the key."""
    torch_only = resolve_backends(
        {
            "attention_backend": "torch",
            "expert_backend": "torch",
            "norm_backend": "torch",
            "sampler_backend": "torch",
        },
        torch.float32,
        "cpu",
    )
    assert torch_only == Backends.all("torch")
    ops = LayerOps.build(torch_only, max_decode_tokens=8)
    assert ops.attention.name == "torch" and ops.norm is None
    assert set(ops.experts.values()) == {None}
    auto = resolve_backends({}, torch.float32, None)
    assert auto == Backends.all("native")
    native_ops = LayerOps.build(auto, max_decode_tokens=8)
    assert native_ops.attention.name == "native" and native_ops.norm.max_tokens is None
    # Decode attention runs natively on every float dtype, prefill attention, the experts and
    # the norm on float32 and bfloat16.
    half = resolve_backends({}, torch.bfloat16, "cpu")
    assert (half.attention.decode, half.attention.prefill) == ("native", "native")
    assert (half.experts.decode, half.norm.decode) == ("native", "native")
    fp16 = resolve_backends({}, torch.float16, "cpu")
    assert (fp16.attention.decode, fp16.attention.prefill) == ("native", "torch")
    with pytest.raises(ValueError, match=r"expert_backend is 'native'.*float16"):
        resolve_backends({"expert_backend": "native"}, torch.float16, "cpu")
    with pytest.raises(ValueError, match=r"norm_backend is 'native'.*float16"):
        resolve_backends({"norm_backend": "native"}, torch.float16, "cpu")
    with pytest.raises(ValueError, match=r"expert_backend must be one of"):
        resolve_backends({"expert_backend": "fast"}, torch.float32, "cpu")
    split = Backends(RegimeChoice("native", "torch"), auto.experts, RegimeChoice("native", "torch"))
    split_ops = LayerOps.build(split, max_decode_tokens=8)
    assert split_ops.attention.name == "per-regime" and split_ops.norm.max_tokens == 8
    assert str(split.attention) == "decode native, prefill torch"


def test_kernels_and_transport_build_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compute kernels build once per process, and a failed kernel build leaves the
    shared-memory transport (a library of its own) available, and the reverse."""
    from dist_engine.distributed import shm_exchange

    builds: list[str] = []

    def failing_extension(prefix, *args):
        builds.append(prefix)
        return None, "no compiler here"

    monkeypatch.setattr(compute, "_state", {})
    monkeypatch.setattr(compute, "torch_extension", failing_extension)
    monkeypatch.setattr(shm_exchange, "_library", {})
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        assert not compute.prepare()
    assert not compute.prepare() and builds == ["lockstep_kernels"]  # once per process
    assert shm_exchange.transport_library()[0] is not None
    # The reverse: no transport library, the kernels still there.
    monkeypatch.undo()
    monkeypatch.setattr(shm_exchange, "_library", {})
    monkeypatch.setattr(shm_exchange, "shared_library", lambda *a: (None, "no compiler"))
    assert shm_exchange.transport_library() == (None, "no compiler")
    assert compute.prepare() and compute.decode_attention() is not None


@pytest.mark.parametrize("failure", ["error", "stuck"])
def test_kernel_build_failure_falls_back_with_a_warning(
    failure: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """A failed build, or one that never returns (a stale build lock), gives one warning naming
    the cause and the PyTorch path; it never raises and never hangs."""
    from torch.utils import cpp_extension

    release = threading.Event()

    def broken_load(**_):
        if failure == "stuck":
            release.wait(30)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compute, "_state", {})
    monkeypatch.setattr(build, "BUILD_TIMEOUT_S", 0.2)
    monkeypatch.setattr(build, "cache_root", lambda: tmp_path)  # nothing cached: a real build
    monkeypatch.setattr(cpp_extension, "load", broken_load)
    expected = "no result after 0 s" if failure == "stuck" else "no compiler here"
    try:
        with pytest.warns(RuntimeWarning, match=expected):
            assert compute.decode_attention() is None
        assert compute.decode_attention() is None  # decided once per process, no rebuild
        assert compute.routed_swiglu() is None  # one module holds every kernel
        # `auto` falls back to PyTorch's ops everywhere.
        assert resolve_backends({}, torch.float32, "cpu") == Backends.all("torch")
    finally:
        release.set()


def _config() -> ModelConfig:
    return parse_config(
        {
            "model_type": "mixtral",
            "vocab_size": 32,
            "hidden_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_experts_per_tok": 2,
            "num_local_experts": 4,
            "intermediate_size": 16,
        }
    )


def test_num_blocks_for_budget() -> None:
    config = _config()
    # 2 (K, V) * 3 layers * 16 tokens * 2 heads * 16 dims * 2 bytes
    assert bytes_per_block(config, 16, torch.bfloat16) == 2 * 3 * 16 * 2 * 16 * 2
    assert num_blocks_for_budget(config, 16, torch.bfloat16, 10 * 6144 + 100) == 10
    with pytest.raises(ValueError, match="holds 1 blocks"):
        num_blocks_for_budget(config, 16, torch.bfloat16, 6144)
    cache = KVCache.for_model(config, 10, 16, torch.bfloat16)
    key, value = cache.layer(2)
    assert key.shape == value.shape == (10, 16, 2, 16)
    assert cache.storage.numel() * 2 == 10 * bytes_per_block(config, 16, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [0, 1, 37])
def test_rope_kernel_matches_rotary_then_write_kv(num_tokens: int, dtype) -> None:
    """rope_write_kv against apply_rotary + write_kv, on q/k/v views into one fused qkv
    output (the strides the model hands it): to float32 rounding in float32, bit for bit in
    bfloat16 (each product and the sum rounded as PyTorch's bf16 ops round them)."""
    kernel = compute.rope_write_kv()
    assert kernel is not None, "the CPU kernels failed to build (see the warning)"
    gen = torch.Generator().manual_seed(num_tokens)
    heads, kv_heads, head_dim = 4, 2, 8
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    query, key, value = qkv.split(sizes, dim=-1)
    query = query.view(num_tokens, heads, head_dim)
    key = key.view(num_tokens, kv_heads, head_dim)
    value = value.view(num_tokens, kv_heads, head_dim)
    positions = torch.randint(0, 500, (num_tokens,), generator=gen)
    cos, sin = RotaryEmbedding(head_dim, 10000.0).cos_sin(positions, dtype)
    slots = torch.randperm(12 * 4, generator=gen)[:num_tokens] + 4  # never block 0
    caches = [KVCache(1, 13, 4, kv_heads, head_dim, dtype).layer(0) for _ in range(2)]
    rotated = kernel(query, key, value, cos, sin, slots, *caches[0])
    expected_q = apply_rotary(query, cos, sin)
    write_kv(apply_rotary(key, cos, sin), value, *caches[1], slots)
    assert rotated.is_contiguous() and rotated.dtype == dtype
    for ours, theirs in zip((rotated, *caches[0]), (expected_q, *caches[1]), strict=True):
        if dtype == torch.bfloat16:
            assert torch.equal(ours, theirs)
        else:
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    if num_tokens:
        with pytest.raises(RuntimeError, match=r"slot_mapping\[0\] = 52 is outside the cache's"):
            kernel(query[:1], key[:1], value[:1], cos[:1], sin[:1], torch.tensor([52]), *caches[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 24])
def test_prefill_kernel_matches_the_torch_path(head_dim: int, dtype: torch.dtype) -> None:
    """The prefill kernel's vector path (blocks of 16, head dims 32/64) and its scalar path
    (head dim 24) against the PyTorch SDPA path on the same cache: fresh prompts of mixed
    lengths, chunks behind cached prefixes, GQA groups of 2. In bfloat16 the kernel computes in
    float32 and rounds once: within bfloat16's rounding of the float32 result on the same
    (bfloat16) values, and as close to PyTorch's bfloat16 path as that is."""
    require_fused_kernel()
    gen = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, block = 4, 2, 16
    cache = KVCache(1, 80, block, kv_heads, head_dim, dtype)
    key_cache, value_cache = cache.layer(0)
    with torch.no_grad():
        key_cache.copy_(torch.randn(key_cache.shape, generator=gen))
        value_cache.copy_(torch.randn(value_cache.shape, generator=gen))
    num_cached, num_new = [0, 0, 37, 0, 16], [150, 3, 40, 17, 1]
    free = (torch.randperm(79, generator=gen) + 1).tolist()
    tables = [
        [free.pop() for _ in range(-(-(c + n) // block))]
        for c, n in zip(num_cached, num_new, strict=True)
    ]
    attn = AttentionMetadata.build(tables, num_cached, num_new, block, is_prefill=True)
    query = torch.randn(sum(num_new), heads, head_dim, generator=gen).to(dtype)
    fused = attention_backend("native").attend(query, key_cache, value_cache, attn)
    assert fused.dtype == dtype
    if dtype == torch.float32:
        reference = paged_attention(query, key_cache, value_cache, attn)
        torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
        return
    exact = paged_attention(query.float(), key_cache.float(), value_cache.float(), attn)
    # bfloat16 keeps 8 significant bits: one rounding is within 2^-9 of the value.
    torch.testing.assert_close(fused.float(), exact, rtol=2**-8, atol=1e-6)
    theirs = paged_attention(query, key_cache, value_cache, attn).float()
    ours_error = (fused.float() - exact).abs().max()
    assert ours_error <= (theirs - exact).abs().max() * 1.01 + 1e-6
