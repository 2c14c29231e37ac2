"""FusionEngine.context_kv: the cached K/V beside full prefill's in-context K/V of the same rows."""
from __future__ import annotations

import pytest
import torch
from cases import DOCS, QUESTION


def test_first_document_and_layer_zero_match_full_prefill_later_documents_do_not(tiny_engine):
    engine = tiny_engine("qwen2")
    ckv = engine.context_kv(QUESTION, DOCS)
    spans = ckv.layout.docs
    n_rows = spans[-1].end - spans[0].start
    n_layers = engine.decoder.spec.n_layers
    assert ckv.cached_k.shape == ckv.context_k.shape == ckv.cached_v.shape == ckv.context_v.shape
    assert ckv.cached_k.shape[:2] == (n_layers, n_rows) and ckv.start == spans[0].start
    first = slice(0, len(spans[0]))
    # the first document sees exactly the prefix either way: its cache is what full prefill computes
    torch.testing.assert_close(ckv.cached_k[:, first], ckv.context_k[:, first], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ckv.cached_v[:, first], ckv.context_v[:, first], rtol=1e-4, atol=1e-5)
    # layer 0's K/V depend only on the token itself (pre-RoPE): no context effect anywhere
    dev = ckv.relative_deviation()
    assert dev.shape == (n_layers, n_rows)
    assert float(dev[0].abs().max()) < 1e-4
    # later documents attended to fewer tokens alone than in the prompt: they deviate from layer 1 on
    later = dev[1:, len(spans[0]):]
    assert bool((later.mean(1) > 1e-3).all()), later.mean(1)
    assert float(dev[1:, first].abs().max()) < 1e-4
    assert ckv.token_deviation().shape == (n_rows,) and ckv.layer_deviation().shape == (n_layers,)
    assert float(ckv.value_deviation()[:, first].max()) < 1e-4


def test_order_matters_the_same_document_deviates_only_when_it_comes_second(tiny_engine):
    engine = tiny_engine("llama")
    a, b = DOCS[0], DOCS[2]
    first = engine.context_kv(QUESTION, [b, a]).token_deviation()
    n_b = len(engine.layout(QUESTION, [b, a]).docs[0])
    assert float(first[:n_b].max()) < 1e-3 < float(first[n_b:].mean())
    swapped = engine.context_kv(QUESTION, [a, b]).token_deviation()
    n_a = len(engine.layout(QUESTION, [a, b]).docs[0])
    assert float(swapped[:n_a].max()) < 1e-3 < float(swapped[n_a:].mean())


def test_needs_documents(tiny_engine):
    with pytest.raises(ValueError, match="at least one document"):
        tiny_engine("qwen2").context_kv(QUESTION, [])
