"""Requests given as token ids (`question_ids=`, `Document(id, token_ids=...)`): the same request as its text, and
bad ids rejected before any work."""
from __future__ import annotations

import pytest
import torch
from cases import DOCS, QUESTION
from test_options import same_result

from kvfuse.engine.options import GenerationOptions
from kvfuse.engine.types import Document, as_documents


def as_ids(engine, docs):
    """The documents as token ids: exactly their tokenization as text documents (suffix included)."""
    return [Document(d.id, title=d.title, token_ids=engine.prompts.encode_document(d)) for d in docs]


@pytest.mark.parametrize("strategy", ["cacheblend", "infoflow", "full"])
def test_ids_request_equals_text_request(tiny_engine, strategy):
    texts = as_documents(DOCS)
    texts[1] = Document(texts[1].id, texts[1].text, title="Festivals")  # a title stays text (computed glue)
    by_text, by_ids = tiny_engine("qwen2"), tiny_engine("qwen2")  # cold, each
    ids = as_ids(by_text, texts)
    q_ids = by_text.prompts.encode_tail(QUESTION)
    opts = GenerationOptions(strategy=strategy, max_new_tokens=6, teacher_ids=[3, 4], return_logprobs=True)
    assert by_ids.precompute(ids[:2]).misses == by_text.precompute(texts[:2]).misses == 2
    a = by_text.generate(QUESTION, texts, opts)
    b = by_ids.generate(question_ids=q_ids, docs=ids, options=opts)
    same_result(a, b)
    assert (b.cache_hits, b.cache_misses) == ((0, 0) if strategy == "full" else (2, 1))
    assert by_text.layout(QUESTION, texts).ids.tolist() == by_ids.layout(question_ids=q_ids, docs=ids).ids.tolist()
    warm = by_text.generate(QUESTION, texts, opts)  # every document cached now, on both engines
    s = by_ids.stream(question_ids=torch.tensor(q_ids), docs=ids, options=opts)  # a tensor of ids too
    assert "".join(s) == a.text
    same_result(s.result, warm)
    # text and ids mixed in one request
    mixed = [ids[0], texts[1], ids[2]]
    same_result(by_ids.generate(QUESTION, mixed, opts), warm)


def test_ids_and_text_share_one_cache(tiny_engine):
    engine = tiny_engine("llama")
    texts = as_documents(DOCS)
    assert engine.precompute(texts).misses == 3
    ids = as_ids(engine, texts)
    rep = engine.precompute(ids)
    assert (rep.hits, rep.misses, rep.tokens) == (3, 0, 0)  # the cache key is the tokens, however given
    r = engine.generate(question_ids=engine.prompts.encode_tail(QUESTION), docs=ids, strategy="reuse",
                        max_new_tokens=2)
    assert (r.cache_hits, r.cache_misses) == (3, 0)


def test_id_documents_are_not_tokenized(tiny_engine):
    engine = tiny_engine("llama")
    ids = as_ids(engine, as_documents(DOCS))
    q_ids = engine.prompts.encode_tail(QUESTION)
    seen = []
    inner = engine.prompts._encode  # the prompt builder's one call of the tokenizer
    engine.prompts._encode = lambda text: seen.append(text) or inner(text)
    engine.precompute(ids)
    engine.generate(question_ids=q_ids, docs=ids, strategy="cacheblend", max_new_tokens=2)
    engine.layout(question_ids=q_ids, docs=ids)
    assert seen == []


