"""infoflow: mid-late-layer attention norm (L2 over the question's own rows), top budget; document reorder
order (density); strategy specs."""
from __future__ import annotations

import pytest
import torch

from kvfuse.engine.fusion import make_strategy
from kvfuse.engine.fusion.infoflow import InfoFlow

from strategy_cases import assert_planted_selected, make_ctx, plant


def test_probe_layers_deepest_third_or_the_references_window():
    s = make_strategy("infoflow")
    assert s.probe_layers(24) == tuple(range(16, 24))
    assert s.probe_layers(3) == (2,)
    ref = make_strategy(InfoFlow.REFERENCE)
    assert ref.rows == "question"
    assert ref.probe_layers(40) == (22, 23, 24, 25)  # the reference's scoring layers on a 40-layer model
    assert ref.probe_layers(24) == (13, 14, 15)
    assert ref.probe_layers(32) == (17, 18, 19, 20)
    for n in (2, 3, 8, 24, 80):
        assert max(ref.probe_layers(n)) < n - 1  # never the last
    assert make_strategy("infoflow", window=(0.9, 1.0)).probe_layers(24) == (21, 22)
    assert make_strategy("infoflow", layers=(-1, 5)).probe_layers(24) == (5, 23)
    with pytest.raises(ValueError):
        make_strategy("infoflow", layers=(30,)).probe_layers(24)
    for bad in ({"window": (0.7, 0.6)}, {"rows": "tail"}, {"order": "size"}, {"depth": 0.0}):
        with pytest.raises(ValueError):
            make_strategy("infoflow", **bad)


def test_spec_strings_name_variants():
    s = make_strategy("infoflow:depth=0.5:rows=question:order=count")
    assert (s.depth, s.rows, s.order) == (0.5, "question", "count")
    assert make_strategy("infoflow:layers=3..5").probe_layers(24) == (3, 4, 5)
    assert make_strategy("infoflow:layers=-1/4").probe_layers(24) == (4, 23)
    assert make_strategy("infoflow:reorder=true").reorders_documents
    assert make_strategy("infoflow:rows=all", rows="question").rows == "question"  # keywords win
    assert make_strategy("infoflow:window=0.55/0.65").window == (0.55, 0.65)
    for bad in ("infoflow:rows", "infoflow:=3", "nosuch:x=1"):
        with pytest.raises(ValueError):
            make_strategy(bad)
    with pytest.raises(TypeError):
        make_strategy("infoflow:nosuch=1")


def test_only_the_questions_own_rows_score():
    """Row 0 (say the question template) gives key a 0.5, rows 1-4 (the question's own tokens) give key b 0.1:
    with rows="question" b wins; counting every row (rows="all", the default) a does."""
    ctx = make_ctx(ratio=1 / 75)  # budget 1
    ctx.probe_rows = torch.tensor([False, True, True, True, True])
    a, b = 12, 50
    for layer in range(ctx.n_layers):
        plant(ctx, layer, a, 0.5, rows=[0])
        plant(ctx, layer, b, 0.1, rows=[1, 2, 3, 4])
    assert make_strategy("infoflow", rows="question").initial(ctx).tolist() == [b]
    assert make_strategy("infoflow").initial(ctx).tolist() == [a]
    ctx.probe_rows = torch.zeros(5, dtype=torch.bool)  # none marked: every row counts
    assert make_strategy("infoflow", rows="question").initial(ctx).tolist() == [a]


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


def test_document_order_moves_the_densest_documents_last():
    ctx = make_ctx()
    s = make_strategy("infoflow", reorder=True)
    assert s.reorders_documents and not make_strategy("infoflow").reorders_documents
    # doc 0: 6..25 (20 tokens), doc 1: 26..55 (30), doc 2: 56..80 (25)
    chosen = torch.tensor([7, 8, 9, 30, 60, 61])
    assert s.document_order(ctx, chosen) == [1, 2, 0]
    assert s.document_order(ctx, chosen[:0]) == [0, 1, 2]  # ties keep the prompt order
    # 4 of doc 1's 30 (0.133) against 3 of doc 0's 20 (0.15): by density doc 0 goes last, by count doc 1
    chosen = torch.tensor([7, 8, 9, 30, 31, 32, 33])
    assert s.document_order(ctx, chosen) == [2, 1, 0]
    assert make_strategy("infoflow", reorder=True, order="count").document_order(ctx, chosen) == [2, 0, 1]
