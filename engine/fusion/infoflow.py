"""`infoflow` (InfoFlow KV, arXiv 2603.05353): recompute the tokens the question's attention flows to.

The question is run over the re-positioned cache (true global positions, the runner's probe); at the deep
layers (by default the last third) each key's score is the L2 norm, over the question rows (every row the runner
computes: the question template, the question, the chat suffix, document titles), of the attention it receives
(already averaged over heads), averaged over those layers. The top `budget` cached document tokens are recomputed.

The reference code's choices differ: mid-late scoring layers (22-25 of 40, never the last) and the question's own
tokens as rows. Both are options, together `InfoFlow.REFERENCE` (`window=(0.55, 0.65)`: the layers at 55-65% of
the depth, 13-15 of 24; `rows="question"`: the rows the prompt marks as the question's own tokens). On the
embedded model (Qwen2.5-Coder-0.5B, dev 2wikimqa/hotpotqa/musique, 15%) they were measured worse on fidelity and
KL than these defaults (docs/quality/infoflow_reference.md), so the defaults stay; the window's probe stops at a
shallower layer, so its selection costs about a third less.

Reorder (`reorder=True`, the paper's information-flow-guided chunk reordering): the documents with the highest
density of selected tokens (selected / length, the reference's rule; `order="count"`: the count alone) are
moved last (closest to the question), then the question is probed and scored again over the new layout. A
strategy cannot change the prompt, so this is an engine step: the engine honours
`reorders_documents` by running the probe and `initial` once on the original layout, asking
`document_order(ctx, chosen)` for the new order, and preparing the prompt again (that first pass is counted in
the request's selection time). The answer then comes from the reordered prompt.
"""
from __future__ import annotations

import torch

from .base import SelectContext, Strategy, register, topk_positions
from .qattn import deep_layers, doc_index, layer_mean, resolve_layers, window_layers


@register
class InfoFlow(Strategy):
    name = "infoflow"
    graph_safe = True
    layout_free = True

    #: the reference code's scoring choices, as a spec (`make_strategy(InfoFlow.REFERENCE)`)
    REFERENCE = "infoflow:window=0.55/0.65:rows=question"

    def __init__(self, layers=None, depth: float = 1 / 3, window=None, rows: str = "all", reorder: bool = False,
                 order: str = "density") -> None:
        """
        Args:
            layers: explicit probe layers (negative counts from the end).
            depth: without `layers` or `window`, the deepest `depth` share of the layers is probed.
            window: without `layers`, the depth fractions (lo, hi) probed (`window_layers`: never the last layer).
            rows: "all" (every row the runner computes: question template, question, chat suffix, titles) or
                "question" (the question's own tokens, where the prompt marks them).
            reorder: move the documents the selection draws on most last, then score again.
            order: the reorder's key: "density" (selected / document length, the reference's) or "count".
        """
        if not 0.0 < float(depth) <= 1.0:
            raise ValueError(f"depth must be in (0, 1], got {depth}")
        if window is not None:
            lo, hi = (float(x) for x in window)
            if not 0.0 <= lo < hi <= 1.0:
                raise ValueError(f"window must satisfy 0 <= lo < hi <= 1, got {window}")
            window = (lo, hi)
        if rows not in ("question", "all"):
            raise ValueError(f"rows must be 'question' or 'all', got {rows!r}")
        if order not in ("density", "count"):
            raise ValueError(f"order must be 'density' or 'count', got {order!r}")
        self.layers = None if layers is None else tuple(int(x) for x in layers)
        self.depth = float(depth)
        self.window = window
        self.rows = rows
        self.reorder = bool(reorder)
        self.order = order

    @property
    def reorders_documents(self) -> bool:
        return self.reorder

    def probe_layers(self, n_layers: int) -> tuple[int, ...]:
        if self.layers is not None:
            return resolve_layers(self.layers, n_layers)
        if self.window is not None:
            return window_layers(n_layers, *self.window)
        return deep_layers(n_layers, self.depth)

    def scores(self, ctx: SelectContext):
        """[C] score of each candidate: mean over probe layers of the L2 norm over the question rows."""
        return layer_mean(ctx, self.probe_layers(ctx.n_layers), "l2", own_rows=self.rows == "question")

    def initial(self, ctx: SelectContext):
        if ctx.budget == 0:
            return ctx.candidates[:0]
        return topk_positions(self.scores(ctx), ctx.candidates, ctx.budget)

    def document_order(self, ctx: SelectContext, chosen) -> list[int]:
        """Document indices (prompt order) in their new order: ascending density (or count) of selected tokens
        (stable), so the documents the question draws most from sit last, next to it."""
        n = len(ctx.doc_spans)
        counts = torch.zeros(n, dtype=torch.long)
        if chosen.numel():
            counts += torch.bincount(doc_index(ctx, chosen.cpu()).cpu(), minlength=n)[:n]
        if self.order == "count":
            key = [float(c) for c in counts]
        else:
            key = [int(c) / max(1, e - s) for c, (s, e) in zip(counts, ctx.doc_spans)]
        return sorted(range(n), key=lambda i: (key[i], i))

    def describe(self) -> str:
        return f"{self.name}(reorder)" if self.reorder else self.name
