"""Bucketed (layout-free) fused prefills against the exact-size path, on CPU (fp32 tiny models, pool tier).

The bucketed path pads every shape to its bucket and passes the layout as data; padded queries sit at position -1
and padded keys past the prompt. It must give the exact-size path's choice and logits for every eligible strategy,
for layouts of different document counts and lengths that share one bucket (one graph would serve them all).
"""
from __future__ import annotations

import pytest
import torch

from kvfuse.engine.bucketed import DRIFT_TABLE_ROWS, bucket_size
from kvfuse.engine.fusion import make_strategy
from kvfuse.engine.types import as_documents

from cases import DOCS, QUESTION

LAYOUT_FREE = ["full", "reuse", "epic", "cacheblend", "infoflow", "prophetkv", "qcfuse",
               "infoflow:window=0.55/0.65:rows=question", "epic:per_doc=4",  # the question's own rows as data
               # the drift correction: every candidate row corrected in its scratch row from its first layer on
               "infoflow:drift=0.7", "epic:drift=0.5:drift_from=0.5", "cacheblend:drift=0.5:drift_from=0.5"]
EXTRA = [("extra1", "Dunmore lies on the river Aller, two days by coach from Carvel and its old university."),
         ("extra2", "The Helder range is volcanic; its slopes hold three observatories and a small ski resort.")]


def _prefill(engine, question, docs, strategy, ratio):
    strat = make_strategy(strategy)
    layout, segs, _ = engine._prepare(question, as_documents(docs), strat)
    out = engine.runner.prefill(layout.ids, segs, strat, ratio, extra_capacity=4)
    seq = engine.decoding.open(out.pending, engine.decoding.arena.alloc(layout.n + 4), 4)
    return layout, out, seq


def test_bucket_sizes():
    for x in range(1, 5000):
        b = bucket_size(x, 8, 64)
        assert b >= x and b >= 64
        if x > 64:
            assert (b - x) * 8 <= x  # at most 1/8 of padding
        assert bucket_size(b, 8, 64) == b  # a bucket is its own bucket
    assert bucket_size(0, 4, 16) == 0
    assert [bucket_size(x, 4, 16) for x in (1, 16, 17, 33, 100, 1300)] == [16, 16, 20, 40, 112, 1536]


def _engine_pair(strategy=None):
    """{True: bucketed, False: exact-size} engines over one tiny model, DOCS + EXTRA precomputed (with the offline
    data `strategy` reads)."""
    import fixtures

    model, tok, info = fixtures.load_tiny("llama", dtype=torch.float32)
    made = {flag: fixtures.engine_from(model, tok, info, kv_tier="pool", bucketed_prefill=flag, disk_budget_bytes=0)
            for flag in (True, False)}
    for e in made.values():
        e.precompute(DOCS + EXTRA, strategy=strategy)
    return made


@pytest.fixture(scope="module")
def engines():
    made = _engine_pair()
    yield made
    for e in made.values():
        e.close()


@pytest.mark.parametrize("strategy", LAYOUT_FREE)
@pytest.mark.parametrize("docs", [DOCS, DOCS[:2], [EXTRA[0], *DOCS, EXTRA[1]]], ids=["3docs", "2docs", "5docs"])
def test_bucketed_equals_exact_size(engines, strategy, docs):
    bucketed, exact = engines[True], engines[False]
    assert bucketed.runner.layout is not None and exact.runner.layout is None
    runs = bucketed.runner.layout.eager_runs
    layout, out, seq = _prefill(bucketed, QUESTION, docs, strategy, 0.3)
    assert bucketed.runner.layout.eager_runs == runs + 1  # it did take the bucketed path
    _, ref, ref_seq = _prefill(exact, QUESTION, docs, strategy, 0.3)
    assert out.recomputed.tolist() == ref.recomputed.tolist()
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=2e-5)
    # what decoding reads: the same K/V behind every prompt position, in the arena
    pool, ref_pool = bucketed.decoding.arena.pool, exact.decoding.arena.pool
    for i in (0, 1, pool.k.shape[0] - 1):
        torch.testing.assert_close(pool.k[i][seq.row_map[:layout.n]], ref_pool.k[i][ref_seq.row_map[:layout.n]],
                                   rtol=0, atol=2e-5)
        torch.testing.assert_close(pool.v[i][seq.row_map[:layout.n]], ref_pool.v[i][ref_seq.row_map[:layout.n]],
                                   rtol=0, atol=2e-5)
    bucketed.decoding.close(seq)
    exact.decoding.close(ref_seq)


