"""`qcfuse` (QCFuse, arXiv 2606.05875): question attention at a model's critical layers over a compressed view.

Offline, every document gets an anchor ("digest") set: its first `sinks` tokens plus ~15% of its tokens that
draw the most attention inside the document (`extras["anchors"]`, int32 local indices, computed by the engine's
`anchors` document profiler and stored with the cache). At query time the question probe attends only to the
compressed view, i.e. the prefix and the anchors of every document (`probe_keys`), which is what makes the
selector cheap; its attention over all keys is then read at 3 critical layers, averaged over question rows,
heads and layers, and the top `budget` cached document tokens are recomputed.

Critical layers, in order of precedence: `layers=` given to the constructor; the model's profile found offline by
`kvfuse profile-layers` (handed over by the engine through `use_model_profile`); else the documented default,
the layers at 1/4, 1/2 and 3/4 of the depth. A document stored without anchors is seen in full. With
`full_view=True` the probe sees the whole cache (the digest ratio set to 1), which is ProphetKV's view.

Layout-free: the view is a host function of the layout and the stored anchors, so on CUDA a never-seen layout runs
the bucketed path (engine/bucketed.py: the view passed as data, padded to its own bucket, probe and main pass
replayed from graphs per bucket) with no host synchronisation. The exact-size path still builds the view with
host reads, so it is not `graph_safe` there.
"""
from __future__ import annotations

import torch

from .base import SelectContext, Strategy, register, topk_positions
from .qattn import layer_mean, resolve_layers

DEFAULT_DEPTHS = (0.25, 0.5, 0.75)


def default_critical_layers(n_layers: int) -> tuple[int, ...]:
    """The fallback critical layers: those at 1/4, 1/2 and 3/4 of the depth."""
    return tuple(sorted({min(n_layers - 1, int(round(f * (n_layers - 1)))) for f in DEFAULT_DEPTHS}))


@register
class QCFuse(Strategy):
    name = "qcfuse"
    needs_extras = ("anchors",)
    layout_free = True

    def __init__(self, layers=None, full_view: bool = False) -> None:
        self.layers = None if layers is None else tuple(int(x) for x in layers)
        self.full_view = bool(full_view)
        self._profiled: tuple[int, ...] | None = None

    def use_model_profile(self, profile: dict | None) -> None:
        """Takes the critical layers of the model's offline profile (None: no profile, use the default)."""
        layers = (profile or {}).get("critical_layers")
        self._profiled = tuple(int(x) for x in layers) if layers else None

    def critical_layers(self, n_layers: int) -> tuple[int, ...]:
        if self.layers is not None:
            return resolve_layers(self.layers, n_layers)
        if self._profiled is not None and all(0 <= x < n_layers for x in self._profiled):
            return tuple(sorted(set(self._profiled)))
        return default_critical_layers(n_layers)

    def probe_layers(self, n_layers: int) -> tuple[int, ...]:
        return self.critical_layers(n_layers)

    def probe_keys(self, ctx: SelectContext):
        if self.full_view:
            return None
        cand = ctx.candidates
        dev = cand.device
        n = int(ctx.question.max()) + 1 if ctx.question.numel() else (int(cand.max()) + 1 if cand.numel() else 0)
        other = torch.ones(n, dtype=torch.bool, device=dev)
        other[cand] = False  # the prefix (and any computed, non-document row) is always in the view
        for s, e in ctx.exact_spans:  # exact documents are compressed like the others
            other[s:e] = False
        other[ctx.question.to(dev)] = False  # the runner adds the question rows itself
        parts = [torch.nonzero(other).flatten()]
        spans = list(ctx.exact_spans) + list(ctx.doc_spans)
        extras = list(ctx.exact_extras) + list(ctx.doc_extras)
        if len(extras) != len(spans):
            extras = [{}] * len(spans)
        for (s, e), ex in zip(spans, extras):
            a = ex.get("anchors") if ex else None
            if a is None:
                parts.append(torch.arange(s, e, device=dev))
            else:
                a = a.to(dev).long()
                parts.append(s + a[(a >= 0) & (a < e - s)])
        return torch.unique(torch.cat(parts))

    def scores(self, ctx: SelectContext):
        return layer_mean(ctx, self.critical_layers(ctx.n_layers), "mean")

    def initial(self, ctx: SelectContext):
        if ctx.budget == 0:
            return ctx.candidates[:0]
        return topk_positions(self.scores(ctx), ctx.candidates, ctx.budget)
