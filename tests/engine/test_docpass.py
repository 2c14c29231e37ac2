"""Documents computed together in one pass (engine/docpass.py) give each document the cache it gets prefilled
alone after the prefix: same rows, same positions, no document seeing another."""
from __future__ import annotations

import pytest
import torch
from cases import DOCS, FAMILIES, QUESTION

from kvfuse.engine.docpass import documents_pass, pack
from kvfuse.engine.fusion.reuse import Reuse
from kvfuse.engine.types import Document


def _alone(engine, ids):
    """The per-document prefill (the runner's own path): the reference a pass must reproduce."""
    dc = engine.doc_cache
    full, segs = dc.after_prefix([(ids, None)])
    n = int(full.numel())
    return dc.doc_runner.prefill(full, segs, Reuse(), 0.0, capture=(n - len(ids), n), want_logits=False).captured


def _seam(engine):
    """(decoder, rope tables, prefix cache): what a documents pass computes with, as the engine calls it."""
    dc = engine.doc_cache
    return dc.doc_runner.dec, dc.doc_runner.rope, dc.prefix_kv()


def _docs(engine, n_extra=0):
    texts = [t for _, t in DOCS] + ["Short.", "A" * 3, "The river Dunmore floods every spring; " * 6][:n_extra]
    return [engine.prompts.encode_document(Document(f"d{i}", t)) for i, t in enumerate(texts)]


