"""infoflow: deep-layer attention norm (L2 over question rows), top budget; document reorder order."""
from __future__ import annotations

import pytest
import torch

from kvfuse.engine.fusion import make_strategy

from strategy_cases import assert_planted_selected, make_ctx, plant


def test_probe_layers_are_the_deepest_third():
    s = make_strategy("infoflow")
    assert s.probe_layers(24) == tuple(range(16, 24))
    assert s.probe_layers(3) == (2,)
    assert make_strategy("infoflow", layers=(-1, 5)).probe_layers(24) == (5, 23)
    with pytest.raises(ValueError):
        make_strategy("infoflow", layers=(30,)).probe_layers(24)


@pytest.mark.parametrize("ratio", [0.05, 0.2, 0.5])
def test_planted_tokens_are_selected_and_budget_is_exact(ratio):
    assert_planted_selected("infoflow", ratio, [10, 40, 77], 0.1)


def test_l2_norm_prefers_a_sharp_row_over_a_spread():
    """Key a gets 0.5 from one question row; key b gets 0.15 from all 5 rows. Mean over rows: b wins (0.15 vs
    0.1); InfoFlow's L2 norm: a wins (0.5 vs 0.34)."""
    ctx = make_ctx(ratio=1 / 75)  # budget 1
    s = make_strategy("infoflow")
    a, b = 12, 50
    for layer in s.probe_layers(ctx.n_layers):
        plant(ctx, layer, a, 0.5, rows=[2])
        plant(ctx, layer, b, 0.15)
    assert s.initial(ctx).tolist() == [a]


def test_shallow_layers_and_the_prefix_sink_are_ignored():
    ctx = make_ctx(ratio=1 / 75)
    s = make_strategy("infoflow")
    deep = s.probe_layers(ctx.n_layers)
    plant(ctx, 0, 30, 0.6)  # a huge peak at a shallow layer: not InfoFlow's signal
    for layer in deep:
        plant(ctx, layer, 61, 0.05)
    # position 0 (the prefix sink) holds most of every row's mass but is no candidate
    chosen = s.initial(ctx)
    assert chosen.tolist() == [61]


def test_ratio_zero_and_one():
    ctx = make_ctx(ratio=0.0)
    assert make_strategy("infoflow").initial(ctx).numel() == 0
    ctx = make_ctx(ratio=1.0)
    assert torch.equal(make_strategy("infoflow").initial(ctx), ctx.candidates)


def test_document_order_moves_the_most_selected_documents_last():
    ctx = make_ctx()
    s = make_strategy("infoflow", reorder=True)
    assert s.reorders_documents and not make_strategy("infoflow").reorders_documents
    # doc 0: 6..25, doc 1: 26..55, doc 2: 56..80
    chosen = torch.tensor([7, 8, 9, 30, 60, 61])
    assert s.document_order(ctx, chosen) == [1, 2, 0]
    assert s.document_order(ctx, chosen[:0]) == [0, 1, 2]  # ties keep the prompt order
