"""`prophetkv` (ProphetKV, arXiv 2602.02579): question attention over the full cache, fused across layers.

The question is probed over the whole re-positioned cache at several layers spread over the depth. At each
layer a candidate's score is the attention it receives, averaged over the question rows (and heads), divided by
that layer's total over the candidates, so every layer weighs the same whatever its sharpness; the per-layer
scores are averaged and the top `budget` tokens are recomputed. Query-driven only: tokens that are salient to
everything but the question (the "crowding-out" the paper describes) do not take budget.
"""
from __future__ import annotations

from .base import SelectContext, Strategy, register, topk_positions
from .qattn import layer_mean, resolve_layers, spread_layers


@register
class ProphetKV(Strategy):
    name = "prophetkv"
    graph_safe = True
    layout_free = True

    def __init__(self, layers=None, n_probe: int = 6, lo: float = 0.25, hi: float = 1.0) -> None:
        """
        Args:
            layers: explicit probe layers (negative counts from the end).
            n_probe: without `layers`, this many layers evenly spread over the depth fractions [lo, hi].
        """
        if n_probe < 1:
            raise ValueError("n_probe must be >= 1")
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"need 0 <= lo <= hi <= 1, got {lo}, {hi}")
        self.layers = None if layers is None else tuple(int(x) for x in layers)
        self.n_probe, self.lo, self.hi = int(n_probe), float(lo), float(hi)

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
