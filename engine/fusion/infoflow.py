"""`infoflow` (InfoFlow KV, arXiv 2603.05353): recompute the tokens the question's attention flows to.

The question is run over the re-positioned cache (true global positions, the runner's probe); at the deep
layers (by default the last third) each key's score is the L2 norm, over the question rows, of the attention it
receives (already averaged over heads), averaged over those layers. The top `budget` cached document tokens are
recomputed.

Reorder (`reorder=True`, the paper's information-flow-guided chunk reordering): the documents holding the most
selected tokens are moved last (closest to the question), then the question is probed and scored again over the
new layout. A strategy cannot change the prompt, so this is an engine step: the engine honours
`reorders_documents` by running the probe and `initial` once on the original layout, asking
`document_order(ctx, chosen)` for the new order, and preparing the prompt again (that first pass is counted in
the request's selection time). The answer then comes from the reordered prompt.
"""
from __future__ import annotations

import torch

from .base import SelectContext, Strategy, register, topk_positions
from .qattn import deep_layers, doc_index, layer_mean, resolve_layers


@register
class InfoFlow(Strategy):
    name = "infoflow"
    graph_safe = True
    layout_free = True

    def __init__(self, layers=None, depth: float = 1 / 3, reorder: bool = False) -> None:
        """
        Args:
            layers: explicit probe layers (negative counts from the end); default the deepest `depth` share.
            depth: share of the deepest layers probed when `layers` is not given.
            reorder: move the documents with the most selected tokens last, then score again.
        """
        if not 0.0 < depth <= 1.0:
            raise ValueError(f"depth must be in (0, 1], got {depth}")
        self.layers = None if layers is None else tuple(int(x) for x in layers)
        self.depth = float(depth)
        self.reorder = bool(reorder)

    @property
    def reorders_documents(self) -> bool:
        return self.reorder

    def probe_layers(self, n_layers: int) -> tuple[int, ...]:
        if self.layers is not None:
            return resolve_layers(self.layers, n_layers)
        return deep_layers(n_layers, self.depth)

    def scores(self, ctx: SelectContext):
        """[C] score of each candidate: mean over probe layers of the L2 norm over question rows."""
        return layer_mean(ctx, self.probe_layers(ctx.n_layers), "l2")

    def initial(self, ctx: SelectContext):
        if ctx.budget == 0:
            return ctx.candidates[:0]
        return topk_positions(self.scores(ctx), ctx.candidates, ctx.budget)

    def document_order(self, ctx: SelectContext, chosen) -> list[int]:
        """Document indices (prompt order) in their new order: ascending count of selected tokens (stable), so
        the documents the question draws most from sit last, next to it."""
        n = len(ctx.doc_spans)
        counts = torch.zeros(n, dtype=torch.long)
        if chosen.numel():
            counts += torch.bincount(doc_index(ctx, chosen.cpu()).cpu(), minlength=n)[:n]
        return sorted(range(n), key=lambda i: (int(counts[i]), i))

    def describe(self) -> str:
        return f"{self.name}(reorder)" if self.reorder else self.name
