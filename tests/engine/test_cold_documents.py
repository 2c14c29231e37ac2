"""New documents (no cache yet): EngineConfig.cold_documents.

"compute" (the default) computes every miss before fusing; "full" answers a request with missing caches by full
prefill (the exact answer) and builds those caches when the engine is idle, and "auto" does so when computing them
would cost more than a full prefill; a document seen cold before and still waiting is computed by its next request.
"""
from __future__ import annotations

import pytest
from cases import DOCS, QUESTION

from kvfuse.engine.config import EngineConfig
from kvfuse.engine.store import content_key
from kvfuse.engine.types import as_documents


def _keys(engine, docs):
    return [content_key(engine.namespace, engine.prompts.prefix_ids, engine.prompts.encode_document(d))
            for d in as_documents(docs)]


def test_all_new_documents_get_full_prefill_and_their_caches_are_built_when_idle(tiny_engine):
    engine = tiny_engine("llama", cold_documents="auto")
    full = engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=6)
    assert engine.wait_for_deferred(30)
    assert not any(engine.store.peek(k) for k in _keys(engine, DOCS))  # full reads no cache and defers nothing
    r = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=6)
    assert r.strategy == "full" and r.token_ids == full.token_ids and r.text == full.text
    assert r.cache_misses == 0 and r.miss_prefill_s == 0.0  # nothing computed before the first token
    cold = r.extra["cold"]
    assert cold["requested"] == "reuse" and cold["missing_documents"] == 3 and cold["policy"] == "auto"
    assert cold["missing_tokens"] == sum(len(engine.prompts.encode_document(d)) for d in as_documents(DOCS))
    assert engine.wait_for_deferred(30)  # the scheduler builds them between requests
    assert all(engine.store.peek(k) for k in _keys(engine, DOCS))
    again = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=6)
    assert again.strategy == "reuse" and "cold" not in again.extra
    assert again.cache_hits == 3 and again.cache_misses == 0


def test_cached_built_between_requests_equal_caches_computed_in_the_request(tiny_engine):
    """The idle build stores what `precompute` stores: the next fused answer is the same either way."""
    built = tiny_engine("qwen2", cold_documents="auto")
    built.generate(QUESTION, DOCS, strategy="cacheblend", recompute_ratio=0.3, max_new_tokens=1)
    assert built.wait_for_deferred(30)
    ref = tiny_engine("qwen2", cold_documents="compute")
    ref.precompute(DOCS)
    a = built.generate(QUESTION, DOCS, strategy="cacheblend", recompute_ratio=0.3, max_new_tokens=6,
                       return_logprobs=True)
    b = ref.generate(QUESTION, DOCS, strategy="cacheblend", recompute_ratio=0.3, max_new_tokens=6,
                     return_logprobs=True)
    assert a.strategy == b.strategy == "cacheblend" and a.token_ids == b.token_ids
    assert a.recomputed_positions == b.recomputed_positions
    assert float((a.extra["logprobs"] - b.extra["logprobs"]).abs().max()) < 1e-5


def test_compute_policy_computes_every_miss_in_the_request(tiny_engine):
    assert EngineConfig().cold_documents == "compute"  # the default
    engine = tiny_engine("llama")
    r = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=2)
    assert r.strategy == "reuse" and "cold" not in r.extra and r.cache_misses == 3
    assert engine.deferred_work == 0


def test_auto_computes_a_few_misses_and_full_policy_never_does(tiny_engine):
    auto = tiny_engine("llama", cold_documents="auto")
    auto.precompute(DOCS[:2])
    r = auto.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=2)  # 1 of 3 documents new: below half
    assert r.strategy == "reuse" and "cold" not in r.extra and r.cache_misses == 1 and r.cache_hits == 2
    strict = tiny_engine("llama", cold_documents="full")
    strict.precompute(DOCS[:2])
    r = strict.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=2)
    assert r.strategy == "full" and r.extra["cold"]["missing_documents"] == 1 and r.cache_misses == 0


def test_a_document_still_waiting_is_computed_by_its_next_request(tiny_engine):
    """Under steady load the engine is never idle: the second sight of a cold document computes it."""
    engine = tiny_engine("llama", cold_documents="auto")
    docs = as_documents(DOCS)
    ids = [engine.prompts.encode_document(d) for d in docs]
    tail = len(engine.prompts.encode_tail(QUESTION))
    from kvfuse.engine.fusion import make_strategy

    with engine.scheduler.exclusive():  # the scheduler cannot build anything meanwhile
        first = engine.cold_documents(docs, ids, make_strategy("infoflow"), 0.15, tail)
        assert first is not None and first["missing_documents"] == 3 and engine.deferred_work == 3
        assert engine.cold_documents(docs, ids, make_strategy("infoflow"), 0.15, tail) is None
        # strategies that read no cache, or a cache variant of their own, are served as asked
        new = as_documents([("tides", " ".join(["Spring tides at Dunmore rise four metres above the harbour wall."]
                                               * 8))])  # most of its prompt
        new_ids = [engine.prompts.encode_document(new[0])]
        assert engine.cold_documents(new, new_ids, make_strategy("reuse"), 0.0, tail) is not None
        for name in ("full", "sift", "fusionrag"):
            assert engine.cold_documents(new, new_ids, make_strategy(name), 0.15, tail) is None


def test_cold_documents_value_is_checked():
    with pytest.raises(ValueError, match="cold_documents"):
        EngineConfig(cold_documents="lazy")


def test_a_forgotten_document_is_not_built_later(tiny_engine, monkeypatch):
    engine = tiny_engine("llama", cold_documents="full")
    monkeypatch.setattr(engine, "build_deferred", lambda: False)  # the scheduler builds nothing for now
    r = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=1)
    assert r.strategy == "full" and engine.deferred_work == 3
    engine.forget([DOCS[0][0]])
    assert engine.deferred_work == 2
    monkeypatch.undo()
    assert engine.wait_for_deferred(30)
    assert [engine.store.peek(k) for k in _keys(engine, DOCS)] == [False, True, True]


def test_warmup_requests_are_fused_under_any_policy(tiny_engine, monkeypatch):
    """The server's graph warm-up sends synthetic requests of new documents: they must capture the fused path of
    their buckets, not full prefill's."""
    engine = tiny_engine("llama", cold_documents="full")

    class Layout:  # stands for a CUDA graph cache (none on the CPU)
        capture_after, captures, entries, defer, backlog = 2, 0, {}, True, {}

    monkeypatch.setattr(engine, "_graph_layouts", lambda: [Layout()])
    monkeypatch.setattr(engine, "_warmup_plan", lambda strats, ratios, *a: [(strats[0], ratios[0], [(300, 16),
                                                                                                    (400, 24)])])
    served, real = [], engine.generate
    monkeypatch.setattr(engine, "generate", lambda *a, **k: served.append(real(*a, **k)))
    out = engine.warmup(contexts=(200, 400), strategies=["infoflow"])
    assert out["requests"] == 2 and [r.strategy for r in served] == ["infoflow", "infoflow"]
    assert all("cold" not in r.extra for r in served)