def test_layouts_of_one_bucket_share_a_key(engines):
    """Different document counts and lengths in one bucket: one key (so one graph), inputs as data."""
    eng = engines[True]
    keys = set()
    for docs in (DOCS, [DOCS[2], DOCS[0], DOCS[1]], DOCS[::-1]):  # new positions, rows and exact document
        strat = make_strategy("infoflow")
        layout, segs, _ = eng._prepare(QUESTION, as_documents(docs), strat)
        plan = eng.runner.plan(layout.n, segs, strat)
        h = eng.runner.layout.plan(plan, layout.ids, strat, 0.3)
        assert h is not None and h.nb >= layout.n
        keys.add(h.key)
    assert len(keys) == 1


def test_document_count_does_not_split_drift_buckets(engines):
    """A drift request's per-document table is sized by a bound, not the count: 3 documents and the same text cut
    into 12 (past the old rule's 8-row table) share one key when their row buckets agree."""
    eng = engines[True]
    words = " ".join(text for _, text in DOCS).split()
    cuts = [len(words) * i // 12 for i in range(13)]
    many = [(f"piece{i}", " ".join(words[cuts[i]:cuts[i + 1]])) for i in range(12)]
    hs = []
    for docs in (DOCS, many):
        strat = make_strategy("infoflow:drift=0.5")
        layout, segs, _ = eng._prepare(QUESTION, as_documents(docs), strat)
        h = eng.runner.layout.plan(eng.runner.plan(layout.n, segs, strat), layout.ids, strat, 0.3)
        assert h is not None
        hs.append(h)
    assert hs[0].db == hs[1].db == DRIFT_TABLE_ROWS
    assert (hs[0].nb, hs[0].mb, hs[0].kb) == (hs[1].nb, hs[1].mb, hs[1].kb)
    assert hs[0].key == hs[1].key


def test_question_length_does_not_pick_a_new_graph(engines):
    """Real questions vary in length: a few words more (28 vs 31 always-computed rows here) keep the bucket, since M
    is coarse (at least 32 rows, then 2 sizes per octave), and both requests still give the exact path's tokens."""
    eng, exact = engines[True], engines[False]
    keys, ms = set(), set()
    for q in (QUESTION, QUESTION + " Answer briefly."):
        strat = make_strategy("infoflow")
        layout, segs, _ = eng._prepare(q, as_documents(DOCS), strat)
        h = eng.runner.layout.plan(eng.runner.plan(layout.n, segs, strat), layout.ids, strat, 0.3)
        keys.add(h.key)
        ms.add(h.m)
        a = eng.generate(q, DOCS, strategy="infoflow", recompute_ratio=0.3, max_new_tokens=4)
        b = exact.generate(q, DOCS, strategy="infoflow", recompute_ratio=0.3, max_new_tokens=4)
        assert a.token_ids == b.token_ids
    assert len(ms) == 2 and len(keys) == 1


def test_generation_matches_exact_size(engines):
    """Whole requests (prefill and greedy decode) give the exact-size path's tokens."""
    for strategy in ("infoflow", "cacheblend", "epic"):
        a = engines[True].generate(QUESTION, DOCS, strategy=strategy, recompute_ratio=0.2, max_new_tokens=8)
        b = engines[False].generate(QUESTION, DOCS, strategy=strategy, recompute_ratio=0.2, max_new_tokens=8)
        assert a.token_ids == b.token_ids, strategy
        assert a.recomputed_tokens == b.recomputed_tokens


def test_ineligible_requests_take_the_exact_path(engines):
    eng = engines[True]
    runs = eng.runner.layout.eager_runs
    eng.generate(QUESTION, DOCS, strategy="cacheblend", recompute_ratio=0.2, max_new_tokens=2,
                 strategy_options={"gradual": True})  # several check layers: not layout-free
    sparse = eng.generate(QUESTION, DOCS, strategy="sift", max_new_tokens=2, min_tokens=0, max_density=1.0,
                          on_miss="compute")  # its sparse plan is per request
    assert sparse.extra["sift"]["sparse"] is True
    eng.generate(QUESTION, DOCS, strategy="cacheblend:drift=0.5:drift_from=0", recompute_ratio=0.2,
                 max_new_tokens=2)  # a drift layer at or before the check layer
    assert eng.runner.layout.eager_runs == runs


def test_a_sift_request_attending_densely_takes_full_prefills_path(engines):
    eng, exact = engines[True], engines[False]
    runs = eng.runner.layout.eager_runs
    got = eng.generate(QUESTION, DOCS, strategy="sift", max_new_tokens=4)  # a short prompt: dense
    assert got.extra["sift"]["sparse"] is False
    assert eng.runner.layout.eager_runs == runs + 1  # the layout-free path, as full takes
    assert got.token_ids == exact.generate(QUESTION, DOCS, strategy="full", max_new_tokens=4).token_ids


@pytest.fixture(scope="module")
def anchored():
    """Engines whose caches carry qcfuse's anchors (so its probe sees a compressed view)."""
    made = _engine_pair("qcfuse")
    yield made
    for e in made.values():
        e.close()


@pytest.mark.parametrize("docs", [DOCS, [EXTRA[0], *DOCS, EXTRA[1]]], ids=["3docs", "5docs"])
def test_qcfuse_compressed_view_as_data_equals_exact_size(anchored, docs):
    """qcfuse's probe attends to the prefix, the anchors and the question only: in the bucketed path that view is
    data (padded to its own bucket); choice, logits and decode K/V match the exact-size path's."""
    bucketed, exact = anchored[True], anchored[False]
    strat = make_strategy("qcfuse")
    layout, segs, _ = bucketed._prepare(QUESTION, as_documents(docs), strat)
    plan = bucketed.runner.plan(layout.n, segs, strat)
    h = bucketed.runner.layout.plan(plan, layout.ids, strat, 0.3)
    assert h is not None and h.kind == "probe" and 0 < h.vb
    view = h.packed[-h.vb:]
    assert 0 < int((view >= 0).sum()) < layout.n  # compressed: some document keys are left out
    runs = bucketed.runner.layout.eager_runs
    layout, out, seq = _prefill(bucketed, QUESTION, docs, "qcfuse", 0.3)
    assert bucketed.runner.layout.eager_runs == runs + 1
    _, ref, ref_seq = _prefill(exact, QUESTION, docs, "qcfuse", 0.3)
    assert out.recomputed.tolist() == ref.recomputed.tolist()
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=2e-5)
    pool, ref_pool = bucketed.decoding.arena.pool, exact.decoding.arena.pool
    for i in (0, pool.k.shape[0] - 1):
        torch.testing.assert_close(pool.k[i][seq.row_map[:layout.n]], ref_pool.k[i][ref_seq.row_map[:layout.n]],
                                   rtol=0, atol=2e-5)
    bucketed.decoding.close(seq)
    exact.decoding.close(ref_seq)


