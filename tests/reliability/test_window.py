"""Documents and prompts over the context window are rejected before any model work or cache write.

Each document is tokenized once per request; the lengths are checked before lookups, misses or prefill. The
error is a ValueError naming the document (id and token count) when one alone can't fit, and the whole prompt's
size otherwise. `precompute` checks every document before computing any. The engines here get a 256-token window
(set after construction) so over-window documents stay small and fast.
"""
from __future__ import annotations

import re

import pytest
from cases import DOCS, QUESTION

from kvfuse.engine.store import content_key
from kvfuse.engine.types import Document

WINDOW = 256
LONG = ("long", "The observatory ledger lists every clear night of the year, with the seeing and the stars. " * 20)


def small_window_engine(tiny_engine, family: str = "llama", **config):
    engine = tiny_engine(family, **config)
    engine.context_window = WINDOW
    return engine


def n_tokens(engine, doc) -> int:
    return len(engine.prompts.encode_document(Document(*doc)))


def forbid_model_work(monkeypatch, engine) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("the model ran before the length check")

    monkeypatch.setattr(engine.runner, "prefill", fail)
    monkeypatch.setattr(engine.decoding, "step", fail)
    monkeypatch.setattr(engine.decoding, "extend", fail)
    monkeypatch.setattr(engine.doc_cache, "compute", fail)


def assert_nothing_stored(engine, docs) -> None:
    stats = engine.cache_stats()
    assert stats["hits"] == stats["misses"] == stats["stale"] == 0, stats
    assert stats["memory_entries"] == 0, stats
    assert not engine.store.peek(engine.doc_cache.prefix_key)
    for d in docs:
        ids = engine.prompts.encode_document(Document(*d))
        assert not engine.store.peek(content_key(engine.namespace, engine.prompts.prefix_ids, ids)), d[0]


def count_tokenizations(monkeypatch, engine) -> list[str]:
    seen: list[str] = []
    inner = engine.prompts.encode_document

    def encode_document(doc):
        seen.append(doc.id)
        return inner(doc)

    monkeypatch.setattr(engine.prompts, "encode_document", encode_document)
    return seen


def names(doc_id: str, n: int) -> str:
    return rf"'{re.escape(doc_id)}' \({n} tokens\)"


CALLS = {
    "generate": lambda e, docs, **kw: e.generate(QUESTION, docs, max_new_tokens=4, **kw),
    "stream": lambda e, docs, **kw: "".join(e.stream(QUESTION, docs, max_new_tokens=4, **kw)),
    "next_token_logprobs": lambda e, docs, **kw: e.next_token_logprobs(QUESTION, docs, [1, 2, 3], **kw),
}


STRATEGIES = {"reuse": ("reuse", {}), "cacheblend": ("cacheblend", {}), "full": ("full", {}),
              "infoflow-reorder": ("infoflow", {"reorder": True})}


@pytest.mark.parametrize("call,case", [(c, s) for c in CALLS for s in STRATEGIES
                                       if not (c == "next_token_logprobs" and STRATEGIES[s][1])])  # takes no options
def test_document_over_the_window_is_named_before_any_work(tiny_engine, monkeypatch, call, case):
    strategy, options = STRATEGIES[case]
    engine = small_window_engine(tiny_engine)
    docs = [DOCS[0], LONG, DOCS[2]]
    n = n_tokens(engine, LONG)
    assert n > WINDOW
    forbid_model_work(monkeypatch, engine)
    with pytest.raises(ValueError, match=names("long", n)) as err:
        CALLS[call](engine, docs, strategy=strategy, **options)
    assert "context window of 256" in str(err.value)
    assert "'larkspur'" not in str(err.value) and "'voss'" not in str(err.value)  # only the offender is named
    assert_nothing_stored(engine, docs)

    monkeypatch.undo()  # the engine is unharmed and free: a fitting request runs
    engine.context_window = WINDOW
    r = engine.generate(QUESTION, DOCS[:1], strategy="reuse", max_new_tokens=2)
    assert r.cache_misses == 1 and r.prompt_tokens + 2 <= WINDOW


