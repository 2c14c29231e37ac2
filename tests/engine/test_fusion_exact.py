"""End-to-end exactness of the engine on tiny random models of every family (fp32) and on SmolLM2.

- `full` reproduces Hugging Face transformers' next-token logits.
- ratio 1.0 of any ratio-driven strategy equals `full`.
- `reuse` equals an independent computation: HF prefills each document alone after the prefix, its post-RoPE
  keys are moved by delta-rotation (float64 math written here), concatenated into an HF cache, and HF runs the
  question over it.
- re-positioning is exact: layer-0 keys of moved documents equal HF's keys computed at the target positions.
- recomputed rows attend causally by absolute position (fails with a bottom-right-aligned mask).
- greedy decoding is deterministic.
"""
from __future__ import annotations

import pytest
import torch

from kvfuse.engine import runner as runner_mod
from kvfuse.engine.api import FusionEngine
from kvfuse.engine.fusion import make_strategy

from cases import DOCS, FAMILIES, QUESTION


def _prefill_logits(engine: FusionEngine, question, docs, strategy, ratio=0.15, **opts):
    strat = make_strategy(strategy, **opts)
    from kvfuse.engine.types import as_documents

    layout, segs, _ = engine._prepare(question, as_documents(docs), strat)
    out = engine.runner.prefill(layout.ids, segs, strat, ratio, extra_capacity=0)
    out.seq = _open(engine, out, layout.n)  # the prompt's K/V written into the decode arena
    return layout, out


def _open(engine, out, n):
    return engine.decoding.open(out.pending, engine.decoding.arena.alloc(n), 0)


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf(ids[None]).logits[0, -1].float()


def _assert_close(a, b, tol=2e-4):
    err = (a - b).abs().max().item()
    scale = b.abs().max().item()
    assert err <= tol * max(1.0, scale), f"max |diff| {err:.3e} (scale {scale:.2f})"


@pytest.mark.parametrize("family", FAMILIES)
def test_full_matches_transformers(family, tiny_engine):
    engine = tiny_engine(family)
    layout, out = _prefill_logits(engine, QUESTION, DOCS, "full")
    _assert_close(out.logits, _hf_logits(engine.hf_model, layout.ids))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy", ["cacheblend", "epic", "infoflow:doc_context=builtin", "fusionrag:pick=builtin"])
def test_ratio_one_equals_full(family, strategy, tiny_engine):
    engine = tiny_engine(family)
    engine.precompute(DOCS)
    _, ref = _prefill_logits(engine, QUESTION, DOCS, "full")
    layout, out = _prefill_logits(engine, QUESTION, DOCS, strategy, ratio=1.0)
    # every document token is recomputed but the first document's: its cache, computed right after the same
    # cached prefix, is exactly what full prefill computes there (the logits below prove it)
    first = layout.docs[0]
    assert out.recomputed.numel() == layout.doc_tokens - (first.end - first.start)
    assert not ((out.recomputed >= first.start) & (out.recomputed < first.end)).any()
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy", ["cacheblend", "epic", "infoflow", "prophetkv"])
def test_the_exact_first_document_gives_its_budget_to_the_others(strategy, tiny_engine):
    """The ratio applies to every document token; the first document (exact) is never recomputed, so the others
    get its share. Behind a title (computed glue) or in a chat layout it is not exact and is a candidate."""
    engine = tiny_engine("llama")
    engine.precompute(DOCS)
    layout, out = _prefill_logits(engine, QUESTION, DOCS, strategy, ratio=0.3)
    first = layout.docs[0]
    assert out.recomputed.numel() == round(0.3 * layout.doc_tokens)
    assert not ((out.recomputed >= first.start) & (out.recomputed < first.end)).any()
    titled = [{"id": DOCS[0][0], "text": DOCS[0][1], "title": "Larkspur"}] + list(DOCS[1:])
    layout, out = _prefill_logits(engine, QUESTION, titled, strategy, ratio=1.0)
    assert out.recomputed.numel() == layout.doc_tokens  # behind its title the first document is a candidate


def test_first_document_exact_is_one_rule(tiny_engine):
    """`PromptLayout.first_document_exact`, the rule the engine and the adapter's training share: the first document
    right after the cached prefix, with unadapted documents; not behind a title, not after a computed (chat)
    prefix, not with an offline adapter's documents, not when there is no document."""
    from kvfuse.engine.prompt import PromptLayout
    from kvfuse.engine.types import as_documents

    engine = tiny_engine("llama")
    plain = engine.layout(QUESTION, as_documents(DOCS))
    assert plain.first_document_exact() and not plain.first_document_exact(documents_adapted=True)
    titled = engine.layout(QUESTION, as_documents([{"id": DOCS[0][0], "text": DOCS[0][1], "title": "Larkspur"}]))
    assert titled.docs[0].start > titled.prefix.end and not titled.first_document_exact()
    chat = PromptLayout.from_pieces([("text", [1, 2]), ("doc", [3, 4, 5]), ("text", [6])], prefix_cached=False)
    assert chat.docs[0].start == chat.prefix.end and not chat.first_document_exact()
    assert not PromptLayout.from_pieces([("text", [1, 2]), ("text", [6])], prefix_cached=True).first_document_exact()


