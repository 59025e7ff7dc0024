"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators.

Shape legend: B = rows (one per sequence that needs a token), V = vocab.

Reproducibility: each request owns a `torch.Generator` (in its `SamplingState`, kept by the
runner for the request's lifetime). A row's random numbers come only from its own generator,
and the same number of them (V) is drawn at every step, so a seeded request samples the same
tokens whatever else is in the batch, on whichever rank and step it runs. The draw uses the
exponential race: `argmax(p_i / E_i)` with `E_i ~ Exp(1)` picks token i with probability p_i
(equivalent to the Gumbel-max trick), so no row needs a batched multinomial that would couple
rows through a shared generator.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from scheduler.sampling_params import GREEDY_TEMPERATURE


@dataclass
class SamplingState:
    """Per-request sampling settings plus the generator whose state persists across steps.

    temperature: 0 (or below GREEDY_TEMPERATURE) means greedy (argmax); otherwise logits are
        divided by it.
    top_k: keep the k most likely tokens; 0 or -1 disables.
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p; 1 disables.
    seed: seeds the generator; None draws a fresh random seed (still one generator per request).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    device: torch.device | str = "cpu"
    generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.seed is None:
            self.seed = secrets.randbits(63)
        self.generator = torch.Generator(device=self.device).manual_seed(self.seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


class Sampler:
    """Turns logits into one token id per row; stateless (the states carry the randomness)."""

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        return self.sample(logits, states)

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """logits: [B, V] float, states: B per-row states → token ids [B] int64."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be [B, V] with B = {len(states)} states, got {tuple(logits.shape)}"
            )
        tokens = logits.argmax(dim=-1)
        random_rows = [row for row, state in enumerate(states) if not state.is_greedy]
        if not random_rows:
            return tokens
        rows = torch.tensor(random_rows, device=logits.device)
        picked = [states[row] for row in random_rows]
        probs = _filtered_probs(logits[rows].float(), picked)
        # One Exp(1) draw per vocab entry per row, from that row's own generator.
        noise = torch.stack(
            [
                torch.empty(logits.shape[1], device=s.generator.device).exponential_(
                    generator=s.generator
                )
                for s in picked
            ]
        ).to(logits.device)
        # exponential_ may return exactly 0 in principle; a 0 would divide into inf/NaN.
        noise = noise.clamp_min(torch.finfo(noise.dtype).tiny)
        tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens


def _filtered_probs(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Temperature, then top-k and top-p masks, then softmax. logits: [R, V] → probs [R, V]."""
    vocab = logits.shape[1]
    device = logits.device
    temperature = torch.tensor([s.temperature for s in states], device=device)
    logits = logits / temperature.unsqueeze(1)
    # Clamped in Python: a top_k beyond int64 would not even become a tensor.
    top_k = torch.tensor(
        [min(s.top_k, vocab) if s.top_k > 0 else vocab for s in states], device=device
    )
    top_p = torch.tensor([s.top_p for s in states], device=device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    keep = ranks < top_k.unsqueeze(1)
    sorted_probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    # Keep a token while the mass of the tokens before it is still below top_p; the most
    # likely token is therefore always kept, whatever top_p.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep &= mass_before < top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return filtered.softmax(dim=-1)
