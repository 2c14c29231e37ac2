"""The fusion adapter's training forward is the engine's own computation: full prefill, reuse, reuse with an
adapter and recompute-all all match the engine's paths; training lowers the distillation loss; the adapter's hash
keys the caches; files round-trip and bad ones are refused."""
from __future__ import annotations

import pytest
import torch

from kvfuse.engine.adapter import AdaptedDecoder, FusionAdapter, load_adapter
from kvfuse.engine.types import Document
from kvfuse.training.distill import (TrainConfig, document_kv, student_logprobs, teacher_logprobs,
                                     train_adapter)

from cases import DOCS, QUESTION

ANSWER = [5, 17, 42, 9]


def _noisy_adapter(engine, seed=3, scale=0.05):
    ad = FusionAdapter.init(engine.decoder, rank=4, alpha=8.0, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for t in ad.targets:
        ad.B[t] = torch.randn(ad.B[t].shape, generator=g) * scale
    return ad


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_forward_matches_full_reuse_and_adapted_reuse(tiny_engine, family):
    engine = tiny_engine(family)
    layout = engine.layout(QUESTION, DOCS)
    full = engine.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="full")
    teacher = teacher_logprobs(engine, layout, ANSWER + [0])[:len(ANSWER)]
    torch.testing.assert_close(teacher, full, atol=2e-4, rtol=0)

    reuse = engine.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="reuse")
    with torch.no_grad():
        student = student_logprobs(engine, layout, ANSWER + [0], None)[:len(ANSWER)]
    torch.testing.assert_close(student, reuse, atol=2e-4, rtol=0)
    assert (reuse - full).abs().max() > 1e-2  # reuse really differs from full: the comparison can fail

    # recompute every document row: the student is full prefill again
    docs_pos = torch.cat([torch.arange(sp.start, sp.end) for sp in layout.docs])
    with torch.no_grad():
        all_back = student_logprobs(engine, layout, ANSWER + [0], None, recompute=docs_pos)[:len(ANSWER)]
    torch.testing.assert_close(all_back, full, atol=2e-4, rtol=0)

    ad = _noisy_adapter(engine)
    adapted = tiny_engine(family, adapter=ad)
    served = adapted.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="reuse")
    with torch.no_grad():
        student = student_logprobs(engine, layout, ANSWER + [0], ad)[:len(ANSWER)]
    torch.testing.assert_close(student, served, atol=2e-4, rtol=0)
    assert (served - reuse).abs().max() > 1e-3  # the adapter changed what is served
    # full stays the base model, exactly
    assert torch.equal(adapted.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="full"), full)


def test_zero_adapter_is_the_identity_and_namespaces_differ(tiny_engine, tmp_path):
    engine = tiny_engine("llama")
    zero = FusionAdapter.init(engine.decoder, rank=2)
    layout = engine.layout(QUESTION, DOCS)
    with torch.no_grad():
        a = document_kv(engine, layout, None)
        b = document_kv(engine, layout, zero)
    for (ka, va), (kb, vb) in zip(a, b):
        for x, y in zip(ka + va, kb + vb):
            assert torch.equal(x, y)
    adapted = tiny_engine("llama", adapter=_noisy_adapter(engine))
    assert adapted.namespace.digest != engine.namespace.digest
    other = tiny_engine("llama", adapter=_noisy_adapter(engine, seed=4))
    assert other.namespace.digest != adapted.namespace.digest


def test_adapter_file_round_trip_and_bad_files(tiny_engine, tmp_path):
    engine = tiny_engine("llama")
    ad = _noisy_adapter(engine)
    path = ad.save(tmp_path / "a.safetensors", dtype=torch.float32)
    back = load_adapter(path)
    assert back.digest == ad.digest and back.targets == ad.targets and back.rank == ad.rank
    with pytest.raises(ValueError, match="does not exist"):
        load_adapter(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a readable adapter"):
        load_adapter(junk)
    from safetensors.torch import save_file
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(other))
    with pytest.raises(ValueError, match="not a kvfuse fusion adapter"):
        load_adapter(other)
    # an adapter for another shape is refused before any work
    wrong = FusionAdapter.init(engine.decoder, rank=2)
    wrong.A["q"] = wrong.A["q"][:, :, :-1]
    with pytest.raises(ValueError, match="does not fit"):
        tiny_engine("llama", adapter=wrong)
    with pytest.raises(ValueError, match="does not fit"):
        AdaptedDecoder(engine.decoder, wrong)


