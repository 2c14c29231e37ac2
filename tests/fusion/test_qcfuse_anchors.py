"""qcfuse's offline digest: the `anchors` document profiler (exact attention of sampled rows, sinks kept, ~15%),
stored with the cache once (memory, disk, pooled tier), and the compressed view the probe then uses."""
from __future__ import annotations

import pytest
import torch

from kvfuse.engine.fusion import budget_for, make_strategy
from kvfuse.engine.profile import AnchorProfiler, critical_layers_for
from kvfuse.engine.store import content_key
from kvfuse.engine.types import as_documents

from test_strategies_engine import DOCS, QUESTION

LONG = ("longdoc", " ".join(f"Item {i} of the Larkspur ledger records {i * 7} lanterns and a glass bowl."
                             for i in range(12)))


def _entry(engine, doc):
    d = as_documents([doc])[0]
    ids = engine.prompts.encode_document(d)
    return ids, engine.store.lookup(d.id, content_key(engine.namespace, engine.prompts.prefix_ids, ids))


def test_token_scores_equal_transformers_attention(fusion_engine):
    """The sampled rows recomputed over the stored cache see exactly what a full prefill sees: their head-averaged
    attention (self excluded), summed over rows, matches HF's eager attention of prefix + document."""
    e = fusion_engine("llama")
    e.precompute([LONG])
    ids, kv = _entry(e, LONG)
    prof = AnchorProfiler(stride=3)
    scores = prof.token_scores(e, ids, kv)
    prefix = e.prompts.prefix_ids
    p, n = len(prefix), len(ids)
    hf = e.hf_model
    hf.set_attn_implementation("eager")
    with torch.inference_mode():
        att = hf(torch.tensor([prefix + ids]), output_attentions=True).attentions
    rows = sorted(set(range(0, n, 3)) | {n - 1})
    expect = torch.zeros(n)
    layers = critical_layers_for(e)
    for layer in layers:
        a = att[layer][0].float().mean(0)  # [N, N] head-averaged
        for r in rows:
            row = a[p + r].clone()
            row[p + r] = 0.0
            expect += row[p:p + n]
    expect /= len(layers)
    torch.testing.assert_close(scores, expect, rtol=1e-4, atol=1e-5)


def test_anchors_are_sinks_plus_the_top_share(fusion_engine):
    e = fusion_engine("qwen2")
    e.precompute([LONG])
    ids, kv = _entry(e, LONG)
    prof = AnchorProfiler(ratio=0.15, sinks=4)
    anchors = prof(e, ids, kv)["anchors"]
    n = len(ids)
    assert anchors.dtype == torch.int32
    assert anchors.numel() == 4 + budget_for(0.15, n)
    assert anchors[:4].tolist() == [0, 1, 2, 3]
    assert bool((anchors[1:] > anchors[:-1]).all()) and int(anchors[-1]) < n
    scores = prof.token_scores(e, ids, kv)
    rest = anchors[4:].long()
    others = torch.ones(n, dtype=torch.bool)
    others[anchors.long()] = False
    assert scores[rest].min() >= scores[others].max()  # exactly the top-scored non-sink tokens
    tiny = prof(e, ids[:5], type(kv)(kv.k[:, :5], kv.v[:, :5]))["anchors"]
    assert tiny.tolist() == [0, 1, 2, 3, 4]  # a short document is its own digest


@pytest.mark.parametrize("tier", ["host", "pool"])
def test_anchors_are_computed_once_and_stored_with_the_cache(tier, fusion_engine, tmp_path):
    e = fusion_engine("qwen2", kv_tier=tier, disk_cache_dir=tmp_path / "kv", memory_budget_bytes=64 << 20)
    e.precompute(DOCS)
    assert all("anchors" not in _entry(e, d)[1].extras for d in DOCS)  # plain precompute: no extras
    calls = []
    real = e.doc_profilers["anchors"]
    e.doc_profilers["anchors"] = lambda *a: calls.append(1) or real(*a)
    r = e.generate(QUESTION, DOCS, strategy="qcfuse", recompute_ratio=0.2, max_new_tokens=2)
    assert len(calls) == len(DOCS) and r.miss_prefill_s > 0
    r = e.generate(QUESTION, DOCS, strategy="qcfuse", recompute_ratio=0.2, max_new_tokens=2)
    assert len(calls) == len(DOCS) and r.miss_prefill_s == 0.0 and r.cache_hits == len(DOCS)
    for d in DOCS:
        ids, kv = _entry(e, d)
        assert kv.extras["anchors"].numel() == min(len(ids), 4 + budget_for(0.15, len(ids)))
    # a second engine over the same folder reads the anchors from disk
    e2 = fusion_engine("qwen2", kv_tier=tier, disk_cache_dir=tmp_path / "kv", memory_budget_bytes=64 << 20)
    e2.doc_profilers["anchors"] = lambda *a: pytest.fail("anchors recomputed")
    e2.generate(QUESTION, DOCS, strategy="qcfuse", recompute_ratio=0.2, max_new_tokens=2)
    # precompute(strategy=...) does the offline work ahead of time
    e3 = fusion_engine("qwen2")
    e3.precompute(DOCS, strategy="qcfuse")
    assert all("anchors" in _entry(e3, d)[1].extras for d in DOCS)


def test_probe_runs_over_the_compressed_view(fusion_engine, monkeypatch):
    """The question probe attends to prefix + anchors only (the first document's too, though it is exact and
    never selected): the keys it is given are exactly those."""
    from kvfuse.engine import runner as runner_mod

    e = fusion_engine("qwen2")
    e.precompute([LONG] + DOCS, strategy="qcfuse")
    seen = {}
    real = runner_mod.Runner._layers

    def spy(self, *a, probe_keys=None, **k):
        if k.get("probe_layers"):
            seen["keys"] = probe_keys
        return real(self, *a, probe_keys=probe_keys, **k)

    monkeypatch.setattr(runner_mod.Runner, "_layers", spy)
    docs = as_documents([LONG] + DOCS)
    strat = make_strategy("qcfuse")
    layout, segs, _ = e._prepare(QUESTION, docs, strat)
    e.runner.prefill(layout.ids, segs, strat, 0.2, extra_capacity=0)
    keys = seen["keys"].tolist()
    expect = list(range(layout.prefix.end))
    for sp, d in zip(layout.docs, docs):
        expect += [sp.start + int(i) for i in _entry(e, d)[1].extras["anchors"]]
    expect += list(range(layout.tail.start, layout.tail.end))
    assert keys == expect
    assert len(keys) < layout.n * 0.6
