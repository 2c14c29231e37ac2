"""`FusionEngine.warmup`: its arguments are checked before any work, it does nothing without CUDA graphs, and the
requests it plans cover every shape bucket of the range (host arithmetic; the GPU test checks the replays)."""
from __future__ import annotations

import random

import pytest
from fixtures import load_tiny

from kvfuse.engine.api import FusionEngine
from kvfuse.engine.bucketed import bucket_sizes, monotone_runs, plan_buckets, strategy_kind
from kvfuse.engine.config import EngineConfig
from kvfuse.engine.fusion import make_strategy


@pytest.fixture(scope="module")
def engine():
    model, tok, info = load_tiny("llama3")
    e = FusionEngine(model, tok, EngineConfig(), model_name=info.name, model_fingerprint=info.fingerprint,
                     tokenizer_fingerprint=info.tokenizer_fingerprint)
    yield e
    e.close()


@pytest.mark.parametrize("kwargs", [dict(contexts=(800, 400)), dict(contexts=(10, 400)),
                                    dict(question_tokens=(40, 8)), dict(ratios=[1.5]),
                                    dict(strategies=["nope"]), dict(contexts=(64, 10 ** 7))])
def test_bad_arguments_are_refused_before_any_work(engine, kwargs):
    with pytest.raises(ValueError):
        engine.warmup(**kwargs)


def test_without_cuda_graphs_it_does_nothing(engine):
    out = engine.warmup(contexts=(200, 400), strategies=["infoflow"])
    assert out["requests"] == 0 and out["captured"] == 0


@pytest.mark.parametrize("name", ["full", "reuse", "cacheblend", "infoflow"])
def test_planned_requests_cover_every_bucket_of_the_range(engine, name):
    strat = make_strategy(name)
    prefix = len(engine.prompts.prefix_ids)
    kind = strategy_kind(strat, engine.decoder.spec.n_layers)
    if engine.runner.layout is None:  # CPU: the bucketed path is off; its arithmetic is what the plan uses
        from kvfuse.engine.bucketed import LayoutGraphs
        engine.runner.layout = LayoutGraphs(engine.runner, graphs=False)
    points = list(engine._warmup_buckets(strat, 0.15, 300, 1500, 8, 60, prefix)[1].values())

    def key(n, q):
        body = n - prefix - q
        k = 0 if kind == "plain" or strat.ignores_ratio else min(body - 16, round(0.15 * body))
        m = n if kind == "plain" else q  # a plain prefill computes every row
        return bucket_sizes(kind, n, m, k, engine.runner.layout.row_steps)

    planned = {key(n, q) for n, q in points}
    assert len(planned) == len(points)  # one request per bucket
    rng = random.Random(0)
    for _ in range(500):
        n, q = rng.randint(300, 1500), rng.randint(8, 60)
        assert key(n, q) in planned, (n, q)
    # a wrong plan misses: the same check against a plan of a narrower range fails
    narrow = set(engine._warmup_buckets(strat, 0.15, 300, 700, 8, 60, prefix)[1])
    assert any(key(n, q) not in narrow for n, q in [(1500, 60), (1400, 8)])


def test_monotone_runs_split_a_range_where_the_function_steps():
    f = lambda x: x // 10  # noqa: E731
    assert monotone_runs(f, 5, 34) == [(30, 34), (20, 29), (10, 19), (5, 9)]
    assert monotone_runs(f, 7, 7) == [(7, 7)]
    assert monotone_runs(f, 8, 7) == []


@pytest.mark.parametrize("kind", ["plain", "probe", "check"])
def test_the_bucket_plan_equals_an_exhaustive_scan_and_stays_cheap_at_128k(kind):
    prefix, ratio = 20, 0.15
    calls = 0

    def k_of(body):
        nonlocal calls
        calls += 1
        return 0 if kind == "plain" else min(body - 16, round(ratio * body))

    def key(n, q):
        return bucket_sizes(kind, n, n if kind == "plain" else q, k_of(n - prefix - q))

    plan = plan_buckets(kind, 200, 900, 5, 70, prefix, k_of)
    every = {key(n, q) for n in range(200, 901) for q in range(5, 71) if n - prefix - q >= 32}
    assert set(plan) == every
    assert all(key(n, q) == k for k, (n, q) in plan.items())  # each planned request lands in its own bucket
    calls = 0
    big = plan_buckets(kind, 1024, 131072, 16, 128, prefix, k_of)
    assert len(big) > 10 and calls < 20000  # bisection, not a scan of ~130k x 112 pairs


def _cpu_layout(engine):
    from kvfuse.engine.bucketed import LayoutGraphs

    if engine.runner.layout is None:  # CPU: the bucketed path is off; its bookkeeping is plain host code
        engine.runner.layout = LayoutGraphs(engine.runner, graphs=False)
    return engine.runner.layout