def test_qcfuse_view_changes_its_choice(anchored):
    """The view is not decoration: with every key in view (full_view) the probe's states, hence its choice or
    logits, differ from the compressed probe's on the same layout."""
    eng = anchored[True]
    a = eng.generate(QUESTION, DOCS, strategy="qcfuse", recompute_ratio=0.3, max_new_tokens=1, return_logprobs=True)
    b = eng.generate(QUESTION, DOCS, strategy="qcfuse", recompute_ratio=0.3, max_new_tokens=1, return_logprobs=True,
                     strategy_options={"full_view": True})
    assert a.recomputed_positions != b.recomputed_positions or not torch.equal(
        a.extra["logprobs"], b.extra["logprobs"])


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


def _fake_capture(fn, device, pool=None, clock=None):
    """A CUDA graph's contract on the CPU: the warm-up run computes, the "capture" makes static outputs, and a
    replay runs the same function again, writing into those static outputs in place."""
    if clock is not None:
        clock.start()
    warm = fn()
    if clock is not None:
        clock.stop()
    static = fn()

    class Graph:
        def replay(self):
            _copy_into(static, fn())
    return Graph(), static, warm


def _graph_engines(monkeypatch, idle: bool = False, idle_reported: bool = True):
    """(eager engine, engine whose bucket graphs are the CPU stand-in, its LayoutGraphs). `idle`: its
    EngineConfig.idle_captures; `idle_reported=False`: it never reports graph work to its scheduler, as a server
    that is never idle."""
    import fixtures

    from kvfuse.engine import bucketed

    monkeypatch.setattr(bucketed, "capture_graph_keeping_warm", _fake_capture)
    model, tok, info = fixtures.load_tiny("llama", dtype=torch.float32)
    eager, graphs = (fixtures.engine_from(model, tok, info, kv_tier="pool", bucketed_prefill=True,
                                          disk_budget_bytes=0, idle_captures=on) for on in (False, idle))
    lg = graphs.runner.layout
    lg.graphs = True
    assert lg.defer == idle and not eager.runner.layout.defer  # EngineConfig.idle_captures reaches the graphs
    if not idle_reported:
        monkeypatch.setattr(type(graphs), "deferred_work", property(lambda self: 0))
    return eager, graphs, lg


