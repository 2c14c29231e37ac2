"""DocumentCache's public API, used directly: a document's cache computed once after the prefix, served again as a
hit, recomputed as stale when its text changes under the same id, dropped by `forget`; registrations persisted
with the disk tier; the hooks handed the cache itself."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from cases import DOCS

from kvfuse.engine.config import EngineConfig
from kvfuse.engine.doccache import DocumentCache
from kvfuse.engine.fusion import make_strategy
from kvfuse.engine.runner import Segment
from kvfuse.engine.types import Document

CHANGED = "The Larkspur Observatory was built in 1902 by the lake. Its first director was the geologist Ines Alva."


def _reference(engine, ids: list[int], context: list[int] = ()):
    """The rows of `ids` from one plain prefill of prefix + context + ids, everything computed."""
    full = torch.tensor(engine.prompts.prefix_ids + list(context) + ids)
    n = int(full.numel())
    return engine.runner.prefill(full, [Segment(0, n, None)], make_strategy("reuse"), 0.0,
                                 capture=(n - len(ids), n), want_logits=False).captured


def test_compute_hit_stale_forget(tiny_engine):
    engine = tiny_engine("llama")
    cache, spec = engine.doc_cache, engine.decoder.spec
    doc = Document(*DOCS[0])
    ids = engine.prompts.encode_document(doc)

    [(got_ids, kv)], tokens = cache.kvs([doc])  # a miss: computed after the prefix and stored
    assert got_ids == ids and tokens == len(ids)
    assert tuple(kv.k.shape) == (spec.n_layers, len(ids), spec.n_kv_heads, spec.head_dim)
    ref = _reference(engine, ids)
    torch.testing.assert_close(kv.k, ref.k, rtol=0, atol=1e-5)
    torch.testing.assert_close(kv.v, ref.v, rtol=0, atol=1e-5)
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["stale"]) == (0, 1, 0) and doc.id in cache.registry

    [(_, again)], tokens = cache.kvs([doc])  # a hit: nothing computed, the same rows
    assert tokens == 0 and cache.stats()["hits"] == 1
    torch.testing.assert_close(again.k, kv.k, rtol=0, atol=0)

    new = Document(doc.id, CHANGED)  # same id, another text: stale, recomputed, never the old rows
    new_ids = engine.prompts.encode_document(new)
    [(_, fresh)], tokens = cache.kvs([new])
    stats = cache.stats()
    assert tokens == len(new_ids) and (stats["misses"], stats["stale"]) == (2, 1)
    torch.testing.assert_close(fresh.k, _reference(engine, new_ids).k, rtol=0, atol=1e-5)
    assert cache.stats() == engine.cache_stats()

    assert cache.forget([doc.id, "never-seen"]) == 1
    assert doc.id not in cache.registry
    _, tokens = cache.kvs([new])  # forgotten: computed again, not a hit
    assert tokens == len(new_ids) and cache.stats()["misses"] == 3


def test_compute_after_context_and_the_prefix_layout(tiny_engine):
    engine = tiny_engine("qwen2")
    cache = engine.doc_cache
    ctx_ids, ids = (engine.prompts.encode_document(Document(*d)) for d in DOCS[1:])
    p = len(engine.prompts.prefix_ids)

    full, segs = cache.after_prefix([(ctx_ids, None), (ids, None)])
    assert full.tolist() == engine.prompts.prefix_ids + ctx_ids + ids
    assert [(s.start, s.end, s.kv is None, s.selectable) for s in segs] == [
        (0, p, False, False), (p, p + len(ctx_ids), True, True), (p + len(ctx_ids), full.numel(), True, True)]
    assert segs[0].kv is cache.prefix_kv() and cache.store.peek(cache.prefix_key)

    kv = cache.compute(ids, [(ctx_ids, None)])  # the document's rows after a computed context
    ref = _reference(engine, ids, ctx_ids)
    torch.testing.assert_close(kv.k, ref.k, rtol=0, atol=1e-5)
    torch.testing.assert_close(kv.v, ref.v, rtol=0, atol=1e-5)
    # the context served from its own cache instead: it was computed right after the prefix, at these very
    # positions, so the document's rows come out the same
    [(_, ctx_kv)], _ = cache.kvs([Document(*DOCS[1])])
    served = cache.compute(ids, [(ctx_ids, ctx_kv)])
    torch.testing.assert_close(served.k, kv.k, rtol=0, atol=1e-4)
    torch.testing.assert_close(served.v, kv.v, rtol=0, atol=1e-4)
    assert cache.stats()["misses"] == 1  # compute stores nothing; only kvs did


def test_standalone_cache_registrations_persist_on_disk(tiny_engine, tmp_path):
    engine = tiny_engine("llama")
    config = EngineConfig(disk_cache_dir=tmp_path / "kv")
    first = DocumentCache(engine.runner, engine.prompts, engine.namespace, config,
                          context_window=engine.context_window)
    assert first.register(Document(*DOCS[2])) and not first.register(Document("short", "too short"))
    [(_, kv)], _ = first.kvs([Document(*DOCS[0])])
    first.close()
    second = DocumentCache(engine.runner, engine.prompts, engine.namespace, config,
                           context_window=engine.context_window)
    try:
        assert DOCS[2][0] in second.registry and DOCS[0][0] in second.registry and "short" not in second.registry
        [(_, disk_kv)], tokens = second.kvs([Document(*DOCS[0])])
        assert tokens == 0 and second.stats()["disk_hits"] == 1
        torch.testing.assert_close(disk_kv.k, kv.k, rtol=0, atol=0)
        assert engine.cache_stats()["misses"] == 0  # the engine's own cache was never touched
    finally:
        second.close()


def test_hooks_get_the_cache_and_engine_attributes_delegate(tiny_engine):
    engine = tiny_engine("llama")
    cache = engine.doc_cache
    seen = []

    def marks(c, ids, kv):
        seen.append(c)
        return {"marks": torch.tensor([0, len(ids) - 1], dtype=torch.int32)}

    engine.doc_profilers["marks"] = marks  # the engine's dict is the cache's
    wants = SimpleNamespace(needs_extras=("marks",))
    doc = Document(*DOCS[1])
    [(ids, kv)], tokens = cache.kvs([doc], wants)
    assert seen == [cache] and kv.extras["marks"].tolist() == [0, len(ids) - 1]
    assert tokens == 2 * len(ids)  # the miss, then the extras pass
    _, tokens = cache.kvs([doc], wants)
    assert tokens == 0 and len(seen) == 1  # stored with the entry: not profiled again

    engine.corpus = "a corpus"
    engine.context_window = 300
    assert (cache.corpus, cache.context_window) == ("a corpus", 300)
    assert engine.store is cache.store and engine.registry is cache.registry
    assert engine.cache_variants is cache.cache_variants