def _rotate(x: torch.Tensor, inv_freq: torch.Tensor, delta: int, scaling: float = 1.0) -> torch.Tensor:
    """Rotates post-RoPE keys [heads, T, D] by `delta` positions (float64, rotate-half pairing)."""
    ang = delta * inv_freq.double()
    cos, sin = torch.cos(ang), torch.sin(ang)
    half = x.shape[-1] // 2
    a, b = x[..., :half].double(), x[..., half:].double()
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def _cache_kw(hf, cache) -> dict:
    """The KV-cache keyword of this transformers version's forward (`cache`, earlier `past_key_values`)."""
    import inspect

    return {"cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values": cache}


@pytest.mark.parametrize("family", FAMILIES)
def test_reuse_equals_independent_concatenation(family, tiny_engine):
    from transformers import DynamicCache

    engine = tiny_engine(family)
    hf = engine.hf_model
    layout, out = _prefill_logits(engine, QUESTION, DOCS, "reuse")
    assert out.recomputed.numel() == 0
    prefix = torch.tensor(engine.prompts.prefix_ids)
    p = prefix.numel()
    inv_freq = hf.model.rotary_emb.inv_freq
    cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        pc = DynamicCache(config=hf.config)
        hf(prefix[None], **_cache_kw(hf, pc), use_cache=True)
        per_layer = [[[pc.layers[i].keys], [pc.layers[i].values]] for i in range(hf.config.num_hidden_layers)]
        for span, ids in zip(layout.docs, layout.doc_ids):
            dc = DynamicCache(config=hf.config)
            hf(torch.cat([prefix, ids])[None], **_cache_kw(hf, dc), use_cache=True)
            for i in range(hf.config.num_hidden_layers):
                k = dc.layers[i].keys[:, :, p:]
                per_layer[i][0].append(_rotate(k, inv_freq, span.start - p))
                per_layer[i][1].append(dc.layers[i].values[:, :, p:])
        for i, (ks, vs) in enumerate(per_layer):
            cache.update(torch.cat(ks, dim=2), torch.cat(vs, dim=2), i)
        tail = layout.ids[layout.tail.start:]
        pos = torch.arange(layout.tail.start, layout.n)[None]
        ref = hf(tail[None], position_ids=pos, **_cache_kw(hf, cache), use_cache=True).logits[0, -1].float()
    _assert_close(out.logits, ref, tol=5e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_repositioning_is_exact(family, tiny_engine):
    """Documents cached at local positions, moved: layer-0 keys equal HF's at the global positions."""
    from transformers import DynamicCache

    engine = tiny_engine(family)
    engine.precompute(DOCS)
    strat = make_strategy("reuse")
    from kvfuse.engine.types import as_documents

    layout, segs, _ = engine._prepare(QUESTION, as_documents(DOCS), strat)
    out = engine.runner.prefill(layout.ids, segs, strat, 0.0, extra_capacity=0)
    seq = _open(engine, out, layout.n)
    cache = DynamicCache(config=engine.hf_model.config)
    with torch.inference_mode():
        engine.hf_model(layout.ids[None], **_cache_kw(engine.hf_model, cache), use_cache=True)
    hf_k = cache.layers[0].keys[0].transpose(0, 1)  # [N, kv_heads, D] after RoPE
    ours = engine.decoding.keys(seq, 0)
    last = layout.docs[-1]
    assert last.start > layout.docs[0].end  # the last document really moved
    torch.testing.assert_close(ours, hf_k, rtol=1e-5, atol=1e-5)


def test_recomputed_rows_attend_by_absolute_position(tiny_engine, monkeypatch):
    """A recomputed row at position p is blind to keys after p: changing a later document leaves the early
    rows' K at the last layer unchanged. A bottom-right-aligned mask breaks that (asserted too)."""
    engine = tiny_engine("llama")
    docs_b = DOCS[:-1] + [(DOCS[-1][0] + "-x", "A different final document about copper mines in Esk.")]

    def early_k(eng):  # the second document's first rows (EPIC recomputes them; the first document is exact)
        _, out = _prefill_logits(eng, QUESTION, docs, "epic", ratio=0.3)
        second = eng.layout(QUESTION, docs).docs[1]
        assert second.end <= eng.layout(QUESTION, docs).docs[-1].start
        return eng.decoding.keys(out.seq, eng.decoder.spec.n_layers - 1)[second.start:second.start + 3].clone()

    docs = DOCS
    a = early_k(engine)
    docs = docs_b
    b = early_k(engine)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)

    real = runner_mod.fused_attention

    def bottom_right(q, q_pos, k, v, rows, kv_pos, cos, sin, scale):
        n, m = kv_pos.numel(), q_pos.numel()
        return real(q, torch.arange(n - m, n, device=q_pos.device), k, v, rows, kv_pos, cos, sin, scale)

    monkeypatch.setattr(runner_mod, "fused_attention", bottom_right)
    docs = DOCS
    a2 = early_k(engine)
    docs = docs_b
    b2 = early_k(engine)
    assert (a2 - b2).abs().max().item() > 1e-4, "a bottom-right mask should leak later documents"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_is_deterministic(family, tiny_engine):
    engine = tiny_engine(family)
    r1 = engine.generate(QUESTION, DOCS, strategy="cacheblend", max_new_tokens=12)
    r2 = engine.generate(QUESTION, DOCS, strategy="cacheblend", max_new_tokens=12)
    assert r1.token_ids == r2.token_ids and r1.text == r2.text
    assert r1.cache_misses == len(DOCS) and r2.cache_hits == len(DOCS)  # same answer, cold or warm


