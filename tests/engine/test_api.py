"""FusionEngine's contract: accounting, stale documents, layouts (order, subset, repeats, mixes), bad input,
streams across threads."""
from __future__ import annotations

import threading

import pytest
import torch
from cases import DOCS, QUESTION


def test_hit_miss_accounting_and_any_order_subset_repeat(tiny_engine):
    engine = tiny_engine("qwen2")
    rep = engine.precompute(DOCS[:2])
    assert (rep.hits, rep.misses) == (0, 2) and rep.tokens > 0
    r = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=2)  # 2 cached + 1 new
    assert (r.cache_hits, r.cache_misses) == (2, 1)
    r = engine.generate(QUESTION, [DOCS[2], DOCS[0], DOCS[2]], strategy="cacheblend", max_new_tokens=2)
    assert (r.cache_hits, r.cache_misses) == (3, 0)  # reordered, subset, repeated: all hits
    assert r.doc_tokens == sum(len(s) for s in engine.layout(QUESTION, [DOCS[2], DOCS[0], DOCS[2]]).docs)
    rep = engine.precompute(DOCS)
    assert (rep.hits, rep.misses, rep.tokens) == (3, 0, 0)
    stats = engine.cache_stats()
    assert stats["hits"] >= 8 and stats["misses"] == 3


@pytest.mark.parametrize("pass_tokens", [0, 8192])
def test_changed_document_under_same_id_is_recomputed_not_served_stale(tiny_engine, pass_tokens):
    """The recomputed cache is a fresh engine's bit for bit, also when the fresh engine computes the three documents
    in one pass and this one the changed document alone (the CPU's documents pass runs its GEMMs at one shape)."""
    engine = tiny_engine("llama", document_pass_tokens=pass_tokens)
    engine.precompute(DOCS)
    changed = [DOCS[0], (DOCS[1][0], "The Quillon Lantern Festival was founded in 1931 by the potter Ines Alva."),
               DOCS[2]]
    r = engine.generate(QUESTION, changed, strategy="reuse", max_new_tokens=4, return_logprobs=True)
    assert r.stale == 1 and r.cache_misses == 1 and r.cache_hits == 2
    fresh = tiny_engine("llama", document_pass_tokens=pass_tokens)  # never saw the old text
    ref = fresh.generate(QUESTION, changed, strategy="reuse", max_new_tokens=4, return_logprobs=True)
    assert r.token_ids == ref.token_ids
    torch.testing.assert_close(r.extra["logprobs"], ref.extra["logprobs"], rtol=0, atol=0)


def test_disk_cache_is_shared_across_engines_and_survives_corruption(tiny_engine, tmp_path):
    first = tiny_engine("llama", disk_cache_dir=tmp_path)
    first.precompute(DOCS)
    second = tiny_engine("llama", disk_cache_dir=tmp_path)  # a new process, same disk cache
    r = second.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=2)
    assert (r.cache_hits, r.cache_misses) == (3, 0) and second.cache_stats()["disk_hits"] == 3
    disk = second.store.disk
    from kvfuse.engine.store import content_key
    from kvfuse.engine.types import Document

    key = content_key(second.namespace, second.prompts.prefix_ids,
                      second.prompts.encode_document(Document(*DOCS[1])))
    blob = bytearray(disk.raw_get(key))
    blob[len(blob) // 2] ^= 0xFF  # flip a byte of the payload on disk
    disk.raw_set(key, bytes(blob))
    third = tiny_engine("llama", disk_cache_dir=tmp_path)
    r3 = third.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=2)
    assert (r3.cache_hits, r3.cache_misses) == (2, 1) and third.cache_stats()["corrupt"] == 1
    assert r3.token_ids == r.token_ids  # the corrupt entry was rebuilt, not served


@pytest.mark.parametrize("kwargs,match", [
    (dict(question=""), "question is empty"),
    (dict(recompute_ratio=1.5), "recompute_ratio"),
    (dict(strategy="nope"), "unknown strategy"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(docs=[("a", "")]), "text is empty"),
    (dict(docs="just a string"), "not a single string"),
    (dict(docs=[("a", "b", "c")]), "expected"),
    (dict(temperature=-1.0), "temperature"),
])
def test_bad_input_is_one_clear_error(tiny_engine, kwargs, match):
    engine = tiny_engine("llama")
    args = dict(question=QUESTION, docs=DOCS)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        engine.generate(args.pop("question"), args.pop("docs"), **args)


def test_context_window_is_enforced(tiny_engine):
    engine = tiny_engine("llama")
    long_doc = [("long", "word " * (engine.context_window + 10))]
    with pytest.raises(ValueError, match="context window"):
        engine.generate(QUESTION, long_doc, strategy="full", max_new_tokens=2)


def test_stream_can_be_consumed_from_another_thread(tiny_engine):
    engine = tiny_engine("qwen2")
    ref = engine.generate(QUESTION, DOCS, max_new_tokens=6)
    stream = engine.stream(QUESTION, DOCS, max_new_tokens=6)
    parts = [next(stream)]  # first delta on this thread
    worker = threading.Thread(target=lambda: parts.extend(stream))  # the rest on another
    worker.start()
    worker.join(60)
    assert "".join(parts) == ref.text and stream.result.token_ids == ref.token_ids
    assert engine.generate(QUESTION, DOCS, max_new_tokens=2).text is not None  # the lock was released
