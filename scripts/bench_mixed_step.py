"""What a prompt chunk costs inside a decode step (a mixed step) against a prefill step of its own.

    .venv/bin/python scripts/bench_mixed_step.py [--decode-seqs 16] [--chunks 16 32 64 128 256]
        [--out bench_results/mixed_step.json]

One process, float32, bench_forward's Qwen3-MoE (hidden 256, 4 layers, 16 experts top-4) with
the backends the engine's ``auto`` picks on this host for these step sizes. S sequences hold L
cached tokens each; a prompt chunk of P tokens starts a fresh prompt. Timed, interleaved (one call
of each per repeat, median over repeats after warm-up), forward + logits as the runner runs them:

  decode   one decode step of the S sequences (low-latency dispatch, decode attention)
  prefill  one prefill step of the P-token chunk alone (normal dispatch, prompt attention)
  mixed    one mixed step: both in one forward (``MixedMetadata``: the decode rows attended by the
           decode backend, the chunk by the prompt backend, every other layer over all rows)

Reported per P: what the chunk adds to the decoders' token gap in a mixed step (mixed - decode)
against the gap a separate prefill step makes (prefill, on top of the decode step), and the
marginal cost of a prompt token in each. ``simulate_vote.py``'s cost model charges a mixed step's
prompt tokens at the prefill step's rate (its ``k`` = 0); the ratio printed here is that rate as
this host measures it. A figure from this host, not a property of the code.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_forward import MODELS, VOCAB_SIZE, load_ours
from machine import processor

from dist_engine.attention.metadata import AttentionMetadata, MixedMetadata
from dist_engine.backends import BACKEND_KEYS
from dist_engine.models.make_model import make_tiny_checkpoint
from moe import DispatchMode


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-seqs", type=int, default=16)
    parser.add_argument("--decode-context", type=int, default=256, help="cached tokens per seq")
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (times with a sync)")
    parser.add_argument(
        "--model-sizes", default="{}", help="JSON: make_tiny_checkpoint sizes over the default"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="bench_results/mixed_step.json")
    return parser.parse_args()


class Steps:
    """The three steps over one paged cache: S decoding sequences and one prompt sequence."""

    def __init__(self, model, args: argparse.Namespace) -> None:
        self.model, self.bs, self.device = model, args.block_size, args.device
        self.num_seqs, self.context = args.decode_seqs, args.decode_context
        per_seq = -(-(self.context + 1) // self.bs)
        prompt_blocks = -(-max(args.chunks) // self.bs)
        self.tables = [
            list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(self.num_seqs)
        ]
        first = 1 + self.num_seqs * per_seq
        self.prompt_table = list(range(first, first + prompt_blocks))
        model.attach_kv_cache(model.new_kv_cache(first + prompt_blocks, self.bs, self.device))
        gen = torch.Generator().manual_seed(3)
        context = torch.randint(0, VOCAB_SIZE, (self.num_seqs, self.context), generator=gen)
        self.next_ids = torch.randint(0, VOCAB_SIZE, (self.num_seqs,), generator=gen)
        self.prompt = torch.randint(0, VOCAB_SIZE, (max(args.chunks),), generator=gen)
        context = context.to(self.device)
        self.next_ids, self.prompt = self.next_ids.to(self.device), self.prompt.to(self.device)
        with torch.no_grad():  # fill the decoding sequences' context
            attn = self._build(
                self.tables, [0] * self.num_seqs, [self.context] * self.num_seqs, True
            )
            model(context.reshape(-1), attn.positions, attn, DispatchMode.NORMAL)

    def _build(self, tables, cached, new, is_prefill) -> AttentionMetadata:
        return AttentionMetadata.build(tables, cached, new, self.bs, is_prefill, self.device)

    def _decode_meta(self) -> AttentionMetadata:
        n = self.num_seqs
        return self._build(self.tables, [self.context] * n, [1] * n, False)

    def _run(self, ids: torch.Tensor, attn, mode: DispatchMode) -> torch.Tensor:
        hidden = self.model(ids, attn.positions, attn, mode)
        return self.model.compute_logits(hidden[attn.query_start_loc[1:] - 1])

    def decode(self) -> torch.Tensor:
        return self._run(self.next_ids, self._decode_meta(), DispatchMode.LOW_LATENCY)

    def prefill(self, length: int) -> torch.Tensor:
        attn = self._build([self.prompt_table], [0], [length], True)
        return self._run(self.prompt[:length], attn, DispatchMode.NORMAL)

    def mixed(self, length: int) -> torch.Tensor:
        prompt = self._build([self.prompt_table], [0], [length], True)
        attn = MixedMetadata.join(prompt, self._decode_meta())
        ids = torch.cat((self.prompt[:length], self.next_ids))
        return self._run(ids, attn, DispatchMode.NORMAL)


def medians(calls: dict[str, callable], warmup: int, repeats: int, device: str) -> dict[str, float]:
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.no_grad():
        for repeat in range(warmup + repeats):
            for name, call in calls.items():
                sync()
                start = time.perf_counter()
                call()
                sync()
                if repeat >= warmup:
                    times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sizes = {**MODELS["qwen3_moe"], **json.loads(args.model_sizes)}
        model_dir = make_tiny_checkpoint("qwen3_moe", tmp, seed=0, **sizes)
        model, backends = load_ours(
            model_dir,
            dict.fromkeys(BACKEND_KEYS, "auto"),
            decode_tokens=args.decode_seqs,
            prefill_tokens=max(args.chunks),
            block_size=args.block_size,
            device=args.device,
        )
    steps = Steps(model, args)
    with torch.no_grad():  # the mixed step's logits are the separate steps' logits
        for length in args.chunks:
            joined = torch.cat((steps.prefill(length), steps.decode()))
            error = float((steps.mixed(length) - joined).abs().max())
            if error > 1e-3:
                raise AssertionError(f"mixed step of {length} differs from separate steps: {error}")
    calls = {"decode": steps.decode}
    for length in args.chunks:
        calls[f"prefill{length}"] = lambda n=length: steps.prefill(n)
        calls[f"mixed{length}"] = lambda n=length: steps.mixed(n)
    ms = medians(calls, args.warmup, args.repeats, args.device)
    rows = []
    for length in args.chunks:
        added = ms[f"mixed{length}"] - ms["decode"]
        separate = ms[f"prefill{length}"]
        rows.append(
            {
                "chunk_tokens": length,
                "decode_ms": ms["decode"],
                "prefill_ms": separate,
                "mixed_ms": ms[f"mixed{length}"],
                "added_to_gap_mixed_ms": added,
                "added_to_gap_separate_ms": separate,
                "mixed_ms_per_prompt_token": added / length,
                "prefill_ms_per_prompt_token": separate / length,
            }
        )
    load = os.getloadavg()
    print(f"backends: {backends.describe()}")
    print(
        f"S={args.decode_seqs} decoding sequences of {args.decode_context} cached tokens; "
        f"decode step {ms['decode']:.2f} ms; load {load[0]:.2f}"
    )
    print(
        "| chunk P | prefill step ms | mixed step ms | gap added: mixed / separate ms "
        "| ms per prompt token: mixed / prefill step |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['chunk_tokens']} | {row['prefill_ms']:.2f} | {row['mixed_ms']:.2f} "
            f"| {row['added_to_gap_mixed_ms']:.2f} / {row['added_to_gap_separate_ms']:.2f} "
            f"| {row['mixed_ms_per_prompt_token']:.4f} / {row['prefill_ms_per_prompt_token']:.4f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.platform(),
        "processor": processor(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_avg": load,
        "backends": backends.describe(),
        "model": {**MODELS["qwen3_moe"], **json.loads(args.model_sizes)},
        "args": vars(args),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
