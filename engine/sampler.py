"""Next-token sampling: greedy at temperature 0, else temperature + nucleus (top-p) with a seeded generator."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Sampler"]


class Sampler:
    """Picks the next token from float32 logits [vocab].

    Args:
        temperature: 0 for greedy (deterministic argmax).
        top_p: nucleus mass in (0, 1].
        seed: seeds the generator when sampling.
    """

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature = temperature
        self.top_p = top_p
        self.gen = torch.Generator(device="cpu")
        self.gen.manual_seed(0 if seed is None else int(seed))

    def __call__(self, logits: Tensor) -> int:
        if self.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < self.top_p
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            return int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=self.gen)])
        return int(torch.multinomial(probs, 1, generator=self.gen))
