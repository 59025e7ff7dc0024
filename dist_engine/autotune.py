"""`auto` backends: each rank times the candidates on its model's shapes and picks per regime.

For each kind of op (attention, experts, norm, the dense linears) and each regime, the rank
builds inputs of its model's real shapes at the sizes its steps will have, and times every
candidate that can run them (interleaved repeats after a warm-up; the median counts):

- decode: `max_num_seqs` sequences — attention over a cached context of `DECODE_CONTEXT`
  tokens, the experts on the rows an EP group delivers (every rank's tokens, each row's
  top-k choices local with probability 1 / EP size), the norms on `max_num_seqs` rows, the
  linears as one layer's attention projections and the LM head on `max_num_seqs` rows, the
  sampler's draw at temperature 1.0 on `max_num_seqs` rows of the vocabulary;
- prefill: the token budget (`max_num_batched_tokens`) — prompts of up to `PREFILL_PROMPT`
  tokens, and the experts', norms' and projections' rows likewise.

The fastest candidate wins each regime, except where a kind of op has a required gain
(`REQUIRED_GAIN`): there a candidate replaces PyTorch's path only when it times that much
faster. Decisions are cached per host under the Lockstep cache
(`autotune/`), keyed by what makes them valid: the CPU (model name and instruction-set flags),
torch's thread count and version, the compute kernels' build, the dtype and every shape. A
second start with the same key reads the decision instead of timing. Timings go to the log;
the choice is in the run summary.

A kernel tuned on one processor is never forced on another: on each host the measured
fastest serves, PyTorch's own path among the candidates.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from dist_engine.kernels.build import cache_root, cpu_flags
from moe import ExpertPlacement

if TYPE_CHECKING:
    from dist_engine.models.config import ModelConfig

DECODE_CONTEXT = 256  # cached tokens per sequence in the decode attention timing
PREFILL_PROMPT = 256  # the longest prompt in the prefill timing
SAMPLER_VOCAB = 32000  # the sampler's timing width where the shapes give no vocabulary
WARMUP = 2
REPEATS = 7


@dataclass(frozen=True)
class TuneShapes:
    """What the timings depend on besides the host: the model's and the steps' sizes."""

    dtype: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_local_experts: int
    moe_intermediate_size: int
    top_k: int
    ep_size: int
    decode_tokens: int  # max_num_seqs
    prefill_tokens: int  # max_num_batched_tokens
    block_size: int
    attention_kind: str  # ModelConfig.attention_kind: "gqa" is what the attention backends time
    vocab_size: int = 0  # the LM head's width, in the linears' timing (0: no LM head timed)

    @classmethod
    def for_model(
        cls,
        model: ModelConfig,
        dtype: str,
        ep_size: int,
        decode_tokens: int,
        prefill_tokens: int,
        block_size: int,
    ) -> TuneShapes:
        """The shapes of `model` on one rank of an EP group of `ep_size`, whose decode steps
        hold `decode_tokens` sequences and prefill steps `prefill_tokens` tokens."""
        return cls(
            dtype=dtype,
            hidden_size=model.hidden_size,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            num_local_experts=ExpertPlacement.even(model.num_experts, ep_size).slots_per_rank,
            moe_intermediate_size=model.moe_intermediate_size,
            top_k=model.top_k,
            ep_size=ep_size,
            decode_tokens=decode_tokens,
            prefill_tokens=prefill_tokens,
            block_size=block_size,
            attention_kind=model.attention_kind,
            vocab_size=model.vocab_size,
        )


# How much faster than PyTorch's path (`torch`) a candidate must time to replace it, per kind of
# op; 1.0 where not named. The linears' timing (isolated calls) overstates small gains: on an
# AVX2 EPYC the project's Qwen3-MoE timed oneDNN 2-7% faster per call and ran 5-10% slower end
# to end with it, while Mixtral's LM head, timed 1.85x faster, ran 1.32x faster end to end
# (bench_vs_vllm.py --variant; docs/benchmark_notes.md, "On the AVX2 host").
REQUIRED_GAIN = {"linear": 1.15}


def choose(op: str, timings: dict[str, float]) -> str:
    """The fastest of ``timings`` (ms), or `torch` where no other times ``REQUIRED_GAIN[op]``
    times faster than it."""
    fastest = min(timings, key=timings.get)
    gain = REQUIRED_GAIN.get(op, 1.0)
    if "torch" in timings and fastest != "torch" and timings["torch"] < gain * timings[fastest]:
        return "torch"
    return fastest


@dataclass(frozen=True)
class Decision:
    op: str
    regime: str
    choice: str
    timings_ms: dict[str, float]

    def describe(self) -> str:
        times = ", ".join(f"{name} {ms:.3f} ms" for name, ms in self.timings_ms.items())
        return f"{self.op} {self.regime}: {self.choice} ({times})"


def host_key(shapes: TuneShapes, candidates: dict[str, dict[str, list[str]]]) -> str:
    """The cache key: host, threads, torch, kernels build, shapes and candidates."""
    from dist_engine.kernels.compute import kernels_name

    parts = {
        "cpu": _cpu_model(),
        "flags": hashlib.sha256(cpu_flags().encode()).hexdigest()[:16],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kernels": kernels_name(),
        "shapes": asdict(shapes),
        "candidates": candidates,
        "required_gain": REQUIRED_GAIN,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def tune(
    shapes: TuneShapes,
    candidates: dict[str, dict[str, list[str]]],
    log: Callable[[str], None],
) -> dict[str, dict[str, str]]:
    """candidates: op → regime → the implementations that can serve it (two or more to
    choose between). Returns op → regime → choice, from the cache or by timing now."""
    path = cache_root() / "autotune" / f"{host_key(shapes, candidates)}.json"
    try:
        cached = json.loads(path.read_text())
        log(f"backend choices from {path} (timed on this host earlier)")
        return cached["choices"]
    except (OSError, ValueError, KeyError):
        pass
    decisions = []
    for op, regimes in candidates.items():
        for regime, names in regimes.items():
            runs = {name: _workload(op, regime, name, shapes) for name in names}
            timings = time_interleaved(runs)
            choice = choose(op, timings)
            decisions.append(Decision(op, regime, choice, timings))
            log("timed " + decisions[-1].describe())
    choices: dict[str, dict[str, str]] = {}
    for decision in decisions:
        choices.setdefault(decision.op, {})[decision.regime] = decision.choice
    record = {
        "choices": choices,
        "timings_ms": [asdict(d) for d in decisions],
        "shapes": asdict(shapes),
        "threads": torch.get_num_threads(),
        "cpu": _cpu_model(),
        "torch": torch.__version__,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    partial.replace(path)  # ranks of one host may race to write the same decision
    return choices


def time_interleaved(runs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median milliseconds per call of each run, one call of each per repeat, so the host's
    noise hits them alike."""
    for _ in range(WARMUP):
        for run in runs.values():
            run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(REPEATS):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


