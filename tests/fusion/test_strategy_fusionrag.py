"""fusionrag (strategy side): declares its cache variant, question-guided top budget."""
from __future__ import annotations

import pytest
import torch

from kvfuse.engine.fusion import make_strategy

from strategy_cases import check_selection, make_ctx, plant


def test_declares_its_cache_variant():
    s = make_strategy("fusionrag", top_k=10, context="full")
    assert s.cache_variant == "fusionrag"
    assert s.variant_options == {"top_k": 10, "context": "full", "neighbours": "leak-free"}
    assert make_strategy("fusionrag").variant_options == {"top_k": 3, "context": "cached", "neighbours": "leak-free"}
    paper = make_strategy("fusionrag:neighbours=co-retrieved:top_k=10:context=full")
    assert paper.variant_options == {"top_k": 10, "context": "full", "neighbours": "co-retrieved"}
    assert paper.describe() == "fusionrag(k=10,full,co-retrieved)"
    with pytest.raises(ValueError, match="context"):
        make_strategy("fusionrag", context="nearby")
    with pytest.raises(ValueError, match="neighbours"):
        make_strategy("fusionrag", neighbours="same-question")


@pytest.mark.parametrize("ratio", [0.03, 0.12, 0.5])
def test_planted_tokens_are_selected_and_budget_is_exact(ratio):
    ctx = make_ctx(ratio=ratio, seed=5)
    s = make_strategy("fusionrag")
    planted = [60, 25, 26]  # strongest first
    for layer in s.probe_layers(ctx.n_layers):
        for p, value in zip(planted, (0.09, 0.08, 0.07)):
            plant(ctx, layer, p, value)
    chosen = s.initial(ctx)
    check_selection(ctx, chosen)
    assert set(planted[: ctx.budget]) <= set(chosen.tolist())


def test_ratio_zero_and_one():
    assert make_strategy("fusionrag").initial(make_ctx(ratio=0.0)).numel() == 0
    ctx = make_ctx(ratio=1.0)
    assert torch.equal(make_strategy("fusionrag").initial(ctx), ctx.candidates)
