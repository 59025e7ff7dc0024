"""Benchmark the model forward (prefill and one decode step) against transformers, same weights.

    .venv/bin/python scripts/bench_forward.py [--model all] [--repeats 10]
        [--out bench_results/forward.json]

(from the repository root, with the package installed editable)

Ours runs the backends the engine would pick on this host (`--backend auto`: timed by
dist_engine/autotune.py at these step sizes, the choice printed) or one named everywhere.

One process, float32, tiny-but-not-trivial random checkpoints written by `make_tiny_checkpoint`
(`MODELS`): a Qwen3-MoE (hidden 256, 4 layers, 16 experts top-4, expert intermediate 256,
vocab 2048, 8 query / 4 kv heads of 32) and a DeepSeek-V3 with DeepSeek-V3's MLA proportions
(16 heads, kv_lora_rank 256, q_lora_rank 192, nope/rope/v head dims 64/32/64: the absorbed
form's per query-key cost over the expanded one's is (E + C) / (Dn + R + Dv) = 544 / 160, the
same 3.4 as V3's 1088 / 320). Both sides get the same token ids and the same torch thread count.
  prefill — B prompts of L tokens from an empty cache, logits of each prompt's last token
            (what serving samples from). Ours: AttentionMetadata.build + forward +
            compute_logits; transformers: forward with `logits_to_keep=1`.
  decode  — one new token for each of B sequences holding L cached tokens, logits for all B.
            Ours: a paged KVCache filled by a prefill, then metadata build + forward +
            compute_logits at position L; transformers: forward with a DynamicCache filled by
            the same prefill, then cropped back to L after each timed step (untimed), so every
            repeat is the same step.
For the MLA model each step also runs ours in the other attention form (absorbed prefill,
expanded decode; see dist_engine/attention/mla_torch.py), and the run states the latent cache's
bytes per token next to what an expanded per-head cache would take.
Contenders run interleaved (one call of each per repeat) so machine noise hits both alike;
reported is the median over repeats after warm-up, as tokens/s (prefill: B * L / time,
decode: B / time). Each side's logits are checked against the other's (max abs error).
Shape legend: B = sequences, L = tokens per sequence, V = vocab.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dist_engine.attention.metadata import AttentionMetadata
from dist_engine.attention.mla_torch import TorchMLA
from dist_engine.autotune import TuneShapes
from dist_engine.backends import BACKEND_KEYS, Backends, resolve_backends
from dist_engine.models.decoder import MoECausalLM
from dist_engine.models.loader import load_model
from dist_engine.models.make_model import make_tiny_checkpoint
from dist_engine.models.registry import load_config
from moe import DispatchMode

VOCAB_SIZE = 2048
MODELS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "hidden_size": 256,
        "num_layers": 4,
        "num_experts": 16,
        "top_k": 4,
        "vocab_size": VOCAB_SIZE,
        "moe_intermediate_size": 256,
        "num_heads": 8,
        "num_kv_heads": 4,
        "head_dim": 32,
    },
    "deepseek_v3": {
        "hidden_size": 256,
        "num_layers": 4,
        "num_experts": 16,
        "top_k": 4,
        "vocab_size": VOCAB_SIZE,
        "moe_intermediate_size": 256,
        "intermediate_size": 512,
        "num_heads": 16,
        "q_lora_rank": 192,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
    },
}
# The MLA forms each step runs besides the default (decode absorbed, prefill expanded).
OTHER_FORM = {"prefill": "absorbed", "decode": "expanded"}

Step = Callable[[], torch.Tensor]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--prefill-seqs", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--decode-seqs", type=int, default=32)
    parser.add_argument("--decode-context", type=int, default=256, help="cached tokens per seq")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--backend",
        choices=["auto", "native", "torch", "grouped_mm"],
        default="auto",
        help="ours: every backend setting (grouped_mm: the experts'; auto: timed on this "
        "host at these step sizes, as the engine does)",
    )
    parser.add_argument(
        "--hf-experts", default=None, help="transformers experts_implementation (its default)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="bench_results/forward.json")
    return parser.parse_args()


def load_ours(
    model_dir: Path,
    settings: dict[str, str],
    *,
    decode_tokens: int,
    prefill_tokens: int,
    block_size: int,
    device: str = "cpu",
) -> tuple[MoECausalLM, Backends]:
    """Ours in float32 on `device`, backend `settings` resolved as the engine would for these
    step sizes (`auto` times the candidates on this host)."""
    shapes = TuneShapes.for_model(
        load_config(model_dir),
        "float32",
        ep_size=1,
        decode_tokens=decode_tokens,
        prefill_tokens=prefill_tokens,
        block_size=block_size,
    )
    backends = resolve_backends(settings, torch.float32, device, shapes=shapes)
    model = load_model(model_dir, dtype=torch.float32, device=device, backends=backends)
    return model, backends


def load_both(model_dir: Path, args: argparse.Namespace) -> tuple[MoECausalLM, Any, Backends]:
    from transformers import AutoModelForCausalLM

    settings = dict.fromkeys(BACKEND_KEYS, args.backend)
    if args.backend == "grouped_mm":
        settings = {"expert_backend": "grouped_mm"}
    ours, backends = load_ours(
        model_dir,
        settings,
        decode_tokens=args.decode_seqs,
        prefill_tokens=args.prefill_seqs * args.prefill_len,
        block_size=args.block_size,
    )
    options = {} if args.hf_experts is None else {"experts_implementation": args.hf_experts}
    reference = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True, **options
    )
    return ours, reference.eval(), backends


class PagedBatch:
    """Ours: B sequences of contiguous block runs in one KVCache (block 0 stays reserved)."""

    def __init__(self, model: MoECausalLM, num_seqs: int, max_len: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        blocks_per_seq = -(-max_len // block_size)
        self.tables = [
            list(range(1 + b * blocks_per_seq, 1 + (b + 1) * blocks_per_seq))
            for b in range(num_seqs)
        ]
        model.attach_kv_cache(model.new_kv_cache(1 + num_seqs * blocks_per_seq, block_size))

    def step(self, token_ids: torch.Tensor, num_cached: int, is_prefill: bool) -> torch.Tensor:
        """token_ids: [B, Lq], new after `num_cached` cached tokens → last-token logits [B, V]."""
        num_seqs, num_new = token_ids.shape
        attn = AttentionMetadata.build(
            self.tables, [num_cached] * num_seqs, [num_new] * num_seqs, self.block_size, is_prefill
        )
        mode = DispatchMode.NORMAL if is_prefill else DispatchMode.LOW_LATENCY
        hidden = self.model(token_ids.reshape(-1), attn.positions, attn, mode)
        last_rows = attn.query_start_loc[1:] - 1
        return self.model.compute_logits(hidden[last_rows])


def hf_step(model, token_ids: torch.Tensor, cache=None) -> torch.Tensor:
    """transformers forward of [B, Lq] → last-token logits [B, V]; appends to `cache`."""
    out = model(token_ids, cache=cache, use_cache=cache is not None, logits_to_keep=1)
    return out.logits[:, -1]


def time_once(fn: Step) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved_medians(contenders: dict[str, tuple[Step, Callable]], args) -> dict[str, float]:
    """Median seconds per contender; each repeat calls every one once, then its untimed reset."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for repeat in range(args.warmup + args.repeats):
        for name, (step, reset) in contenders.items():
            elapsed = time_once(step)
            reset()
            if repeat >= args.warmup:
                times[name].append(elapsed)
    return {name: statistics.median(values) for name, values in times.items()}