# -- workloads ----------------------------------------------------------------------------
def _workload(op: str, regime: str, name: str, shapes: TuneShapes) -> Callable[[], object]:
    builder = {
        "attention": _attention,
        "experts": _experts,
        "norm": _norm,
        "linear": _linear,
        "sampler": _sampler,
    }[op]
    return builder(regime, name, shapes)


def _dtype(shapes: TuneShapes) -> torch.dtype:
    return getattr(torch, shapes.dtype)


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _experts(regime: str, name: str, shapes: TuneShapes) -> Callable[[], object]:
    from dist_engine.layers.moe import expert_impl
    from moe import LocalExperts

    gen = _generator()
    slots, ep, top_k = shapes.num_local_experts, shapes.ep_size, shapes.top_k
    experts = LocalExperts(slots, shapes.hidden_size, shapes.moe_intermediate_size, _dtype(shapes))
    with torch.no_grad():
        for weight in (experts.w13, experts.w2):
            weight.copy_(torch.randn(weight.shape, generator=gen) * weight.shape[1] ** -0.5)
    tokens = shapes.decode_tokens if regime == "decode" else shapes.prefill_tokens
    rows = tokens * ep  # every rank's tokens arrive here
    local_slots = torch.randint(slots, (rows, top_k), generator=gen)
    if ep > 1:  # each choice is served here with probability 1 / EP
        elsewhere = torch.randint(ep, (rows, top_k), generator=gen) != 0
        local_slots[elsewhere] = -1
    weights = torch.where(local_slots >= 0, torch.rand(rows, top_k, generator=gen), 0.0)
    hidden = torch.randn(rows, shapes.hidden_size, generator=gen).to(_dtype(shapes))
    impl = expert_impl(name)
    return lambda: experts.weighted_sum(hidden, local_slots, weights, impl)


def _norm(regime: str, name: str, shapes: TuneShapes) -> Callable[[], object]:
    from dist_engine.kernels import compute
    from dist_engine.layers.norm import NormKernel, RMSNorm

    kernel = NormKernel(compute.rms_norm()) if name == "native" else None
    norm = RMSNorm(shapes.hidden_size, 1e-6, _dtype(shapes), kernel=kernel)
    with torch.no_grad():
        norm.weight.fill_(1.0)
    tokens = shapes.decode_tokens if regime == "decode" else shapes.prefill_tokens
    x = torch.randn(tokens, shapes.hidden_size, generator=_generator()).to(_dtype(shapes))
    return lambda: norm(x)


