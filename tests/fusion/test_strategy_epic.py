"""epic: the first tokens of every document; the budget spread evenly, or the paper's fixed k per document."""
from __future__ import annotations

import pytest

from kvfuse.engine.fusion import make_strategy

from strategy_cases import check_selection, make_ctx


def _per_doc(ctx, chosen):
    return [[p for p in chosen.tolist() if s <= p < e] for s, e in ctx.doc_spans]


def test_budget_spread_evenly_over_document_starts():
    ctx = make_ctx(ratio=0.2)  # 75 document tokens -> 15: 5 each from 20, 30, 25
    chosen = make_strategy("epic").initial(ctx)
    check_selection(ctx, chosen)
    assert _per_doc(ctx, chosen) == [list(range(s, s + 5)) for s, _ in ctx.doc_spans]


def test_cap_per_document_and_leftovers():
    ctx = make_ctx(ratio=0.6, doc_lens=(4, 30, 30))  # 64 tokens -> 38; doc 0 has only 4
    chosen = make_strategy("epic").initial(ctx)
    check_selection(ctx, chosen)
    assert [len(x) for x in _per_doc(ctx, chosen)] == [4, 17, 17]
    capped = make_strategy("epic", max_per_doc=8).initial(ctx)
    assert [len(x) for x in _per_doc(ctx, capped)] == [4, 8, 8]  # the cap wins over the ratio


@pytest.mark.parametrize("ratio", [0.0, 0.15, 1.0])
def test_fixed_tokens_per_document_ignore_the_ratio(ratio):
    ctx = make_ctx(ratio=ratio, doc_lens=(10, 30, 25))
    chosen = make_strategy("epic:per_doc=16").initial(ctx)
    assert _per_doc(ctx, chosen) == [list(range(s, min(e, s + 16))) for s, e in ctx.doc_spans]


def test_bad_counts_are_rejected():
    for bad in ({"per_doc": 0}, {"per_doc": 2.5}, {"max_per_doc": -1}, {"per_doc": True}):
        with pytest.raises(ValueError):
            make_strategy("epic", **bad)
