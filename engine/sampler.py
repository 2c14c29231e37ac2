"""Next-token sampling: greedy at temperature 0, else temperature + nucleus (top-p) with a seeded generator."""
from __future__ import annotations

import torch
from torch import Tensor

from .validate import check_real, check_seed

__all__ = ["Sampler"]


class Sampler:
    """Picks the next token from float32 logits [vocab].

    Args:
        temperature: 0 for greedy (deterministic argmax).
        top_p: nucleus mass in (0, 1].
        seed: seeds the generator when sampling; None draws a fresh random seed (calls differ).
    """

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> None:
        self.temperature = check_real(temperature, "temperature", low=0.0)
        self.top_p = check_real(top_p, "top_p", low=0.0, high=1.0, low_open=True)
        seed = check_seed(seed)
        self.gen = torch.Generator(device="cpu")
        if seed is None:
            self.gen.seed()  # unseeded: a fresh random state per request
        else:
            self.gen.manual_seed(seed)

    def __call__(self, logits: Tensor) -> int:
        if self.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits.float().cpu()
        # shifted so the largest is 0 and the divisor kept a normal float32: a tiny temperature sends the others to
        # -inf (greedy in effect), never the top one to inf or 0/0 (nan)
        t = max(self.temperature, torch.finfo(torch.float32).tiny)
        probs = torch.softmax((logits - logits.max()) / t, dim=-1)
        if self.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < self.top_p
            keep[0] = True  # the most likely token is always in the nucleus (a top_p below float32's range too)
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            return int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=self.gen)])
        return int(torch.multinomial(probs, 1, generator=self.gen))
