"""Link rows (engine/links.py): a fused request's prompt carries K learned rows after every document; what the
engine serves is what training differentiates; `full` and the caches do not change; files round-trip and bad ones
are refused; training lowers the distillation loss."""
from __future__ import annotations

import pytest
import torch

from kvfuse.engine.links import LinkRows, load_links, placeholder_ids
from kvfuse.training.distill import document_kv, strategy_selection, student_logprobs
from kvfuse.training.links import LinksConfig, linked_layout, train_links

from cases import DOCS, QUESTION

ANSWER = [5, 17, 42, 9]
K = 3


def _links(engine, seed: int = 0, scale: float = 1.0) -> LinkRows:
    g = torch.Generator().manual_seed(seed)
    emb = engine.decoder.embed.detach().float()
    return LinkRows(emb[torch.randint(0, emb.shape[0], (K,), generator=g)] * scale
                    + 0.02 * torch.randn(K, emb.shape[1], generator=g))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_served_links_are_the_training_forward_and_full_is_untouched(tiny_engine, family):
    plain = tiny_engine(family)
    engine = tiny_engine(family, links=_links(plain))
    layout = linked_layout(engine, QUESTION, [d for d in engine._documents(DOCS)], K)
    assert layout.n == plain.layout(QUESTION, DOCS).n + K * len(DOCS)
    assert engine.layout(QUESTION, DOCS, strategy="reuse").ids.tolist() == layout.ids.tolist()
    assert engine.layout(QUESTION, DOCS).ids.tolist() == plain.layout(QUESTION, DOCS).ids.tolist()  # full: none
    link = placeholder_ids(engine.decoder.spec.vocab, K)
    for sp in layout.docs:  # K placeholders right after every document
        assert layout.ids[sp.end:sp.end + K].tolist() == link

    served = engine.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="reuse")
    with torch.no_grad():
        student = student_logprobs(engine, layout, ANSWER + [0], None)[:len(ANSWER)]
    torch.testing.assert_close(student, served, atol=2e-4, rtol=0)
    without = plain.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="reuse")
    assert (served - without).abs().max() > 1e-3  # the links changed what is served: the comparison can fail

    # a query-aware strategy picks its rows over the linked prompt, as training does
    served = engine.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="infoflow", recompute_ratio=0.3)
    with torch.no_grad():
        kv = document_kv(engine, layout, None)
        rec = strategy_selection(engine, layout, kv, "infoflow", 0.3, exact_first=True)
        student = student_logprobs(engine, layout, ANSWER + [0], None, rec, kv)[:len(ANSWER)]
    assert rec is not None and rec.numel() > 0
    torch.testing.assert_close(student, served, atol=2e-4, rtol=0)

    # full never sees them, and the documents' caches are the same entries
    assert torch.equal(engine.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="full"),
                       plain.next_token_logprobs(QUESTION, DOCS, ANSWER, strategy="full"))
    assert engine.namespace.digest == plain.namespace.digest


def test_results_name_the_links_and_users_cannot_send_placeholders(tiny_engine):
    plain = tiny_engine("llama")
    links = _links(plain)
    engine = tiny_engine("llama", links=links)
    r = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=2)
    assert r.extra["links"] == {"rows": K, "tokens": K * len(DOCS), "digest": links.digest[:16]}
    # the link rows are computed (the linked layout is longer) but usage counts only what the user sent
    assert engine.layout(QUESTION, DOCS, strategy="reuse").n == plain.layout(QUESTION, DOCS).n + K * len(DOCS)
    assert r.prompt_tokens == plain.layout(QUESTION, DOCS).n
    assert r.usage()["prompt_tokens"] == r.prompt_tokens
    assert "links" not in engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=2).extra
    assert "links" not in plain.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=2).extra
    vocab = engine.decoder.spec.vocab
    with pytest.raises(ValueError, match="question_ids"):
        engine.generate(question_ids=[5, vocab], docs=DOCS, strategy="reuse", max_new_tokens=1)
    # a chat prompt's documents found by content carry them too
    msg = f"Context:\n{DOCS[0][1]}\n\n{DOCS[2][1]}\n\nQuestion: {QUESTION}"
    engine.precompute(DOCS)
    c = engine.chat([{"role": "user", "content": msg}], strategy="reuse", max_new_tokens=2)
    assert c.extra["documents"] == ["larkspur", "voss"] and c.extra["links"]["rows"] == K


def test_link_files_round_trip_and_bad_ones_are_refused(tiny_engine, tmp_path):
    engine = tiny_engine("llama")
    links = _links(engine)
    path = links.save(tmp_path / "l.safetensors")
    back = load_links(path)
    assert back.digest == links.digest and back.k == K
    with pytest.raises(ValueError, match="does not exist"):
        load_links(tmp_path / "none.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a readable"):
        load_links(tmp_path / "junk.safetensors")
    from safetensors.torch import save_file

    save_file({"links": torch.zeros(2, 4)}, str(tmp_path / "other.safetensors"), metadata={"format": "something"})
    with pytest.raises(ValueError, match="not a kvfuse link rows file"):
        load_links(tmp_path / "other.safetensors")
    save_file({"links": torch.zeros(2, 4), "x": torch.zeros(1)}, str(tmp_path / "two.safetensors"),
              metadata={"format": "kvfuse-link-rows-1"})
    with pytest.raises(ValueError, match="malformed"):
        load_links(tmp_path / "two.safetensors")
    save_file({"links": torch.full((2, 4), float("nan"))}, str(tmp_path / "nan.safetensors"),
              metadata={"format": "kvfuse-link-rows-1"})
    with pytest.raises(ValueError, match="finite"):
        load_links(tmp_path / "nan.safetensors")
    save_file({"links": torch.zeros(2, 4)}, str(tmp_path / "narrow.safetensors"),
              metadata={"format": "kvfuse-link-rows-1"})
    with pytest.raises(ValueError, match="hidden size"):
        tiny_engine("llama", links=tmp_path / "narrow.safetensors")


def test_training_lowers_the_distillation_loss(tiny_engine, tmp_path):
    from kvfuse.evaluation.data import Example

    engine = tiny_engine("llama")
    ex = Example("ex1", "tiny", QUESTION, tuple((i, "", t) for i, t in DOCS), ("Dunmore",))
    cfg = LinksConfig(k=K, steps=12, lr=3e-2, warmup=2, ratios=(0.0,), min_docs=3, max_docs=3, answer_tokens=4,
                      max_doc_tokens=10_000, eval_every=12, eval_prompts=1)
    rec = train_links(engine, [ex], cfg, tmp_path / "l.safetensors", log=lambda s: None, eval_examples=[ex])
    held = [p["kl"] for p in rec["held_out"]]
    assert [p["step"] for p in rec["held_out"]] == [0, 12]
    assert held[1] < held[0] * 0.8, held
    assert rec["best_step"] == 12
    assert engine.decoder.links is None  # the engine's own (none) back after training
    served = tiny_engine("llama", links=tmp_path / "l.safetensors")
    assert load_links(tmp_path / "l.safetensors").meta["best_step"] == "12"
    assert served.links.digest == rec["digest"]
