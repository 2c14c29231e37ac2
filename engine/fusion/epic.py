"""`epic` (EPIC, arXiv 2410.15332): recompute the first tokens of every document.

Those are the spurious attention sinks a document cached alone develops at its start. The budget
round(ratio * doc tokens) is spread evenly over the documents (each capped at `max_per_doc` when given,
the paper's k <= 32), leftovers going to documents in prompt order.

`per_doc=k` is the paper's own operating point: exactly the first k tokens of every document (all of a shorter
one), whatever the ratio (`epic:per_doc=16` as a spec).
"""
from __future__ import annotations

import torch

from .base import SelectContext, Strategy, register


@register
class Epic(Strategy):
    name = "epic"
    graph_safe = True
    layout_free = True

    def __init__(self, max_per_doc: int | None = None, per_doc: int | None = None) -> None:
        for name, v in (("max_per_doc", max_per_doc), ("per_doc", per_doc)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        self.max_per_doc = max_per_doc
        self.per_doc = per_doc

    def initial(self, ctx: SelectContext):
        lengths = [e - s for s, e in ctx.doc_spans]
        if not lengths:
            return ctx.candidates[:0]
        if self.per_doc:
            cap = [min(n, self.per_doc) for n in lengths]
            budget = sum(cap)
        else:
            cap = [min(n, self.max_per_doc) if self.max_per_doc else n for n in lengths]
            budget = min(ctx.budget, sum(cap))
        take = [0] * len(lengths)
        while budget > 0:
            open_docs = [i for i in range(len(lengths)) if take[i] < cap[i]]
            share = max(1, budget // len(open_docs))
            for i in open_docs:
                add = min(share, cap[i] - take[i], budget)
                take[i] += add
                budget -= add
                if budget == 0:
                    break
        picked = [torch.arange(s, s + k) for (s, _), k in zip(ctx.doc_spans, take) if k]
        if not picked:
            return ctx.candidates[:0]
        return torch.unique(torch.cat(picked)).to(ctx.candidates.device)
