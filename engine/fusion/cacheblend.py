"""`cacheblend` (CacheBlend, arXiv 2405.16444): recompute the tokens whose keys deviate most from the cache.

Every token is computed through the first check layer; there the fresh pre-RoPE keys are compared with the
cached ones (L2 norm over heads and dims) and only the top r% of document tokens stay recomputed. With
`gradual=True` (the paper's gradual filtering) the set narrows over several check layers: at layer 1 the
top `first_ratio` share is kept, then each later check layer keeps a smaller share, ending at r.
"""
from __future__ import annotations

from .base import SelectContext, Strategy, budget_for, register, topk_positions


@register
class CacheBlend(Strategy):
    name = "cacheblend"
    graph_safe = True
    layout_free = True

    def __init__(self, check_layer: int = 1, gradual: bool = False, n_checks: int = 3,
                 first_ratio_factor: float = 2.0) -> None:
        self.check_layer = check_layer
        self.gradual = gradual
        self.n_checks = n_checks
        self.first_ratio_factor = first_ratio_factor

    def check_layers(self, n_layers: int) -> tuple[int, ...]:
        n = self.n_checks if self.gradual else 1
        return tuple(range(self.check_layer, min(n_layers, self.check_layer + n)))

    def initial(self, ctx: SelectContext):
        return ctx.candidates

    def _ratio_at(self, ctx: SelectContext) -> float:
        layers = self.check_layers(ctx.n_layers)
        if len(layers) == 1:
            return ctx.ratio
        step = layers.index(ctx.layer)
        first = min(1.0, ctx.ratio * self.first_ratio_factor)
        return first + (ctx.ratio - first) * step / (len(layers) - 1)

    @staticmethod
    def refine_scores(fresh_k, cached_k):
        """[T] deviation of the fresh pre-RoPE keys from the cached ones (L2 over heads and dims)."""
        from ...kernels.deviation import kv_deviation

        return kv_deviation(fresh_k, cached_k)

    def refine(self, ctx: SelectContext):
        k = ctx.budget_at(self._ratio_at(ctx))
        return topk_positions(self.refine_scores(ctx.fresh_k, ctx.cached_k), ctx.active, k)