def _linear(regime: str, name: str, shapes: TuneShapes) -> Callable[[], object]:
    """One layer's attention projections (qkv, output) on the regime's rows, and in decode the
    LM head. (A prefill step's LM head sees only the rows that sample, at most a decode
    step's, and the kernels are told apart by rows: it runs the decode choice.)"""
    from dist_engine.layers.linear import LinearKernel, linear, pack_weight

    kernel = LinearKernel(name, name) if name != "torch" else None
    dtype, gen = _dtype(shapes), _generator()
    hidden = shapes.hidden_size
    q_size, kv_size = shapes.num_heads * shapes.head_dim, shapes.num_kv_heads * shapes.head_dim
    tokens = shapes.decode_tokens if regime == "decode" else shapes.prefill_tokens

    def weight(out_features: int, in_features: int) -> torch.Tensor:
        w = (torch.randn(out_features, in_features, generator=gen) * in_features**-0.5).to(dtype)
        return w.t().contiguous().t() if name == "onednn_t" else w  # stored [in, out]

    products = [
        (
            torch.randn(tokens, hidden, generator=gen).to(dtype),
            weight(q_size + 2 * kv_size, hidden),
        ),
        (torch.randn(tokens, q_size, generator=gen).to(dtype), weight(hidden, q_size)),
    ]
    if shapes.vocab_size and regime == "decode":
        rows = torch.randn(shapes.decode_tokens, hidden, generator=gen).to(dtype)
        products.append((rows, weight(shapes.vocab_size, hidden)))

    packed = [pack_weight(w) if name == "onednn_packed" else None for _, w in products]

    def run() -> list[torch.Tensor]:
        pairs = zip(products, packed, strict=True)
        return [linear(x, w, kernel=kernel, packed=p) for (x, w), p in pairs]

    return run


def _sampler(regime: str, name: str, shapes: TuneShapes) -> Callable[[], object]:
    """A step's draw at vLLM's default sampling (temperature 1.0, no filter) over
    `decode_tokens` rows of the vocabulary, in either regime (a prefill step samples at most
    that many rows too)."""
    from dist_engine.engine.sampler import Sampler, SamplingRow
    from scheduler.sampling_params import SamplingParams

    vocab = shapes.vocab_size or SAMPLER_VOCAB
    logits = torch.randn(shapes.decode_tokens, vocab, generator=_generator()) * 3.0
    params = SamplingParams(temperature=1.0)
    rows = [SamplingRow(params, seed=row, index=0) for row in range(shapes.decode_tokens)]
    sampler = Sampler(native=name == "native")

    def run() -> torch.Tensor:
        return sampler(logits, rows).token_ids

    return run


def _attention(regime: str, name: str, shapes: TuneShapes) -> Callable[[], object]:
    from dist_engine.attention import attention_backend
    from dist_engine.attention.kv_cache import KVCache
    from dist_engine.attention.metadata import AttentionMetadata

    backend = attention_backend(name)
    block = shapes.block_size
    if regime == "decode":
        lengths = [DECODE_CONTEXT] * shapes.decode_tokens
        cached = [length - 1 for length in lengths]
        new = [1] * len(lengths)
    else:
        prompt = min(PREFILL_PROMPT, shapes.prefill_tokens)
        count = max(1, min(shapes.decode_tokens, shapes.prefill_tokens // prompt))
        lengths, cached, new = [prompt] * count, [0] * count, [prompt] * count
    tables, next_block = [], 1
    for length in lengths:
        needed = -(-length // block)
        tables.append(list(range(next_block, next_block + needed)))
        next_block += needed
    dtype, gen = _dtype(shapes), _generator()
    cache = KVCache(1, next_block, block, shapes.num_kv_heads, shapes.head_dim, dtype)
    key_cache, value_cache = cache.layer(0)
    key_cache.copy_(torch.randn(key_cache.shape, generator=gen))
    value_cache.copy_(torch.randn(value_cache.shape, generator=gen))
    attn = AttentionMetadata.build(tables, cached, new, block, is_prefill=regime == "prefill")
    tokens = sum(new)
    query = torch.randn(tokens, shapes.num_heads, shapes.head_dim, generator=gen).to(dtype)
    key = torch.randn(tokens, shapes.num_kv_heads, shapes.head_dim, generator=gen).to(dtype)
    value = torch.randn(tokens, shapes.num_kv_heads, shapes.head_dim, generator=gen).to(dtype)
    angles = attn.positions.float().unsqueeze(1) * torch.rand(shapes.head_dim, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def step() -> torch.Tensor:
        rotated = backend.rotate_and_store(
            query, key, value, cos, sin, key_cache, value_cache, attn
        )
        return backend.attend(rotated, key_cache, value_cache, attn)

    return step


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo").read().splitlines():  # noqa: SIM115
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
