"""`keyrank`: recompute, in every document, the tokens its own attention ranks highest, chosen offline.

When a document's cache is stored, the `keyrank` profiler ranks its tokens: its first `sinks` tokens, then the rest
by the attention they receive from the document's own rows (sampled every 4th, at the model's critical layers,
the qcfuse anchor profiler's score). These are the keys later text attends to most (SIFT's cross-attention
consistency), so their stale K/V costs most. At a request each non-exact document recomputes the head of its
list, its share of the budget in proportion to its length: no probe, no host work beyond the layout.
"""
from __future__ import annotations

import torch

from .base import SelectContext, Strategy, register


def proportional(budget: int, lengths: list[int]) -> list[int]:
    """Split `budget` over documents in proportion to `lengths` (largest remainders; each at most its length)."""
    total = sum(lengths)
    if total == 0 or budget <= 0:
        return [0] * len(lengths)
    budget = min(budget, total)
    exact = [budget * n / total for n in lengths]
    take = [int(x) for x in exact]
    order = sorted(range(len(lengths)), key=lambda i: (-(exact[i] - take[i]), i))
    for i in order[:budget - sum(take)]:
        take[i] += 1
    return [min(t, n) for t, n in zip(take, lengths)]


@register
class KeyRank(Strategy):
    name = "keyrank"
    needs_extras = ("keyrank",)

    def initial(self, ctx: SelectContext):
        spans = ctx.doc_spans
        if not spans or ctx.budget == 0:
            return ctx.candidates[:0]
        take = proportional(ctx.budget, [e - s for s, e in spans])
        extras = ctx.doc_extras if len(ctx.doc_extras) == len(spans) else [{}] * len(spans)
        picked = []
        for (s, e), k, ex in zip(spans, take, extras):
            rank = ex.get("keyrank") if ex else None
            if not k:
                continue
            if rank is None or rank.numel() != e - s:  # no ranking stored: the document's first tokens
                picked.append(torch.arange(s, s + k))
            else:
                picked.append(s + rank[:k].long().cpu())
        if not picked:
            return ctx.candidates[:0]
        return torch.sort(torch.cat(picked)).values.to(ctx.candidates.device)