def test_training_lowers_the_distillation_loss(tiny_engine, tmp_path):
    from kvfuse.evaluation.data import Example

    engine = tiny_engine("llama")
    ex = Example("ex1", "tiny", QUESTION, tuple((i, "", t) for i, t in DOCS), ("Dunmore",))
    cfg = TrainConfig(rank=4, steps=12, lr=3e-3, warmup=2, ratios=(0.0,), min_docs=3, max_docs=3,
                      answer_tokens=4, max_doc_tokens=10_000)
    rec = train_adapter(engine, [ex], cfg, tmp_path / "ad.safetensors", log=lambda s: None)
    kls = [c["kl"] for c in rec["curve"]]
    assert len(kls) == 12
    assert min(kls[-3:]) < kls[0] * 0.8, kls
    ad = load_adapter(tmp_path / "ad.safetensors")
    assert ad.meta["steps"] == "12"
    assert (tmp_path / "ad.json").is_file()


def test_the_packaged_adapter_is_intact_and_on_by_default(tiny_model):
    """The adapter shipped for the embedded model reads back (safetensors, no pickle), fits Qwen2.5-0.5B's shapes,
    carries its training record and is what `adapter="auto"` (the default) resolves to for that model; a model
    without one gets none by default, and `adapter="packaged"` for it is a clear error."""
    from kvfuse.engine.adapter import packaged_adapter, resolve_adapter
    from kvfuse.engine.api import FusionEngine

    path = packaged_adapter("qwen2.5-coder-0.5b")
    assert path is not None and path.stat().st_size < 20e6
    ad = load_adapter(path)
    assert ad.A["q"].shape == (24, ad.rank, 896) and ad.B["k"].shape == (24, 128, ad.rank)
    assert ad.meta["model"] == "qwen2.5-coder-0.5b" and path.with_suffix(".json").is_file()
    assert ad.stage == "offline"
    assert resolve_adapter("auto", "qwen2.5-coder-0.5b") == path
    assert resolve_adapter(None, "qwen2.5-coder-0.5b") is None and resolve_adapter("none", "x") is None
    assert packaged_adapter("no-such-model") is None and resolve_adapter("auto", "no-such-model") is None
    tiny = FusionEngine.from_pretrained(str(tiny_model("llama")), device="cpu", dtype="fp32", disk_cache=False)
    assert tiny.adapter is None
    with pytest.raises(ValueError, match="no fusion adapter is shipped"):
        FusionEngine.from_pretrained(str(tiny_model("llama")), device="cpu", dtype="fp32", disk_cache=False,
                                     adapter="packaged")


def _online(engine, seed=5, scale=0.05):
    ad = _noisy_adapter(engine, seed=seed, scale=scale)
    ad.stage = "online"
    return ad


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_online_adapter_training_forward_is_what_the_engine_serves(tiny_engine, family):
    """An online adapter: documents are the base model's caches, the rows a fused prefill computes run the merged
    weights, the answer rows the base model. The student's forward equals the engine's (reuse, and recompute of
    every document row), `full` stays the base model exactly, and the adapter really moves the fused rows."""
    engine = tiny_engine(family)
    layout = engine.layout(QUESTION, DOCS)
    ad = _online(engine)
    adapted = tiny_engine(family, adapter=ad)
    assert adapted.fused_runner is not adapted.runner
    full = engine.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="full")
    assert torch.equal(adapted.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="full"), full)
    base_reuse = engine.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="reuse")
    served = adapted.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="reuse")
    with torch.no_grad():
        student = student_logprobs(engine, layout, ANSWER + [0], ad)[:len(ANSWER)]
    torch.testing.assert_close(student, served, atol=2e-4, rtol=0)
    assert (served - base_reuse).abs().max() > 1e-3  # the adapter changed the fused rows
    # the documents' caches are the base model's: computed alone, with or without the online adapter, the same
    for (ka, va), (kb, vb) in zip(document_kv(engine, layout, None), document_kv(engine, layout, ad)):
        for x, y in zip(ka + va, kb + vb):
            assert torch.equal(x, y)
    # every document row recomputed but the first document's, whose cache is exact (computed right after the prefix
    # by the base model, as full prefill computes it) and is never a candidate
    assert layout.docs[0].start == layout.prefix.end
    docs_pos = torch.cat([torch.arange(sp.start, sp.end) for sp in layout.docs[1:]])
    with torch.no_grad():
        every = student_logprobs(engine, layout, ANSWER + [0], ad, recompute=docs_pos)[:len(ANSWER)]
    served_all = adapted.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="cacheblend", recompute_ratio=1.0)
    torch.testing.assert_close(every, served_all, atol=2e-4, rtol=0)