def no_reset() -> None:
    return None


def bench_prefill(ours: MoECausalLM, reference, args) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    shape = (args.prefill_seqs, args.prefill_len)
    token_ids = torch.randint(0, VOCAB_SIZE, shape, generator=gen)
    batch = PagedBatch(ours, args.prefill_seqs, args.prefill_len, args.block_size)
    contenders = {
        "ours": (lambda: batch.step(token_ids, 0, is_prefill=True), no_reset),
        "transformers": (lambda: hf_step(reference, token_ids), no_reset),
    }
    if ours.config.mla is not None:
        other = in_form(ours, "prefill", lambda: batch.step(token_ids, 0, is_prefill=True))
        contenders[f"ours_{OTHER_FORM['prefill']}"] = (other, no_reset)
    return summarize(contenders, args, num_tokens=token_ids.numel())


def bench_decode(ours: MoECausalLM, reference, args) -> dict[str, Any]:
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(2)
    num_seqs, context = args.decode_seqs, args.decode_context
    prompt = torch.randint(0, VOCAB_SIZE, (num_seqs, context), generator=gen)
    next_ids = torch.randint(0, VOCAB_SIZE, (num_seqs, 1), generator=gen)
    batch = PagedBatch(ours, num_seqs, context + 1, args.block_size)
    hf_cache = DynamicCache(config=reference.config)
    with torch.no_grad():
        batch.step(prompt, 0, is_prefill=True)  # fills both caches with the same context
        hf_step(reference, prompt, hf_cache)
    contenders = {
        # Re-running the step rewrites the same slot L, so ours needs no reset.
        "ours": (lambda: batch.step(next_ids, context, is_prefill=False), no_reset),
        "transformers": (lambda: hf_step(reference, next_ids, hf_cache), lambda: crop(hf_cache)),
    }
    if ours.config.mla is not None:
        other = in_form(ours, "decode", lambda: batch.step(next_ids, context, is_prefill=False))
        contenders[f"ours_{OTHER_FORM['decode']}"] = (other, no_reset)
    return summarize(contenders, args, num_tokens=num_seqs)


