"""coinrag: sentences cut at sentence ends, nuggets kept by question-attention density up to `keep`, their cache rows
sliced and re-positioned exactly (checked against an independent differentiable forward), keep=1 at ratio 1 is full
prefill, and the prompt really gets shorter."""
from __future__ import annotations

import torch

from kvfuse.engine.fusion.coinrag import CoinRAG, sentence_spans
from kvfuse.training.distill import document_kv, student_logprobs

from cases import DOCS, QUESTION


def test_sentence_spans_cut_at_ends_and_join_short_ones():
    texts = ["The", " cat", " sat", " on", " a", " mat", ".", " It", " slept", ".", " Then", " the", " dog",
             " came", " home", " late", "\n", "ok"]
    assert sentence_spans(texts, min_tokens=3) == [(0, 7), (7, 10), (10, 18)]  # "ok" (1 token) joins the last
    assert sentence_spans(texts, min_tokens=1) == [(0, 7), (7, 10), (10, 17), (17, 18)]
    assert sentence_spans(texts, min_tokens=8) == [(0, 10), (10, 18)]
    assert sentence_spans([], 3) == []


class _LastSentences(CoinRAG):
    """Keeps each document's last sentence: a nugget choice the test knows (and one whose rows depend on the
    sentences before it, which are dropped)."""

    def nuggets(self, ctx, sentences):
        return [torch.arange(*spans[-1]) for spans in sentences]


def test_nuggets_are_sliced_and_repositioned_exactly(tiny_engine):
    engine = tiny_engine("llama")
    answer = [5, 17, 42]
    strat = _LastSentences(min_sentence_tokens=4)
    got = engine.next_token_logprobs(QUESTION, DOCS, answer, strategy=strat, recompute_ratio=0.0)

    full_layout = engine.layout(QUESTION, DOCS)
    texts = [engine._token_texts(ids.tolist()) for ids in full_layout.doc_ids]
    rows = [torch.arange(*sentence_spans(t, 4)[-1]) for t in texts]
    assert all(0 < len(r) <= len(ids) for r, ids in zip(rows, full_layout.doc_ids))
    assert any(len(r) < len(ids) for r, ids in zip(rows, full_layout.doc_ids))  # really cut
    layout = engine.prompts.build(QUESTION, [ids[r].tolist() for ids, r in zip(full_layout.doc_ids, rows)],
                                  [engine.prompts.encode_title(d) for d in engine._documents(DOCS)])
    with torch.no_grad():
        whole = document_kv(engine, full_layout, None)  # each chunk computed whole, then its rows sliced
        sliced = [([k[r] for k in ks], [v[r] for v in vs]) for (ks, vs), r in zip(whole, rows)]
        want = student_logprobs(engine, layout, answer + [0], None, doc_kv=sliced)[:len(answer)]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    # slicing the cache is not computing the cut documents alone: the test can tell them apart
    with torch.no_grad():
        alone = student_logprobs(engine, layout, answer + [0], None)[:len(answer)]
    assert (alone - want).abs().max() > 1e-3


def test_keep_everything_at_full_ratio_is_full_prefill(tiny_engine):
    engine = tiny_engine("llama")
    full = engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=8)
    coin = engine.generate(QUESTION, DOCS, strategy="coinrag", keep=1.0, recompute_ratio=1.0, max_new_tokens=8)
    assert coin.token_ids == full.token_ids and coin.prompt_tokens == full.prompt_tokens


def test_the_prompt_gets_shorter_and_keeps_whole_sentences(tiny_engine):
    engine = tiny_engine("llama")
    base = engine.generate(QUESTION, DOCS, strategy="infoflow", recompute_ratio=0.15, max_new_tokens=4)
    coin = engine.generate(QUESTION, DOCS, strategy="coinrag", keep=0.5, recompute_ratio=0.15, max_new_tokens=4)
    assert coin.doc_tokens < base.doc_tokens and coin.prompt_tokens < base.prompt_tokens
    assert coin.doc_tokens >= 0.5 * base.doc_tokens  # whole sentences, up to the first past `keep`
    assert 0 < coin.recomputed_tokens <= round(0.15 * coin.doc_tokens) + 1
