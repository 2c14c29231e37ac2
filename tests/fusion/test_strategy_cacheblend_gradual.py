"""cacheblend with gradual=True: the recomputed set narrows over the check layers, ending exactly at the budget,
each set a subset of the previous one and ranked by key deviation."""
from __future__ import annotations

import pytest
import torch

from kvfuse.engine.fusion import budget_for, make_strategy

from strategy_cases import make_ctx


def _deviating_keys(ctx, layer_seed: int, hot: list[int]):
    """Fresh vs cached keys of the active tokens; the `hot` positions deviate most (by a wide margin)."""
    g = torch.Generator().manual_seed(layer_seed)
    a = int(ctx.active.numel())
    cached = torch.randn(a, 2, 8, generator=g)
    fresh = cached + 0.01 * torch.randn(a, 2, 8, generator=g)
    dev = torch.rand(a, generator=g)  # a random deviation per token
    fresh = fresh + dev[:, None, None]
    for rank, p in enumerate(hot):
        i = int((ctx.active == p).nonzero())
        fresh[i] += 10.0 - rank * 0.1
    return fresh, cached


@pytest.mark.parametrize("ratio", [0.1, 0.15, 0.3])
def test_gradual_narrows_to_the_budget(ratio):
    s = make_strategy("cacheblend", gradual=True)
    ctx = make_ctx(ratio=ratio)
    layers = s.check_layers(ctx.n_layers)
    assert layers == (1, 2, 3)
    active = s.initial(ctx)
    assert torch.equal(active, ctx.candidates)
    hot = [9, 31, 70]
    counts = []
    for step, layer in enumerate(layers):
        ctx.layer, ctx.active = layer, active
        ctx.fresh_k, ctx.cached_k = _deviating_keys(ctx, 100 + step, hot)
        ctx.fresh_v, ctx.cached_v = ctx.fresh_k, ctx.cached_k
        keep = s.refine(ctx)
        assert bool(torch.isin(keep, active).all()), "refine must pick among the active tokens"
        assert bool((keep[1:] > keep[:-1]).all())
        assert set(hot) <= set(keep.tolist()), "the most deviating tokens must stay"
        counts.append(int(keep.numel()))
        active = keep
    n = int(ctx.candidates.numel())
    assert counts[0] == budget_for(min(1.0, 2 * ratio), n)
    assert counts[-1] == ctx.budget
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]


def test_non_gradual_checks_once():
    s = make_strategy("cacheblend")
    assert s.check_layers(24) == (1,)
    ctx = make_ctx(ratio=0.2)
    ctx.layer, ctx.active = 1, s.initial(ctx)
    ctx.fresh_k, ctx.cached_k = _deviating_keys(ctx, 7, [40])
    keep = s.refine(ctx)
    assert keep.numel() == ctx.budget and 40 in keep.tolist()