def test_document_token_ids_are_checked():
    d = Document("a", token_ids=torch.tensor([5, 6]))
    assert d.token_ids == (5, 6) and d.text == "" and hash(d) == hash(Document("a", token_ids=[5, 6]))
    assert as_documents([{"id": "b", "token_ids": [1, 2]}])[0] == Document("b", token_ids=(1, 2))
    for bad, match in [([], "document 'a': token_ids is empty"),
                       ([1, -2], r"document 'a': token_ids\[1\] must be a token id"),
                       ([1, 2.0], r"document 'a': token_ids\[1\] must be a token id"),
                       ([True], r"document 'a': token_ids\[0\] must be a token id"),
                       ("12", "document 'a': token_ids must be a list of token ids"),
                       (torch.tensor([1.0]), "must hold integers")]:
        with pytest.raises(ValueError, match=match):
            Document("a", token_ids=bad)
    with pytest.raises(ValueError, match="give its text or its token_ids, not both"):
        Document("a", "text", token_ids=[1])
    with pytest.raises(ValueError, match="document 'a': text is empty"):
        Document("a")


def test_bad_ids_are_one_value_error_before_any_work(tiny_engine):
    engine = tiny_engine("llama")
    vocab = engine.decoder.spec.vocab
    q_ids = engine.prompts.encode_tail(QUESTION)
    good = [Document("g", token_ids=[10, 11, 12])]
    calls = []
    for name in ("prefill", "extend"):
        setattr(engine.runner, name, lambda *a, _n=name, **k: calls.append(_n))
    for name in ("lookup", "put"):
        setattr(engine.store, name, lambda *a, _n=name, **k: calls.append(_n))
    cases = [
        (dict(question_ids=[1, vocab]), rf"question_ids\[1\] must be a token id, an int in \[0, {vocab}\)"),
        (dict(question_ids=[-1]), r"question_ids\[0\] must be a token id"),
        (dict(question_ids=[1, 2.5]), r"question_ids\[1\] must be a token id"),
        (dict(question_ids=[]), "question_ids is empty"),
        (dict(question_ids="hi"), "question_ids must be a list of token ids"),
        (dict(question_ids=[1], question=QUESTION), "not both"),
        (dict(), "give a question"),
        (dict(question_ids=q_ids, docs=[Document("x", token_ids=[1, vocab + 5])]),
         rf"document 'x': token_ids\[1\] must be a token id, an int in \[0, {vocab}\)"),
    ]
    for kwargs, match in cases:
        kwargs.setdefault("docs", good)
        for call in (engine.generate, engine.stream, engine.layout):
            with pytest.raises(ValueError, match=match):
                call(**kwargs)
    big = [Document("x", token_ids=[vocab])]
    with pytest.raises(ValueError, match=r"document 'x': token_ids\[0\] must be a token id"):
        engine.precompute(big)
    with pytest.raises(ValueError, match="is given as token ids"):
        engine.chat(QUESTION, good)
    with pytest.raises(ValueError, match="too long for any prompt"):
        engine.precompute([Document("long", token_ids=[7] * engine.context_window)])
    assert calls == [] and engine.cache_stats()["memory_entries"] == 0


def test_document_texts_are_tokenized_once_and_a_changed_text_again(tiny_engine):
    """Recurring document texts are not tokenized again on every request (their ids are memoised by the text
    itself); a changed text is tokenized anew, and the answer equals a cold engine's."""
    engine = tiny_engine("llama")
    seen = []
    encode = engine.prompts._encode
    engine.prompts._encode = lambda text: seen.append(text) or encode(text)
    docs = as_documents(DOCS)
    first = engine.generate(QUESTION, docs, strategy="cacheblend", max_new_tokens=4)
    n = len(seen)
    assert sum(d.text in t for d in docs for t in seen) == len(docs)
    again = engine.generate(QUESTION, docs, strategy="cacheblend", max_new_tokens=4)
    assert again.token_ids == first.token_ids
    assert not any(d.text in t for d in docs for t in seen[n:])  # only the question's tail was tokenized
    changed = [Document(docs[0].id, docs[0].text + " It rained."), *docs[1:]]
    third = engine.generate(QUESTION, changed, strategy="cacheblend", max_new_tokens=4)
    assert sum(changed[0].text in t for t in seen[n:]) == 1
    cold = tiny_engine("llama").generate(QUESTION, changed, strategy="cacheblend", max_new_tokens=4)
    assert third.token_ids == cold.token_ids
