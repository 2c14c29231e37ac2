"""qcfuse: compressed probe view (prefix + anchors), critical layers (explicit > profile > default), mean scores."""
from __future__ import annotations

import pytest
import torch

from kvfuse.engine.fusion import make_strategy
from kvfuse.engine.fusion.qcfuse import default_critical_layers

from strategy_cases import PREFIX, assert_planted_selected, make_ctx, plant


def test_critical_layers_precedence():
    assert default_critical_layers(24) == (6, 12, 17)
    assert default_critical_layers(3) == (0, 1, 2)
    s = make_strategy("qcfuse")
    assert s.probe_layers(24) == (6, 12, 17)
    s.use_model_profile({"critical_layers": [20, 3, 9]})
    assert s.probe_layers(24) == (3, 9, 20)
    assert s.probe_layers(8) == default_critical_layers(8)  # a profile of another depth is ignored
    s.use_model_profile(None)
    assert s.probe_layers(24) == (6, 12, 17)
    explicit = make_strategy("qcfuse", layers=(1, 2, -1))
    explicit.use_model_profile({"critical_layers": [20, 3, 9]})
    assert explicit.probe_layers(24) == (1, 2, 23)


def test_probe_keys_are_the_prefix_and_the_anchors():
    anchors = [torch.tensor([0, 1, 2, 3, 11], dtype=torch.int32), None, torch.tensor([0, 4, 24, 99], dtype=torch.int32)]
    extras = [{"anchors": a} if a is not None else {} for a in anchors]
    ctx = make_ctx(extras=extras)
    view = make_strategy("qcfuse").probe_keys(ctx)
    (s0, _), (s1, e1), (s2, _) = ctx.doc_spans
    expect = (list(range(PREFIX)) + [s0 + i for i in (0, 1, 2, 3, 11)] + list(range(s1, e1))  # doc 1: no anchors
              + [s2 + i for i in (0, 4, 24)])  # 99 is past the document's end: dropped
    assert view.tolist() == expect
    assert make_strategy("qcfuse", full_view=True).probe_keys(ctx) is None


@pytest.mark.parametrize("ratio", [0.05, 0.15, 0.4])
def test_planted_tokens_at_critical_layers_are_selected(ratio):
    assert_planted_selected("qcfuse", ratio, [8, 45, 71], 0.06)


def test_mean_over_rows_and_only_critical_layers():
    """Key a: 0.5 from one row (mean 0.1); key b: 0.15 from every row (mean 0.15): averaging over question tokens
    picks b. A bigger peak at a non-critical layer counts for nothing."""
    ctx = make_ctx(ratio=1 / 75)
    s = make_strategy("qcfuse")
    crit = s.probe_layers(ctx.n_layers)
    other = next(i for i in range(ctx.n_layers) if i not in crit)
    for layer in crit:
        plant(ctx, layer, 12, 0.5, rows=[1])
        plant(ctx, layer, 50, 0.15)
    plant(ctx, other, 33, 0.6)
    assert s.initial(ctx).tolist() == [50]


def test_ratio_zero_and_one():
    assert make_strategy("qcfuse").initial(make_ctx(ratio=0.0)).numel() == 0
    ctx = make_ctx(ratio=1.0)
    assert torch.equal(make_strategy("qcfuse").initial(ctx), ctx.candidates)
