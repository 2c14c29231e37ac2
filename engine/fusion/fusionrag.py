"""`fusionrag` (FusionRAG, arXiv 2601.12904): caches with cross-document context baked in, then question-guided
recompute.

Offline, each document's cache is computed with its `top_k` most similar documents of the whole corpus
(all-MiniLM-L6-v2 cosine over the texts) prefilled before it, the most similar one adjacent; only the document's
own rows are kept. This cache variant is stored apart from the plain cache (its key covers the variant, the
context mode and the neighbours' content). The engine serves it to this strategy: the strategy only declares
`cache_variant = "fusionrag"` and `variant_options`; the corpus and the neighbour rule live in
`engine/corpus.py`. The fused prompt still holds only the retrieved documents.

Online, the question is probed over the fused variant caches at layers spread over the depth; each candidate's
score is its attention from the question rows (mean over rows and heads, each layer normalised over the
candidates, then averaged), and the top `budget` tokens are recomputed.
"""
from __future__ import annotations

from .base import SelectContext, Strategy, register, topk_positions
from .qattn import layer_mean, resolve_layers, spread_layers

CONTEXT_MODES = ("full", "cached")


@register
class FusionRAG(Strategy):
    name = "fusionrag"
    cache_variant = "fusionrag"

    def __init__(self, top_k: int = 10, context: str = "full", layers=None, n_probe: int = 6, lo: float = 0.25,
                 hi: float = 1.0) -> None:
        """
        Args:
            top_k: neighbours prefilled before each document offline (fewer when the corpus is small).
            context: "full" prefills the neighbours and the document together (the paper's offline step);
                "cached" computes only the document's rows, attending to the neighbours' plain caches (cheaper).
            layers / n_probe / lo / hi: the probe layers, as for `prophetkv`.
        """
        if top_k < 0:
            raise ValueError("top_k must be >= 0")
        if context not in CONTEXT_MODES:
            raise ValueError(f"context must be one of {CONTEXT_MODES}, got {context!r}")
        self.top_k = int(top_k)
        self.context = context
        self.layers = None if layers is None else tuple(int(x) for x in layers)
        self.n_probe, self.lo, self.hi = int(n_probe), float(lo), float(hi)

    @property
    def variant_options(self) -> dict:
        return {"top_k": self.top_k, "context": self.context}

    def probe_layers(self, n_layers: int) -> tuple[int, ...]:
        if self.layers is not None:
            return resolve_layers(self.layers, n_layers)
        return spread_layers(n_layers, self.n_probe, self.lo, self.hi)

    def scores(self, ctx: SelectContext):
        return layer_mean(ctx, self.probe_layers(ctx.n_layers), "mean", normalise=True)

    def initial(self, ctx: SelectContext):
        if ctx.budget == 0:
            return ctx.candidates[:0]
        return topk_positions(self.scores(ctx), ctx.candidates, ctx.budget)

    def describe(self) -> str:
        return f"{self.name}(k={self.top_k},{self.context})"