def test_a_full_bucket_cache_drops_the_least_recently_used_bucket_not_all(engine):
    lg = _cpu_layout(engine)
    saved = (dict(lg.entries), dict(lg.sizes), lg.max_graphs, lg.max_bytes, lg.evictions)
    try:
        lg.entries.clear()
        lg.sizes.clear()
        lg.max_graphs, lg.max_bytes = 3, 1000
        for key in "abc":
            lg.entries[key], lg.sizes[key] = object(), 100
        lg.entries["a"] = lg.entries.pop("a")  # "a" was just used (run() moves it last): "b" is the oldest now
        assert lg.make_room(100) == ["b"] and list(lg.entries) == ["c", "a"]
        lg.entries["d"], lg.sizes["d"] = object(), 100
        assert lg.make_room(850) == ["c", "a"] and list(lg.entries) == ["d"]  # the byte bound: 100 + 850 <= 1000
        assert lg.make_room(10) == [] and lg.evictions - saved[4] == 3
    finally:
        lg.entries.clear()
        lg.entries.update(saved[0])
        lg.sizes.clear()
        lg.sizes.update(saved[1])
        lg.max_graphs, lg.max_bytes = saved[2], saved[3]


def test_a_warmup_that_would_drop_its_own_graphs_is_refused_before_any_work(engine):
    lg = _cpu_layout(engine)
    prefix = len(engine.prompts.prefix_ids)
    strat = make_strategy("infoflow")
    saved = (lg.graphs, lg.max_graphs, lg.max_bytes)
    try:
        lg.graphs = True  # as on CUDA: the plan is checked against what the runner keeps
        plan = engine._warmup_plan([strat], [0.15], 300, 1500, 8, 60, prefix)
        planned = len(plan[0][2])
        assert planned > 2
        lg.max_graphs = planned
        assert engine._warmup_plan([strat], [0.15], 300, 1500, 8, 60, prefix)  # exactly fits
        with pytest.raises(ValueError, match="shape buckets"):  # two ratios: twice the buckets
            engine._warmup_plan([strat], [0.15, 0.3], 300, 1500, 8, 60, prefix)
        lg.max_graphs, lg.max_bytes = 10 ** 6, 1024  # the bytes bound too
        with pytest.raises(ValueError, match="GiB"):
            engine._warmup_plan([make_strategy("full")], [0.15], 300, 1500, 8, 60, prefix)
    finally:
        lg.graphs, lg.max_graphs, lg.max_bytes = saved


def test_a_bucket_met_at_two_ratios_is_warmed_once(engine):
    lg = _cpu_layout(engine)
    prefix = len(engine.prompts.prefix_ids)
    strat = make_strategy("infoflow")
    saved = lg.graphs
    try:
        lg.graphs = True
        once = engine._warmup_plan([strat], [0.15], 300, 1500, 8, 60, prefix)
        twice = engine._warmup_plan([strat], [0.15, 0.15], 300, 1500, 8, 60, prefix)
        assert [len(p) for _, _, p in twice] == [len(once[0][2]), 0]
    finally:
        lg.graphs = saved


@pytest.fixture(scope="module")
def pool_engine():
    """Documents in the engine's pool, as on CUDA: the bucketed path serves fused strategies from there."""
    model, tok, info = load_tiny("llama3")
    e = FusionEngine(model, tok, EngineConfig(kv_tier="pool"), model_name=info.name,
                     model_fingerprint=info.fingerprint, tokenizer_fingerprint=info.tokenizer_fingerprint)
    yield e
    e.close()


@pytest.mark.parametrize("name", ["full", "cacheblend", "infoflow"])
def test_each_planned_request_lands_in_its_bucket_in_the_engine_itself(pool_engine, name):
    """The plan's arithmetic against the bucketed path's own: the synthetic request warm-up makes for a planned
    bucket gets exactly that bucket from `LayoutGraphs.plan` (run eagerly on the CPU)."""
    import torch

    engine = pool_engine
    lg = _cpu_layout(engine)
    strat = make_strategy(name)
    prefix = len(engine.prompts.prefix_ids)
    kind, buckets = engine._warmup_buckets(strat, 0.2, 200, 400, 8, 40, prefix)
    met = []
    plan = type(lg).plan

    def spy(self, *args, **kwargs):
        h = plan(self, *args, **kwargs)
        if h is not None:
            met.append((h.nb, h.mb, h.kb))
        return h

    g = torch.Generator().manual_seed(1)
    made = []
    try:
        type(lg).plan = spy
        items = list(buckets.items())
        for sizes, (n, q) in [items[0], items[-1]]:  # the largest bucket and the smallest
            ids, docs = engine._warmup_request(n, q, 64, g, len(made))
            made += [d.id for d in docs]
            met.clear()
            engine.generate(question_ids=ids, docs=docs, strategy=strat, recompute_ratio=0.2, max_new_tokens=1)
            assert met[-1] == sizes, (n, q, met, sizes)
    finally:
        type(lg).plan = plan
        engine.forget(made)