def in_form(model: MoECausalLM, regime: str, step: Step) -> Step:
    """`step` with every MLA layer attending in the other form for `regime`."""
    form = OTHER_FORM[regime]
    backend = TorchMLA(**{f"{regime}_form": form})
    layers = [layer.self_attn for layer in model.model.layers]

    def run() -> torch.Tensor:
        defaults = [attention.backend for attention in layers]
        for attention in layers:
            attention.backend = backend
        try:
            return step()
        finally:
            for attention, default in zip(layers, defaults, strict=True):
                attention.backend = default

    return run


def crop(cache) -> None:
    """Drop the token the timed step appended, so the next repeat runs the same step."""
    cache.crop(-1)


def summarize(contenders: dict[str, tuple[Step, Callable]], args, num_tokens: int) -> dict:
    """`ours` and `transformers` as before; every other contender (`ours_<form>`) adds its
    time, its logits' error against transformers and its time over ours."""
    with torch.no_grad():
        logits = {}
        for name, (step, reset) in contenders.items():
            logits[name] = step()
            reset()
        seconds = interleaved_medians(contenders, args)
    reference = logits["transformers"]
    row = {
        "ours_ms": 1e3 * seconds["ours"],
        "transformers_ms": 1e3 * seconds["transformers"],
        "ours_tok_s": num_tokens / seconds["ours"],
        "transformers_tok_s": num_tokens / seconds["transformers"],
        "speedup": seconds["transformers"] / seconds["ours"],
        "max_abs_logit_err": float((logits["ours"] - reference).abs().max()),
    }
    for name in contenders:
        if name.startswith("ours_"):
            row[f"{name}_ms"] = 1e3 * seconds[name]
            row[f"{name}_over_ours"] = seconds[name] / seconds["ours"]
            row[f"{name}_max_abs_logit_err"] = float((logits[name] - reference).abs().max())
    return row


def print_table(args, name: str, run: dict[str, Any]) -> None:
    sizes = " ".join(f"{key}={value}" for key, value in MODELS[name].items())
    print(f"\n{name}: {sizes}")
    print(f"transformers experts_implementation={run['transformers_experts_implementation']}")
    print(f"ours: {run['backends']}")
    header = ("step", "batch", "ours ms", "HF ms", "ours tok/s", "HF tok/s", "speedup", "max err")
    print(f"{header[0]:<8} {header[1]:>9}" + "".join(f" {title:>10}" for title in header[2:]))
    shapes = {
        "prefill": f"{args.prefill_seqs}x{args.prefill_len}",
        "decode": f"{args.decode_seqs}x{args.decode_context}",
    }
    for step, row in run["rows"].items():
        print(
            f"{step:<8} {shapes[step]:>9} {row['ours_ms']:>10.2f} {row['transformers_ms']:>10.2f}"
            f" {row['ours_tok_s']:>10.0f} {row['transformers_tok_s']:>10.0f}"
            f" {row['speedup']:>9.2f}x {row['max_abs_logit_err']:>10.1e}"
        )
    for step, row in run["rows"].items():
        for key in row:
            if key.startswith("ours_") and key.endswith("_over_ours"):
                form = key[len("ours_") : -len("_over_ours")]
                print(
                    f"{step} in the {form} form: {row[f'ours_{form}_ms']:.2f} ms, "
                    f"{row[key]:.2f}x ours (max err {row[f'ours_{form}_max_abs_logit_err']:.1e})"
                )
    if "kv_cache" in run:
        print(f"KV cache: {run['kv_cache']['described']}")


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(name, tmp, seed=0, **MODELS[name])
        ours, reference, backends = load_both(model_dir, args)
    run: dict[str, Any] = {
        "model": MODELS[name],
        "transformers_experts_implementation": reference.config._experts_implementation,
        "backends": backends.describe(),
        "rows": {
            "prefill": bench_prefill(ours, reference, args),
            "decode": bench_decode(ours, reference, args),
        },
    }
    spec = ours.kv_spec
    run["kv_cache"] = {
        "bytes_per_token": spec.bytes_per_token(ours.dtype),
        "expanded_bytes_per_token": spec.expanded_bytes_per_token(ours.dtype),
        "described": spec.describe(ours.dtype),
    }
    return run


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    names = list(MODELS) if args.model == "all" else [args.model]
    print(f"Model forward, float32, {args.threads} torch threads, median of {args.repeats}")
    runs = {}
    for name in names:
        runs[name] = bench_model(name, args)
        print_table(args, name, runs[name])
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"config": vars(args), "runs": runs}, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
