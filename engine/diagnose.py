"""What reusing cached document KV changes: the cached (document-alone) K/V next to the K/V full prefill
computes for the same rows in the prompt. The raw material for explaining a strategy's quality loss."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .prompt import PromptLayout

__all__ = ["ContextKV"]


@dataclass
class ContextKV:
    """Pre-RoPE K/V of every document row of one prompt, two ways.

    Attributes:
        layout: the prompt layout; document rows are `layout.docs[0].start .. layout.docs[-1].end`.
        cached_k, cached_v: [n_layers, T, n_kv_heads, head_dim], each document prefilled alone after the
            prompt prefix, as the cache stores it (what `reuse` attends to).
        context_k, context_v: the same rows as full prefill of the whole prompt computes them.
    """

    layout: PromptLayout
    cached_k: Tensor
    cached_v: Tensor
    context_k: Tensor
    context_v: Tensor

    @property
    def start(self) -> int:
        """Absolute position of the first document row."""
        return self.layout.docs[0].start

    def relative_deviation(self) -> Tensor:
        """[n_layers, T] float32: |K_cached - K_ctx| / |K_ctx| + the same for V, each averaged over heads.

        Zero for the first document (it sees exactly the prefix either way), up to numerics; later documents
        deviate by how much they would have attended to the documents before them."""
        def rel(a: Tensor, b: Tensor) -> Tensor:
            a, b = a.float(), b.float()
            return (a - b).norm(dim=-1).mean(-1) / b.norm(dim=-1).mean(-1).clamp_min(1e-6)

        return (rel(self.cached_k, self.context_k) + rel(self.cached_v, self.context_v)).cpu()

    def value_deviation(self) -> Tensor:
        """[n_layers, T] float32: absolute |V_cached - V_ctx|, averaged over heads (the error a token feeds
        every query that attends to it)."""
        return (self.cached_v.float() - self.context_v.float()).norm(dim=-1).mean(-1).cpu()

    def token_deviation(self, dev: Tensor | None = None) -> Tensor:
        """[T]: relative deviation summed over layers, one score per document row (of `dev` when given, the
        `relative_deviation()` already computed)."""
        return (self.relative_deviation() if dev is None else dev).sum(0)

    def layer_deviation(self, dev: Tensor | None = None) -> Tensor:
        """[n_layers]: relative deviation averaged over the document rows (of `dev` when given)."""
        return (self.relative_deviation() if dev is None else dev).mean(1)