def test_prompt_over_the_window_is_rejected_before_lookups(tiny_engine, monkeypatch):
    engine = small_window_engine(tiny_engine)
    docs = [(f"part-{i}", "Amelia Voss measured the motion of double stars for forty years. " * 5) for i in range(4)]
    layout = engine.layout(QUESTION, docs)
    per_doc = [len(s) for s in layout.docs]
    fixed = len(layout.prefix) + len(layout.tail) + 4
    assert all(fixed + n <= WINDOW for n in per_doc) and layout.n + 4 > WINDOW  # each fits alone, not together
    forbid_model_work(monkeypatch, engine)
    with pytest.raises(ValueError, match=rf"prompt \+ answer is {layout.n + 4} tokens") as err:
        engine.generate(QUESTION, docs, strategy="reuse", max_new_tokens=4)
    assert "part-" not in str(err.value) and "context window of 256" in str(err.value)
    assert_nothing_stored(engine, docs)


def test_answer_and_teacher_lengths_count_against_the_window(tiny_engine, monkeypatch):
    engine = small_window_engine(tiny_engine)
    docs = DOCS[:2]
    n = engine.layout(QUESTION, docs).n
    room = WINDOW - n
    forbid_model_work(monkeypatch, engine)
    with pytest.raises(ValueError, match=rf"prompt \+ answer is {WINDOW + 1} tokens"):
        engine.generate(QUESTION, docs, max_new_tokens=room + 1)
    with pytest.raises(ValueError, match=rf"prompt \+ answer is {WINDOW + 1} tokens"):
        engine.next_token_logprobs(QUESTION, docs, [7] * (room + 1), strategy="reuse")
    with pytest.raises(ValueError, match=rf"prompt \+ answer is {WINDOW + 1} tokens"):
        engine.generate(QUESTION, docs, max_new_tokens=2, teacher_ids=[7] * (room + 1))
    assert_nothing_stored(engine, docs)
    monkeypatch.undo()
    engine.context_window = WINDOW
    engine.eos_ids = set()
    r = engine.generate(QUESTION, docs, max_new_tokens=room)  # exactly full: accepted
    assert r.prompt_tokens + len(r.token_ids) == WINDOW
    lp = engine.next_token_logprobs(QUESTION, docs, [7] * room, strategy="reuse")
    assert lp.shape[0] == room


def test_precompute_with_one_bad_document_stores_none(tiny_engine, monkeypatch):
    engine = small_window_engine(tiny_engine)
    n = n_tokens(engine, LONG)
    docs = [DOCS[0], DOCS[1], LONG, DOCS[2]]
    forbid_model_work(monkeypatch, engine)
    with pytest.raises(ValueError, match=names("long", n)) as err:
        engine.precompute(docs)
    assert "context window of 256" in str(err.value)
    with pytest.raises(ValueError, match=names("long", n)):
        engine.precompute(docs, strategy="qcfuse")
    assert_nothing_stored(engine, docs)

    other = ("long-2", LONG[1] + " And the weather.")
    with pytest.raises(ValueError, match=names("long", n) + ", " + names("long-2", n_tokens(engine, other))):
        engine.precompute([LONG, DOCS[0], other])  # every offender is named
    assert_nothing_stored(engine, docs)

    monkeypatch.undo()
    engine.context_window = WINDOW
    rep = engine.precompute(DOCS)
    assert (rep.hits, rep.misses) == (0, 3)


def test_precompute_limit_is_prefix_document_shortest_question_and_one_token(tiny_engine):
    engine = tiny_engine("qwen2")
    doc = DOCS[0]
    need = len(engine.prompts.prefix_ids) + n_tokens(engine, doc) + len(engine.prompts.encode_tail("")) + 1
    engine.context_window = need - 1
    with pytest.raises(ValueError, match=names("larkspur", n_tokens(engine, doc))):
        engine.precompute([doc])
    assert engine.cache_stats()["misses"] == 0
    engine.context_window = need
    rep = engine.precompute([doc])
    assert (rep.hits, rep.misses) == (0, 1)


def test_each_document_is_tokenized_once_per_request(tiny_engine, monkeypatch):
    engine = tiny_engine("llama")
    seen = count_tokenizations(monkeypatch, engine)
    engine.precompute(DOCS)
    assert sorted(seen) == sorted(d[0] for d in DOCS)
    for strategy, options in [("reuse", {}), ("full", {}), ("cacheblend", {}), ("infoflow", {"reorder": True})]:
        seen.clear()
        engine.generate(QUESTION, DOCS, strategy=strategy, max_new_tokens=2, **options)
        assert sorted(seen) == sorted(d[0] for d in DOCS), strategy
    seen.clear()
    engine.next_token_logprobs(QUESTION, DOCS, [1, 2], strategy="cacheblend")
    assert len(seen) == len(DOCS)
    seen.clear()
    engine.context_kv(QUESTION, DOCS)
    assert len(seen) == len(DOCS)

