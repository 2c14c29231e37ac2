"""The drift correction (`drift`, `drift_from`: options of every strategy): from layer round(drift_from x L) on,
each cached document row not recomputed gets `drift` x its document's mean (fresh - cached) K/V over the rows
recomputed at that layer. Checked against a plain reference forward written here from the model's layer seam,
with the engine's own selection; the shared caches are left untouched; bad options are refused before any work."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfuse.engine.fusion import make_strategy
from kvfuse.engine.types import as_documents
from kvfuse.kernels.rope import apply_rope_reference
from kvfuse.training.distill import _answer_rows, document_kv, strategy_selection

from cases import DOCS, QUESTION

ANSWER = [5, 17, 42, 9]


def _reference(engine, layout, answer, chosen, alpha: float, start: int) -> torch.Tensor:
    """log p(answer) teacher-forced when the rows `chosen` are recomputed and the other rows of the non-exact
    documents are drift-corrected from layer `start` on (the first document, right after the prefix, is exact)."""
    dec, s = engine.decoder, engine.decoder.spec
    doc_kv = document_kv(engine, layout, None)
    prefix = engine.doc_cache.prefix_kv()
    a_ids, a_pos = _answer_rows(layout, answer)
    cos, sin = engine.runner.rope(layout.n + len(answer))
    docs = [sp for sp in layout.docs]
    exact = [j == 0 and sp.start == layout.prefix.end for j, sp in enumerate(docs)]
    rec = torch.zeros(layout.n, dtype=torch.bool)
    rec[chosen] = True
    in_doc = torch.zeros(layout.n, dtype=torch.bool)
    in_doc[layout.prefix.start:layout.prefix.end] = True
    for sp in docs:
        in_doc[sp.start:sp.end] = True
    rows = torch.arange(layout.n)[rec | ~in_doc]  # recomputed document rows and the prompt's other computed rows
    pos = torch.cat([rows, a_pos])
    h = dec.embed_tokens(torch.cat([layout.ids[rows], a_ids]))
    for i in range(s.n_layers):
        q, k, v = dec.project(i, h)
        ks, vs, ps = [prefix.k[i]], [prefix.v[i]], [torch.arange(layout.prefix.start, layout.prefix.end)]
        for j, (sp, (dk, dv)) in enumerate(zip(docs, doc_kv)):
            mine = rec[sp.start:sp.end]
            ck, cv = dk[i][~mine], dv[i][~mine]
            if i >= start and not exact[j] and mine.any():
                at = torch.searchsorted(rows, torch.arange(sp.start, sp.end)[mine])
                ck = ck + alpha * (k[at] - dk[i][mine]).mean(0)
                cv = cv + alpha * (v[at] - dv[i][mine]).mean(0)
            ks.append(ck)
            vs.append(cv)
            ps.append(torch.arange(sp.start, sp.end)[~mine])
        kp = torch.cat(ps + [pos])
        k_all, v_all = torch.cat(ks + [k]), torch.cat(vs + [v])
        mask = kp[None, :] <= pos[:, None]
        qr = apply_rope_reference(q, cos[pos], sin[pos]).transpose(0, 1)
        kr = apply_rope_reference(k_all, cos[kp], sin[kp]).transpose(0, 1)
        o = F.scaled_dot_product_attention(qr, kr, v_all.transpose(0, 1), attn_mask=mask, scale=s.scale,
                                           enable_gqa=True)
        h = dec.finish(i, h, o.transpose(0, 1))
    first = int((rows < layout.n - 1).sum())
    return torch.log_softmax(dec.logits(h[first:first + len(answer)]).float(), dim=-1)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("strategy", ["epic", "infoflow"])
def test_drift_matches_a_plain_reference_forward(tiny_engine, family, strategy):
    engine = tiny_engine(family)
    layout = engine.layout(QUESTION, DOCS)
    with torch.no_grad():
        chosen = strategy_selection(engine, layout, document_kv(engine, layout, None), strategy, 0.3,
                                    exact_first=True)
    assert chosen is not None and chosen.numel() > 0
    start = round(0.5 * engine.decoder.spec.n_layers)
    served = engine.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy=f"{strategy}:drift=0.7:drift_from=0.5",
                                        recompute_ratio=0.3)
    plain = engine.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy=strategy, recompute_ratio=0.3)
    with torch.no_grad():
        ref = _reference(engine, layout, ANSWER, chosen, 0.7, start)
        ref_off = _reference(engine, layout, ANSWER, chosen, 0.0, start)
    torch.testing.assert_close(ref_off, plain, atol=2e-4, rtol=0)  # the reference without drift is the engine's path
    torch.testing.assert_close(served, ref, atol=2e-4, rtol=0)
    assert (served - plain).abs().max() > 1e-3  # the correction really acts: the comparison above can fail
    with torch.no_grad():  # and a wrong weight or first layer does not match
        assert (served - _reference(engine, layout, ANSWER, chosen, 0.35, start)).abs().max() > 1e-4
        assert (served - _reference(engine, layout, ANSWER, chosen, 0.7, start - 2)).abs().max() > 1e-4


def test_drift_leaves_the_shared_caches_as_they_were(tiny_engine):
    engine = tiny_engine("llama")
    before = engine.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="cacheblend", recompute_ratio=0.3)
    docs = as_documents(DOCS)
    kvs, computed = engine.doc_cache.kvs(docs)
    assert computed == 0  # the request above stored them
    saved = [(kv.k.clone(), kv.v.clone()) for _, kv in kvs]
    engine.generate(QUESTION, DOCS, strategy="cacheblend:drift=1", recompute_ratio=0.3, max_new_tokens=4)
    for (_, kv), (k, v) in zip(engine.doc_cache.kvs(docs)[0], saved):
        assert torch.equal(kv.k, k) and torch.equal(kv.v, v)
    after = engine.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="cacheblend", recompute_ratio=0.3)
    assert torch.equal(before, after)


def test_drift_is_part_of_the_signature_and_off_by_default():
    plain, on = make_strategy("infoflow"), make_strategy("infoflow:drift=0.5")
    assert plain.drift == 0.0 and "drift" not in vars(plain)
    assert on.drift == 0.5 and on.drift_from == 0.25
    assert make_strategy("infoflow", drift=0.5, drift_from=0.5).drift_from == 0.5
    from kvfuse.engine.fusion.base import signature
    assert signature(plain) != signature(on) != signature(make_strategy("infoflow:drift=0.5:drift_from=0.5"))


@pytest.mark.parametrize("spec", ["infoflow:drift=1.5", "infoflow:drift=-0.1", "infoflow:drift=abc",
                                  "infoflow:drift=0.5:drift_from=1", "cacheblend:drift_from=-1",
                                  "epic:drift=true"])
def test_bad_drift_options_are_refused_before_any_work(tiny_engine, spec):
    with pytest.raises(ValueError, match="drift"):
        make_strategy(spec)
    engine = tiny_engine("llama")
    with pytest.raises(ValueError, match="drift"):
        engine.generate(QUESTION, DOCS, strategy=spec, max_new_tokens=2)
    assert engine.doc_cache.stats().get("misses", 0) == 0  # nothing was looked up or computed
