"""prophetkv: question attention over the full cache at layers across depth, each layer normalised, fused."""
from __future__ import annotations

import pytest
import torch

from kvfuse.engine.fusion import make_strategy

from strategy_cases import assert_planted_selected, make_ctx, plant


def test_probe_layers_spread_over_depth_and_full_view():
    s = make_strategy("prophetkv")
    layers = s.probe_layers(24)
    assert len(layers) == 6 and layers[0] == 6 and layers[-1] == 23
    assert s.probe_keys(make_ctx()) is None  # the full cache
    assert make_strategy("prophetkv", layers=(1, -1)).probe_layers(24) == (1, 23)


@pytest.mark.parametrize("ratio", [0.04, 0.15, 0.3])
def test_planted_tokens_are_selected_and_budget_is_exact(ratio):
    assert_planted_selected("prophetkv", ratio, [6, 33, 80], 0.08)


def test_each_layer_weighs_the_same():
    """Layer A gives the candidates 0.9 of its mass (x 0.5, z 0.4); layer B only 0.1 (y 0.08). Raw averaging
    picks {x, z}; per-layer normalisation picks {x, y}, as ProphetKV's layer fusion does."""
    ctx = make_ctx(n_layers=8, layers=(4, 7), ratio=2 / 75, seed=3)
    for layer in (4, 7):  # remove the random noise on candidates: exact masses
        att = ctx.question_attention[layer]
        att[:, ctx.candidates] = 0.0
        att[:, 0] = 1.0 - att[:, 1:].sum(1)
    x, z, y = 10, 40, 70
    plant(ctx, 4, x, 0.5)
    plant(ctx, 4, z, 0.4)
    plant(ctx, 7, y, 0.08)
    plant(ctx, 7, 20, 0.02)
    s = make_strategy("prophetkv", layers=(4, 7))
    assert s.initial(ctx).tolist() == [x, y]


def test_ratio_zero_and_one():
    assert make_strategy("prophetkv").initial(make_ctx(ratio=0.0)).numel() == 0
    ctx = make_ctx(ratio=1.0)
    assert torch.equal(make_strategy("prophetkv").initial(ctx), ctx.candidates)
