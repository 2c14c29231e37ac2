"""The fusion adapter's training forward is the engine's own computation: full prefill, reuse, reuse with an
adapter and recompute-all all match the engine's paths; training lowers the distillation loss; the adapter's hash
keys the caches; files round-trip and bad ones are refused."""
from __future__ import annotations

import pytest
import torch

from kvfuse.engine.adapter import AdaptedDecoder, FusionAdapter, load_adapter
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


def test_the_packaged_adapter_is_intact_and_opt_in(tiny_model):
    """The adapter shipped for the embedded model reads back (safetensors, no pickle), fits Qwen2.5-0.5B's shapes
    and carries its training record; `adapter="packaged"` for a model without one is a clear error."""
    from kvfuse.engine.adapter import packaged_adapter
    from kvfuse.engine.api import FusionEngine

    path = packaged_adapter("qwen2.5-coder-0.5b")
    assert path is not None and path.stat().st_size < 20e6
    ad = load_adapter(path)
    assert ad.A["q"].shape == (24, ad.rank, 896) and ad.B["k"].shape == (24, 128, ad.rank)
    assert ad.meta["model"] == "qwen2.5-coder-0.5b" and path.with_suffix(".json").is_file()
    assert packaged_adapter("no-such-model") is None
    with pytest.raises(ValueError, match="no fusion adapter is shipped"):
        FusionEngine.from_pretrained(str(tiny_model("llama")), device="cpu", dtype="fp32", disk_cache=False,
                                     adapter="packaged")