@pytest.mark.slow
def test_smollm2_full_matches_transformers_and_fuses(smollm2_engine):
    engine = smollm2_engine
    layout, out = _prefill_logits(engine, QUESTION, DOCS, "full")
    _assert_close(out.logits, _hf_logits(engine.hf_model, layout.ids), tol=1e-4)
    _, one = _prefill_logits(engine, QUESTION, DOCS, "cacheblend", ratio=1.0)
    torch.testing.assert_close(one.logits, out.logits, rtol=1e-5, atol=1e-4)
    r = engine.generate(QUESTION, DOCS, strategy="cacheblend", recompute_ratio=0.15, max_new_tokens=8)
    assert r.cache_hits == len(DOCS) and 0 < r.recomputed_tokens <= round(0.15 * r.doc_tokens) + 1


def test_teacher_forced_scores_match_decoding_and_standalone(tiny_engine):
    engine = tiny_engine("qwen2")
    r = engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=6, return_logprobs=True)
    assert len(r.token_ids) == 6
    assert r.extra["logprobs"].argmax(-1).tolist() == r.token_ids  # the re-scored answer is the greedy one
    t = engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=6, teacher_ids=r.token_ids)
    torch.testing.assert_close(t.extra["teacher_logprobs"], r.extra["logprobs"], rtol=1e-4, atol=1e-4)
    assert t.token_ids == r.token_ids  # scoring the teacher tokens does not disturb decoding
    alone = engine.next_token_logprobs(QUESTION, DOCS, r.token_ids, strategy="full")
    torch.testing.assert_close(alone, r.extra["logprobs"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("strategy", ["reuse", "cacheblend", "infoflow"])
def test_result_reports_where_the_recomputed_tokens_are(strategy, tiny_engine):
    engine = tiny_engine("qwen2")
    r = engine.generate(QUESTION, DOCS, strategy=strategy, recompute_ratio=0.3, max_new_tokens=2)
    layout = engine.layout(QUESTION, DOCS)
    assert r.doc_spans == [(sp.start, sp.end) for sp in layout.docs] and len(r.doc_spans) == len(DOCS)
    pos = r.recomputed_positions
    assert len(pos) == r.recomputed_tokens and pos == sorted(set(pos))
    assert all(any(s <= p < e for s, e in r.doc_spans) for p in pos)
    assert (len(pos) == 0) == (strategy == "reuse")
    full = engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=2)
    assert full.recomputed_positions == [] and full.recomputed_tokens == full.doc_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_projections_are_the_models_weights_and_compute_the_same(family, tiny_engine):
    """q/k/v and gate/up run as one GEMM each over packed weights; the model's own modules hold views of the packs
    (one copy), and a layer computes what the separate projections compute."""
    import torch.nn.functional as F

    from kvfuse.kernels.rmsnorm import rms_norm

    engine = tiny_engine(family)
    dec, s = engine.decoder, engine.decoder.spec
    w, hf = dec.layers[1], engine.hf_model.model.layers[1]
    assert w.wqkv is not None and w.w_gu is not None
    for mod, pack in ((hf.self_attn.q_proj, w.wqkv), (hf.self_attn.v_proj, w.wqkv), (hf.mlp.up_proj, w.w_gu)):
        assert mod.weight.untyped_storage().data_ptr() == pack.untyped_storage().data_ptr()
    h = torch.randn(6, s.hidden, generator=torch.Generator().manual_seed(3))
    x = rms_norm(h, w.ln1, s.rms_eps)
    want = [F.linear(x, m.weight, m.bias) for m in (hf.self_attn.q_proj, hf.self_attn.k_proj, hf.self_attn.v_proj)]
    got = dec.project(1, h)
    if w.q_norm is not None:  # qwen3: the per-head norms follow the projections
        want[0] = rms_norm(want[0].view(6, s.n_heads, s.head_dim), w.q_norm, s.rms_eps)
        want[1] = rms_norm(want[1].view(6, s.n_kv_heads, s.head_dim), w.k_norm, s.rms_eps)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.reshape(6, -1), b.reshape(6, -1))
    attn = torch.randn(6, s.n_heads, s.head_dim, generator=torch.Generator().manual_seed(4))
    mid = h + F.linear(attn.reshape(6, -1), w.wo, w.bo)
    y = rms_norm(mid, w.ln2, s.rms_eps)
    mlp = hf.mlp.down_proj(F.silu(hf.mlp.gate_proj(y)) * hf.mlp.up_proj(y))
    torch.testing.assert_close(dec.finish(1, h, attn), mid + mlp)
