"""The query-aware strategies end to end on tiny random models (fp32):

- ratio 1.0 equals `full` (every document token recomputed from layer 0), ratio 0 equals `reuse` (fusionrag:
  `reuse` over its own variant caches, which differ from the plain ones);
- the recomputed count is exactly the budget, also with documents cached and not, and a repeated document;
- a document segment the runner computes itself (no cache) is handled;
- infoflow's reorder re-lays the prompt out in the order the strategy asks for.
"""
from __future__ import annotations

import pytest
import torch

from kvfuse.engine.corpus import Corpus
from kvfuse.engine.fusion import budget_for, make_strategy
from kvfuse.engine.fusion.infoflow import InfoFlow
from kvfuse.engine.runner import Segment
from kvfuse.engine.types import as_documents

from cases import DOCS, QUESTION
from fixtures import word_embedder

CORPUS_EXTRA = [
    ("c1", "The observatory on Mount Helder hosted the astronomer Amelia Voss for forty years."),
    ("c2", "Dunmore is a river town known for its harbour and glassblowers."),
    ("c3", "Tomas Reyes founded a lantern festival and taught glassblowing in 1923."),
    ("c4", "Carvel university taught mathematics to many astronomers in the 1870s."),
]
STRATEGIES = ["infoflow", "prophetkv", "qcfuse", "fusionrag"]


def _engine(fusion_engine, family="qwen2", **config):
    e = fusion_engine(family, **config)
    e.corpus = Corpus(word_embedder()).add(DOCS + CORPUS_EXTRA)
    return e


def _prefill(engine, strategy, ratio, docs=DOCS, segs_hook=None, **opts):
    strat = make_strategy(strategy, **opts)
    docs = as_documents(docs)
    layout, segs, _ = engine._prepare(QUESTION, docs, strat)
    layout, segs, _, run, _ = engine._reorder(QUESTION, docs, strat, ratio, layout, segs)
    if segs_hook:
        segs = segs_hook(segs)
    return layout, engine.runner.prefill(layout.ids, segs, run, ratio, extra_capacity=0)


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ratio_one_equals_full(family, strategy, fusion_engine):
    e = _engine(fusion_engine, family)
    layout, ref = _prefill(e, "full", 1.0)
    _, out = _prefill(e, strategy, 1.0)
    first = layout.docs[0]  # exact (cached right after the same prefix): never recomputed (fusionrag serves it
    assert out.recomputed.numel() == layout.doc_tokens - (first.end - first.start)  # its plain cache too)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ratio_zero_equals_reuse(strategy, fusion_engine):
    e = _engine(fusion_engine)
    _, ref = _prefill(e, "reuse", 0.0)
    _, out = _prefill(e, strategy, 0.0)
    assert out.recomputed.numel() == 0
    if strategy != "fusionrag":
        torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-5)
        return
    # fusionrag reads its variant caches: at ratio 0 it is `reuse` over those, and they are not the plain ones
    strat = make_strategy("fusionrag")
    layout, segs, _ = e._prepare(QUESTION, as_documents(DOCS), strat)
    reuse_on_variant = e.runner.prefill(layout.ids, segs, make_strategy("reuse"), 0.0, extra_capacity=0)
    torch.testing.assert_close(out.logits, reuse_on_variant.logits, rtol=0, atol=1e-5)
    assert (out.logits - ref.logits).abs().max().item() > 1e-3


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_budget_with_cached_uncached_and_repeated_documents(strategy, fusion_engine):
    e = _engine(fusion_engine)
    e.precompute(DOCS[:1])  # one document cached ahead, the others miss; the first one repeats
    docs = [DOCS[1], DOCS[0], DOCS[2], DOCS[0]]
    r = e.generate(QUESTION, docs, strategy=strategy, recompute_ratio=0.3, max_new_tokens=3)
    assert r.recomputed_tokens == budget_for(0.3, r.doc_tokens)
    assert r.selection_s > 0.0
    if strategy != "fusionrag":  # fusionrag reads variant entries for all but the first document
        assert r.cache_hits == 2 and r.cache_misses == 2
    _, ref = _prefill(e, "full", 1.0, docs=docs)
    _, one = _prefill(e, strategy, 1.0, docs=docs)
    torch.testing.assert_close(one.logits, ref.logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy", ["infoflow", "prophetkv", "qcfuse"])
def test_a_document_without_cache_is_computed_and_not_counted(strategy, fusion_engine):
    e = _engine(fusion_engine)

    def drop_middle(segs):  # prefix, doc 0, doc 1, doc 2, tail: doc 1 computed by the runner
        segs = list(segs)
        s = segs[2]
        segs[2] = Segment(s.start, s.end, None)
        return segs

    layout, out = _prefill(e, strategy, 0.3, segs_hook=drop_middle)
    cached = layout.doc_tokens - len(layout.docs[1])
    assert out.recomputed.numel() == budget_for(0.3, cached)
    mid = layout.docs[1]
    assert not bool(((out.recomputed >= mid.start) & (out.recomputed < mid.end)).any())
    _, ref = _prefill(e, "full", 1.0)
    _, one = _prefill(e, strategy, 1.0, segs_hook=drop_middle)
    torch.testing.assert_close(one.logits, ref.logits, rtol=0, atol=1e-5)


class _Reverse(InfoFlow):
    """InfoFlow with a fixed reorder (reverse), to check the engine honours `document_order`."""

    name = "infoflow-reverse-test"

    def __init__(self):
        super().__init__(reorder=True)

    def document_order(self, ctx, chosen):
        return list(range(len(ctx.doc_spans)))[::-1]


def test_engine_relays_documents_in_the_strategy_order(fusion_engine):
    e = _engine(fusion_engine)
    rev = _Reverse()
    layout, out = _prefill(e, rev, 1.0)
    ref_layout, ref = _prefill(e, "full", 1.0, docs=DOCS[::-1])
    assert torch.equal(layout.ids, ref_layout.ids)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-5)
    r = e.generate(QUESTION, DOCS, strategy=rev, recompute_ratio=0.2, max_new_tokens=2)
    assert r.recomputed_tokens == budget_for(0.2, r.doc_tokens)