def _ways(eager, graphs, lg, calls, kw, wait: bool = False) -> list[tuple[int, int, int]]:
    """Sends each (question, docs) to both engines; the graphs engine must answer as the eager one (tokens,
    log-probs, recomputed rows, a probe's selection timed). Returns each call's (eager runs, captures, replays)
    delta; `wait`: a capture the call left for idle time is made (and counted) before the next call."""
    seen = []
    for question, docs in calls:
        ref = eager.generate(question, docs, **kw)
        before = (lg.eager_runs, lg.captures, lg.replays)
        got = graphs.generate(question, docs, **kw)
        if wait:
            assert graphs.wait_for_deferred(60)
        seen.append(tuple(b - a for a, b in zip(before, (lg.eager_runs, lg.captures, lg.replays))))
        assert got.token_ids == ref.token_ids
        torch.testing.assert_close(got.extra["logprobs"], ref.extra["logprobs"], rtol=0, atol=1e-5)
        assert got.recomputed_tokens == ref.recomputed_tokens
        assert (got.selection_s > 0) == (ref.selection_s > 0)  # a probe's selection is timed on every path
    return seen


@pytest.mark.parametrize("strategy,keep_warm", [("full", True), ("epic", True), ("cacheblend", True),
                                                ("infoflow", True), ("infoflow", False)])
def test_the_request_that_captures_a_bucket_answers_like_eager(monkeypatch, keep_warm, strategy):
    """The capture path's bookkeeping, run on the CPU with a stand-in for CUDA graphs: the request that captures
    its bucket answers as the eager padded prefill does, whether it answers from the capture's warm-up run
    (`keep_warm`: no replay; a probing strategy's warm-up selection must reach the fused pass's warm-up) or replays
    the new graph; later layouts of the bucket replay and answer alike too."""
    eager, graphs, lg = _graph_engines(monkeypatch)  # the default: captured on the path of the request due
    lg.keep_warm = keep_warm
    kw = dict(strategy=strategy, recompute_ratio=0.3, max_new_tokens=4, return_logprobs=True)
    calls = [(QUESTION, DOCS)] * 3 + [(QUESTION, DOCS[::-1])]  # eager, capture, replay; a new layout: replay
    seen = _ways(eager, graphs, lg, calls, kw)
    capture = (0, 1, 0) if keep_warm else (0, 1, 1)
    assert seen == [(1, 0, 0), capture, (0, 0, 1), (0, 0, 1)], seen
    eager.close()
    graphs.close()


@pytest.mark.parametrize("strategy", ["full", "infoflow", "cacheblend"])
def test_a_bucket_due_for_capture_is_captured_in_idle_time_not_on_the_request_path(monkeypatch, strategy):
    """With `idle_captures` the request that makes its bucket due runs eagerly and leaves the capture to the
    engine's idle time (the scheduler's `build_deferred`); the graph captured there, on that request's inputs,
    serves the next requests of the bucket (the same layout and a new one) with the eager engine's tokens,
    log-probs and recomputed rows."""
    eager, graphs, lg = _graph_engines(monkeypatch, idle=True)
    kw = dict(strategy=strategy, recompute_ratio=0.3, max_new_tokens=4, return_logprobs=True)
    seen = _ways(eager, graphs, lg, [(QUESTION, DOCS)] * 3 + [(QUESTION, DOCS[::-1])], kw, wait=True)
    # 1st eager; 2nd eager, then captured when idle; then replays
    assert seen == [(1, 0, 0), (1, 1, 0), (0, 0, 1), (0, 0, 1)], seen
    assert not lg.backlog and len(lg.entries) == 1
    eager.close()
    graphs.close()


def test_a_due_bucket_seen_again_before_idle_time_is_captured_on_that_request(monkeypatch):
    """A server that never idles still gets its graphs: a bucket left due for capture and seen again before the
    engine was idle is captured on that request's path (answering from the capture's warm-up run), then replayed;
    `reset` forgets what was due."""
    eager, graphs, lg = _graph_engines(monkeypatch, idle=True, idle_reported=False)
    kw = dict(strategy="infoflow", recompute_ratio=0.3, max_new_tokens=4, return_logprobs=True)
    seen = _ways(eager, graphs, lg, [(QUESTION, DOCS)] * 4, kw)
    assert seen == [(1, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1)], seen
    assert not lg.backlog
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)  # reset starts a new pool (CUDA only)
    lg.reset()
    graphs.generate(QUESTION, DOCS, **kw)
    graphs.generate(QUESTION, DOCS, **kw)
    assert len(lg.backlog) == 1 and graphs.serving_stats()["prefill_graphs_deferred"] == 1
    lg.reset()
    assert not lg.backlog and not lg.entries
    eager.close()
    graphs.close()