@pytest.mark.parametrize("batched", [True, False], ids=["padded", "per-document"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_pass_gives_each_document_its_own_prefill(tiny_engine, family, batched):
    engine = tiny_engine(family)
    ids = _docs(engine, n_extra=3)  # lengths from 1-2 tokens to ~60: padding inside the pass
    assert len({len(x) for x in ids}) > 3
    got = documents_pass(*_seam(engine), ids, batched=batched)
    for x, kv in zip(ids, got, strict=True):
        ref = _alone(engine, x)
        assert kv.k.shape == ref.k.shape == (engine.decoder.spec.n_layers, len(x), *ref.k.shape[2:])
        torch.testing.assert_close(kv.k, ref.k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv.v, ref.v, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batched", [True, False], ids=["padded", "per-document"])
def test_no_document_sees_another_and_passes_split_anywhere(tiny_engine, batched):
    """A document's cache does not move with its pass-mates (the tolerance is far below what one more document in
    its context moves it), nor with how the documents are split into passes."""
    engine = tiny_engine("llama3")
    dc = engine.doc_cache
    ids = _docs(engine, n_extra=3)
    one = documents_pass(*_seam(engine), ids, batched=batched)
    split = documents_pass(*_seam(engine), ids, max_tokens=20, batched=batched)  # a long one alone
    mates = documents_pass(*_seam(engine), [ids[1], ids[4], ids[0]], batched=batched)
    for a, b in zip(one, split, strict=True):
        torch.testing.assert_close(a.k, b.k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mates[2].k, one[0].k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mates[0].v, one[1].v, rtol=1e-4, atol=1e-4)
    # what seeing another document looks like: document 2 computed after document 0 (fusionrag's context path)
    seen = dc.compute(ids[2], context=[(ids[0], None)])
    assert (seen.k[1:] - one[2].k[1:]).abs().max() > 100 * (split[2].k - one[2].k).abs().max().clamp_min(1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_with_a_chunk_a_cache_is_the_same_bits_whatever_its_pass_mates(tiny_engine, family, dtype):
    """Every GEMM at one shape (`chunk` rows) and attention per document: a document's cache is bit-identical alone,
    in a pass with others, at another place in it and split across chunks; without the chunk it is not (the check
    can fail: a whole-pass GEMM over another row count rounds differently)."""
    engine = tiny_engine(family)
    dec, rope, prefix = _seam(engine)
    dec = _cast(dec, dtype)
    prefix = type(prefix)(prefix.k.to(dtype), prefix.v.to(dtype))
    ids = _docs(engine, n_extra=3)
    kw = dict(batched=False, chunk=16)
    alone = [documents_pass(dec, rope, prefix, [x], **kw)[0] for x in ids]
    together = documents_pass(dec, rope, prefix, ids, **kw)
    reordered = documents_pass(dec, rope, prefix, ids[::-1], max_tokens=25, **kw)[::-1]
    for a, b, c in zip(alone, together, reordered, strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        assert torch.equal(a.k, c.k) and torch.equal(a.v, c.v)
    # the same documents, one GEMM per pass: some cache moves with its pass-mates (so the equalities above can fail;
    # the tiny model's bf16 GEMMs happen to round alike at these row counts, its fp32 ones do not)
    if dtype == torch.float32:
        loose_alone = [documents_pass(dec, rope, prefix, [x], batched=False)[0] for x in ids]
        loose = documents_pass(dec, rope, prefix, ids, batched=False)
        assert any(not torch.equal(a.k, b.k) for a, b in zip(loose_alone, loose, strict=True))
    # and the chunked caches are the per-document prefill's to rounding
    for a, x in zip(alone, ids, strict=True):
        ref = _alone(engine, x)
        torch.testing.assert_close(a.k.float(), ref.k.float(), rtol=0.05 if dtype == torch.bfloat16 else 1e-4,
                                   atol=0.05 if dtype == torch.bfloat16 else 1e-4)


def _cast(dec, dtype):
    """A copy of the tiny decoder with its floating weights in `dtype` (bf16 GEMMs round per row count too)."""
    import copy

    if dtype == torch.float32:
        return dec
    out = copy.copy(dec)
    out.layers = []
    for layer in dec.layers:
        new = copy.copy(layer)
        for name, val in vars(layer).items():
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                setattr(new, name, val.to(dtype))
        out.layers.append(new)
    for name, val in vars(dec).items():
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            setattr(out, name, val.to(dtype))
    return out


def test_pack_keeps_passes_within_their_rows():
    assert pack([3, 4, 5, 9, 2], 9) == [[0, 1], [2], [3], [4]]
    assert pack([12, 1, 1], 9) == [[0], [1, 2]]  # longer than a pass: alone
    assert pack([], 9) == []
    with pytest.raises(ValueError, match="max_tokens"):
        pack([1], 0)


def test_an_empty_document_is_refused(tiny_engine):
    engine = tiny_engine("llama")
    with pytest.raises(ValueError, match="at least one token"):
        documents_pass(*_seam(engine), [[1, 2], []])


def test_a_cold_request_computes_its_documents_in_one_pass(tiny_engine, monkeypatch):
    """Every missing document of a request goes through one documents pass (a repeated one computed once), and the
    answer is the one-document-per-pass engine's."""
    from kvfuse.engine import doccache

    passes = []
    real = doccache.documents_pass
    monkeypatch.setattr(doccache, "documents_pass",
                        lambda d, r, p, docs, **k: passes.append(len(docs)) or real(d, r, p, docs, **k))
    batched = tiny_engine("qwen2", document_pass_tokens=8192)
    docs = [*DOCS, DOCS[0]]
    a = batched.generate(QUESTION, docs, strategy="cacheblend", recompute_ratio=0.3, max_new_tokens=6)
    assert passes == [3] and a.cache_misses == 3 and a.cache_hits == 1
    passes.clear()
    alone = tiny_engine("qwen2", document_pass_tokens=0)
    b = alone.generate(QUESTION, docs, strategy="cacheblend", recompute_ratio=0.3, max_new_tokens=6)
    assert passes == [3] and a.token_ids == b.token_ids  # one call, each document its own pass inside it
    warm = batched.generate(QUESTION, docs, strategy="cacheblend", recompute_ratio=0.3, max_new_tokens=6)
    assert warm.cache_hits == 4 and warm.token_ids == a.token_ids and passes == [3]
    rep = tiny_engine("qwen2", document_pass_tokens=8192).precompute([*DOCS, ("extra", "Dunmore lies on the river.")])
    assert (rep.misses, rep.hits) == (4, 0) and passes[-1] == 4


def test_document_pass_tokens_is_checked():
    from kvfuse.engine.config import EngineConfig

    for bad in (-1, 1.5, True, "8k"):
        with pytest.raises(ValueError, match="document_pass_tokens"):
            EngineConfig(document_pass_tokens=bad)
        with pytest.raises(ValueError, match="document_chunk_rows"):
            EngineConfig(document_chunk_rows=bad)


def test_the_cpu_default_packs_and_a_cache_never_depends_on_its_pass_mates(tiny_engine):
    """document_pass_tokens=8192 (the default) on the CPU: the request's documents in one pass, GEMMs in chunks of
    one shape, so each cache is bit for bit what the engine computes for that document alone, one per pass or
    packed (the reliability suite's exact cold-vs-warm comparisons rest on it), and the per-document prefill's to
    rounding."""
    from kvfuse.engine.doccache import DOCUMENT_CHUNK_ROWS

    engine = tiny_engine("qwen3")
    assert engine.doc_cache.pass_settings() == (8192, DOCUMENT_CHUNK_ROWS)
    ids = _docs(engine, n_extra=3)
    together = engine.doc_cache.compute_many(ids)
    one_each = tiny_engine("qwen3", document_pass_tokens=0).doc_cache.compute_many(ids)
    unchunked = tiny_engine("qwen3", document_chunk_rows=0)
    loose = [unchunked.doc_cache.compute_many([x])[0] for x in ids]
    assert any(not torch.equal(a.k, b.k) for a, b in zip(loose, unchunked.doc_cache.compute_many(ids), strict=True))
    for x, kv, solo in zip(ids, together, one_each, strict=True):
        alone = engine.doc_cache.compute_many([x])[0]
        assert torch.equal(kv.k, alone.k) and torch.equal(kv.v, alone.v)
        assert torch.equal(kv.k, solo.k) and torch.equal(kv.v, solo.v)
        ref = _alone(engine, x)
        torch.testing.assert_close(kv.k, ref.k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv.v, ref.v, rtol=1e-4, atol=1e-4)