def test_online_adapter_is_served_on_the_generate_path(tiny_engine):
    """The scheduler's prefill (generate) runs the merged weights for strategies that read caches: the first token
    is the argmax of the online-adapted distribution, which differs from the base model's here."""
    engine = tiny_engine("llama")
    ad = _online(engine, seed=7, scale=0.5)
    adapted = tiny_engine("llama", adapter=ad)
    base = engine.next_token_logprobs(QUESTION, DOCS, [1], strategy="reuse")[0]
    moved = adapted.next_token_logprobs(QUESTION, DOCS, [1], strategy="reuse")[0]
    assert int(base.argmax()) != int(moved.argmax())  # the check below can tell the two apart
    first = adapted.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=1, temperature=0.0).token_ids[0]
    assert first == int(moved.argmax())
    full_first = adapted.generate(QUESTION, DOCS, strategy="full", max_new_tokens=1, temperature=0.0).token_ids[0]
    assert full_first == int(engine.next_token_logprobs(QUESTION, DOCS, [1], strategy="full")[0].argmax())


def test_merged_weights_compute_what_the_adapter_computes(tiny_engine):
    from kvfuse.engine.adapter import merge_into

    engine = tiny_engine("qwen2")
    ad = _noisy_adapter(engine, seed=9, scale=0.2)
    merged, lora = merge_into(engine.decoder, ad), AdaptedDecoder(engine.decoder, ad)
    h = torch.randn(5, engine.decoder.spec.hidden, generator=torch.Generator().manual_seed(0))
    for i in (0, len(engine.decoder.layers) - 1):
        for x, y in zip(merged.project(i, h), lora.project(i, h)):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
        attn = torch.randn(5, engine.decoder.spec.n_heads, engine.decoder.spec.head_dim)
        torch.testing.assert_close(merged.finish(i, h, attn), lora.finish(i, h, attn), atol=1e-4, rtol=1e-4)
        assert not torch.equal(merged.layers[i].wq, engine.decoder.layers[i].wq)
    assert merged.layers[0].ln1 is engine.decoder.layers[0].ln1 and merged.embed is engine.decoder.embed


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_offline_documents_run_merged_weights_with_one_copy_of_them(tiny_engine, family):
    """The engine computes an offline adapter's documents on merged weights (the base model's cost per row), and
    their caches are the adapter's (training's unmerged form) to rounding; the merged layers keep one copy of
    their weights (the separate q/k/v and gate/up names are views of the packs)."""
    from kvfuse.engine.docpass import documents_pass

    base = tiny_engine(family)
    ad = _noisy_adapter(base, seed=11, scale=0.2)
    engine = tiny_engine(family, adapter=ad)
    dc = engine.doc_cache
    dec = dc.doc_runner.dec
    assert not isinstance(dec, AdaptedDecoder) and dec is not engine.decoder
    for layer, orig in zip(dec.layers, engine.decoder.layers):
        for name in ("wq", "wk", "wv"):
            assert getattr(layer, name).untyped_storage().data_ptr() == layer.wqkv.untyped_storage().data_ptr()
        for name in ("w_gate", "w_up"):
            assert getattr(layer, name).untyped_storage().data_ptr() == layer.w_gu.untyped_storage().data_ptr()
        assert not torch.equal(layer.wq, orig.wq)
    docs = [Document(*d) for d in DOCS]
    ids = [engine.prompts.encode_document(d) for d in docs]
    with torch.inference_mode():
        served = [kv for _, kv in dc.kvs(docs, None, ids)[0]]
        lora = documents_pass(AdaptedDecoder(engine.decoder, ad), dc.doc_runner.rope, dc.prefix_kv(), ids)
        plain = documents_pass(engine.decoder, dc.doc_runner.rope, dc.prefix_kv(), ids)
    for s, want, b in zip(served, lora, plain):
        torch.testing.assert_close(s.k, want.k, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(s.v, want.v, atol=2e-4, rtol=1e-4)
        assert (s.k - b.k).abs().max() > 1e-2  # the adapter moved the cache: the comparison above can fail


def test_online_training_lowers_the_loss_and_the_stage_round_trips(tiny_engine, tmp_path):
    from kvfuse.evaluation.data import Example

    engine = tiny_engine("llama")
    ex = Example("ex1", "tiny", QUESTION, tuple((i, "", t) for i, t in DOCS), ("Dunmore",))
    cfg = TrainConfig(rank=4, steps=10, lr=3e-3, warmup=2, ratios=(0.0, 0.3), min_docs=3, max_docs=3,
                      answer_tokens=4, max_doc_tokens=10_000, stage="online", batch=2)
    rec = train_adapter(engine, [ex], cfg, tmp_path / "on.safetensors", log=lambda s: None)
    kls = [c["kl"] for c in rec["curve"]]
    assert len(kls) == 10 and all(len(c["prompts"]) == 2 for c in rec["curve"])
    assert min(kls[-3:]) < kls[0] * 0.8, kls
    ad = load_adapter(tmp_path / "on.safetensors")
    assert ad.stage == "online"
    off = _noisy_adapter(engine)
    on = _noisy_adapter(engine)
    on.stage = "online"
    assert on.digest != off.digest  # the same tensors acting elsewhere are another cache namespace
    with pytest.raises(ValueError, match="stage"):
        FusionAdapter(2, 4.0, ("q",), {}, {}, stage="sometimes")


def test_a_crashed_run_resumes_from_its_checkpoint_to_the_uninterrupted_result(tiny_engine, tmp_path):
    """A run killed in its third step (the teacher's generate raises) leaves a checkpoint after step 2; resumed,
    it trains the adapter a run that never stopped trains (same weights, same loss curve). A checkpoint of other
    settings is refused, and a corrupt one is a clear error, never a silent restart."""
    from kvfuse.evaluation.data import Example
    from kvfuse.training.distill import checkpoint_path

    engine = tiny_engine("llama")
    ex = Example("ex1", "tiny", QUESTION, tuple((i, "", t) for i, t in DOCS), ("Dunmore",))
    cfg = TrainConfig(rank=4, steps=4, lr=3e-3, warmup=1, ratios=(0.0, 0.3), min_docs=2, max_docs=3,
                      answer_tokens=3, max_doc_tokens=10_000, checkpoint_seconds=1e-9)
    straight = train_adapter(engine, [ex], cfg, tmp_path / "a.safetensors", log=lambda s: None)

    real, calls = engine.generate, []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("killed")
        return real(*args, **kw)

    engine.generate = flaky
    with pytest.raises(RuntimeError, match="killed"):
        train_adapter(engine, [ex], cfg, tmp_path / "b.safetensors", log=lambda s: None)
    engine.generate = real
    assert checkpoint_path(tmp_path / "b.safetensors").is_file() and not (tmp_path / "b.safetensors").exists()
    resumed = train_adapter(engine, [ex], cfg, tmp_path / "b.safetensors", log=lambda s: None, resume=True)
    assert [c["kl"] for c in resumed["curve"]] == pytest.approx([c["kl"] for c in straight["curve"]], abs=1e-5)
    a, b = load_adapter(tmp_path / "a.safetensors"), load_adapter(tmp_path / "b.safetensors")
    for t in a.targets:
        torch.testing.assert_close(b.A[t], a.A[t], atol=1e-6, rtol=0)
        torch.testing.assert_close(b.B[t], a.B[t], atol=1e-6, rtol=0)
    assert (a.B["q"] != 0).any()  # it trained: the comparison can fail
    other = TrainConfig(**{**cfg.__dict__, "lr": 1e-3})
    with pytest.raises(ValueError, match="another run.*lr"):
        train_adapter(engine, [ex], other, tmp_path / "b.safetensors", log=lambda s: None, resume=True)
    ck = checkpoint_path(tmp_path / "b.safetensors")
    ck.write_bytes(ck.read_bytes()[:100])
    with pytest.raises(ValueError, match="not a usable training checkpoint"):
        train_adapter(engine, [ex], cfg, tmp_path / "b.safetensors", log=lambda s: None, resume=True)


def test_held_out_examples_pick_the_adapter_written(tiny_engine, tmp_path):
    """With held-out examples the student's KL on fixed held-out prompts is measured before training (no adapter)
    and every few steps; the adapter written is the one of the lowest point, its step recorded."""
    from kvfuse.evaluation.data import Example

    engine = tiny_engine("llama")
    train = [Example("ex1", "tiny", QUESTION, tuple((i, "", t) for i, t in DOCS), ("Dunmore",))]
    held = [Example("ex2", "tiny", QUESTION, tuple((i, "", t) for i, t in DOCS[::-1]), ("Dunmore",))]
    cfg = TrainConfig(rank=4, steps=6, lr=3e-3, warmup=1, ratios=(0.0,), min_docs=3, max_docs=3, answer_tokens=4,
                      max_doc_tokens=10_000, eval_every=2, eval_prompts=2)
    rec = train_adapter(engine, train, cfg, tmp_path / "h.safetensors", log=lambda s: None, eval_examples=held)
    steps = [h["step"] for h in rec["held_out"]]
    kls = [h["kl"] for h in rec["held_out"]]
    assert steps == [0, 2, 4, 6] and rec["held_out_prompts"] == 2
    assert rec["best_step"] == steps[kls.index(min(kls))]
    assert min(kls) < kls[0]  # training moved the held-out KL (the same documents, reordered)
    ad = load_adapter(tmp_path / "h.safetensors")
    assert ad.meta["steps"] == str(rec["best_step"]) and (ad.B["q"] != 0).any()
    assert not (tmp_path / "h.best.safetensors").exists()


@pytest.mark.parametrize("extra,message", [
    (["--holdout", "2"], "--holdout and --eval-every go together"),
    (["--ratios", "0.2,abc"], "--ratios must be comma-separated numbers"),
    (["--ratios", "1.5"], "--ratios must be numbers in"),
    (["--strategy", "sift"], "--strategy must be a strategy that reads caches"),
    (["--batch", "0"], "--batch"),
    (["--first-token-weight", "0"], "--first-token-weight"),
])
def test_train_adapter_refuses_bad_options_before_any_work(tmp_path, capsys, extra, message):
    from kvfuse import cli

    out = tmp_path / "a.safetensors"
    assert cli.main(["train-adapter", "--data", str(tmp_path), "--out", str(out), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written, no model loaded


def test_the_loss_can_weigh_the_answers_first_token():
    """distill_loss: weight 1 is the plain per-position mean of KL(teacher || student); W weighs the first position W
    times the others; a bad weight is refused by the config."""
    from kvfuse.training.distill import distill_loss

    g = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(torch.randn(4, 11, generator=g), -1)
    student = torch.log_softmax(torch.randn(4, 11, generator=g), -1)
    per = (teacher.exp() * (teacher - student)).sum(-1)
    assert torch.allclose(distill_loss(teacher, student), per.mean())
    assert torch.allclose(distill_loss(teacher, student, 5.0), (5 * per[0] + per[1:].sum()) / 8)
    assert not torch.allclose(distill_loss(teacher, student, 5.0), per.mean())
    assert torch.allclose(distill_loss(teacher[:1], student[:1], 5.0), per[0])
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="first_token_weight"):
            TrainConfig(first_token_weight=bad)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_documents_computed_after_a_context_are_what_a_doc_context_strategy_serves(tiny_engine, family):
    """Training with `doc_context` computes each student document after its context documents' plain caches; with
    an offline adapter that is what the engine serves for `reuse:doc_context=builtin` (every document's cache a
    context variant, computed by the adapted model), and it differs from the plain caches' answer."""
    from kvfuse.engine.corpus import BUILTIN_CONTEXT

    engine = tiny_engine(family)
    ad = _noisy_adapter(engine)
    adapted = tiny_engine(family, adapter=ad)
    layout = engine.layout(QUESTION, DOCS)
    ctx = [engine.prompts.encode_document(Document("c", text)) for _, text in BUILTIN_CONTEXT[:3]][::-1]
    served = adapted.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="reuse:doc_context=builtin")
    with torch.no_grad():
        kv = document_kv(engine, layout, ad, [ctx] * len(DOCS))
        student = student_logprobs(engine, layout, ANSWER + [0], ad, doc_kv=kv)[:len(ANSWER)]
        plain = student_logprobs(engine, layout, ANSWER + [0], ad)[:len(ANSWER)]
    torch.testing.assert_close(student, served, atol=2e-4, rtol=0)
    assert (student - plain).abs().max() > 1e-3  # the context moved the documents: the comparison can fail
    with pytest.raises(ValueError, match="contexts for"):
        document_kv(engine, layout, ad, [ctx])
    # an online adapter leaves documents to the base model: the first, right after the prefix, is served its exact
    # plain cache and the others context variants, which is what training gives it (the first's context empty)
    on = _online(engine)
    served_on = tiny_engine(family, adapter=on).next_token_logprobs(QUESTION, DOCS, ANSWER,
                                                                    strategy="reuse:doc_context=builtin")
    with torch.no_grad():
        kv_on = document_kv(engine, layout, on, [[]] + [ctx] * (len(DOCS) - 1))
        student_on = student_logprobs(engine, layout, ANSWER + [0], on, doc_kv=kv_on)[:len(ANSWER)]
    torch.testing.assert_close(student_on, served_on, atol=2e-4, rtol=0)


def test_training_with_a_random_document_context_lowers_the_loss_and_draws_reproducibly(tiny_engine, tmp_path):
    from kvfuse.evaluation.data import Example
    from kvfuse.training.distill import context_stream

    engine = tiny_engine("llama")
    exs = [Example("ex1", "tiny", QUESTION, tuple((i, "", t) for i, t in DOCS), ("Dunmore",)),
           Example("ex2", "tiny", "Who?", (("o1", "", "Other passage one about rivers and hills."),
                                           ("o2", "", "Other passage two about a market town."),
                                           ("o3", "", "Other passage three about a bridge.")), ("x",))]
    draw = context_stream(exs, seed=0, top_k=2)
    docs = [Document(i, t) for i, t in DOCS]
    enc = (lambda text: engine.prompts.encode_document(Document("c", text)))
    a, b = draw(7, exs[0], docs, enc), draw(7, exs[0], docs, enc)
    assert a == b and len(a) == len(docs) and all(len(c) == 2 for c in a)
    own = {tuple(engine.prompts.encode_document(d)) for d in docs}
    assert not any(tuple(c) in own for ctx in a for c in ctx)  # never the example's own passages
    assert any(draw(n, exs[0], docs, enc) != a for n in range(8, 12))  # a fresh draw per prompt
    cfg = TrainConfig(rank=4, steps=10, lr=3e-3, warmup=2, ratios=(0.0,), min_docs=3, max_docs=3,
                      answer_tokens=4, max_doc_tokens=10_000, doc_context="random", context_docs=2)
    rec = train_adapter(engine, exs, cfg, tmp_path / "ad.safetensors", log=lambda s: None)
    kls = [c["kl"] for c in rec["curve"] if c["prompts"][0]["example"] == "ex1"]
    assert len(kls) >= 3, kls  # enough of the example's prompts to compare its first with its last
    assert rec["config"]["doc_context"] == "random"
    assert load_adapter(tmp_path / "ad.safetensors").meta["doc_context"] == "random"
    assert min(kls[-2:]) < kls[0] * 0.8, kls
    with pytest.raises(ValueError, match="doc_context must be one of"):
        TrainConfig(doc_context="similar")