def test_infoflow_reorder_puts_the_most_selected_documents_last(fusion_engine):
    from kvfuse.engine.profile import reorder_documents, select_only

    e = _engine(fusion_engine)
    s = make_strategy("infoflow", reorder=True)
    docs = as_documents(DOCS)
    layout, segs, _ = e._prepare(QUESTION, docs, s)
    ctx, chosen = select_only(e.runner, layout.ids, segs, s, 0.3)
    counts = [int(((chosen >= sp.start) & (chosen < sp.end)).sum()) for sp in layout.docs]
    ordered = reorder_documents(e.runner, layout, segs, docs, s, 0.3)
    assert sorted(d.id for d in ordered) == sorted(d.id for d in docs)
    got = [counts[[d.id for d in docs].index(d.id)] for d in ordered]
    assert got == sorted(got)
    r = e.generate(QUESTION, DOCS, strategy="infoflow", reorder=True, recompute_ratio=0.3, max_new_tokens=2)
    assert r.recomputed_tokens == budget_for(0.3, r.doc_tokens)


@pytest.mark.parametrize("question", [QUESTION, "Who?"])
def test_the_probe_reads_the_questions_own_rows(fusion_engine, question):
    """The tail's question rows are marked (the template before and after, the assistant header are not); the
    probe hands infoflow exactly those rows, and a question given as token ids is marked the same way."""
    from kvfuse.engine.fusion.select import select_only

    e = _engine(fusion_engine)
    strat = make_strategy("infoflow", rows="question")
    docs = as_documents(DOCS)
    layout, segs, _ = e._prepare(question, docs, strat)
    own = [sg for sg in segs if sg.question]
    assert len(own) == 1 and layout.tail.start < own[0].start and own[0].end < layout.tail.end
    text = e.tokenizer.decode(layout.ids[own[0].start:own[0].end].tolist())
    assert text.strip() == question.strip()
    ctx, _ = select_only(e.runner, layout.ids, segs, strat, 0.2)
    marked = ctx.question[ctx.probe_rows.to(ctx.question.device)].cpu()
    assert torch.equal(marked, torch.arange(own[0].start, own[0].end))
    ids_layout, ids_segs, _ = e._prepare(e.prompts.encode_tail(question), docs, strat)
    assert [(s.start, s.end) for s in ids_segs if s.question] == [(own[0].start, own[0].end)]
