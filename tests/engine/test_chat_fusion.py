"""Chat requests: registered documents are found by content inside any prompt (a framework's stuffed template)
and fused; one canonical body per document across entry points (titles are computed glue); forget; seeds."""
from __future__ import annotations

import pytest
import torch
from cases import DOCS, QUESTION

from kvfuse.engine.registry import DocumentIndex
from kvfuse.engine.types import Document

# what LlamaIndex's default text-QA template and metadata rendering make of two retrieved nodes
STUFFED = ("Context information is below.\n---------------------\n"
           "title: Larkspur\n\n{0}\n\ntitle: Voss\n\n{1}\n---------------------\n"
           "Given the context information and not prior knowledge, answer the query.\nQuery: {q}\nAnswer: ")


def _stuffed(q=QUESTION):
    return STUFFED.format(DOCS[0][1], DOCS[2][1], q=q)


def test_stuffed_prompt_fuses_precomputed_documents(tiny_engine):
    engine = tiny_engine("qwen2")
    engine.precompute(DOCS)
    r = engine.chat([{"role": "user", "content": _stuffed()}], strategy="cacheblend", max_new_tokens=4)
    assert (r.cache_hits, r.cache_misses) == (2, 0)
    assert r.extra["documents"] == ["larkspur", "voss"]
    # the first body is followed by the suffix it was cached with; the second is served as the first rows of its
    # cache (the suffix is not in the prompt there)
    assert r.doc_tokens == (len(engine.prompts.encode_document(Document(*DOCS[0])))
                            + len(engine.prompts.encode_body(Document(*DOCS[2]))))
    plain = tiny_engine("qwen2")  # nothing registered: the same prompt is a plain chat completion
    r0 = plain.chat(_stuffed(), strategy="cacheblend", max_new_tokens=4)
    assert (r0.cache_hits, r0.cache_misses, r0.doc_tokens) == (0, 0, 0)


def test_documents_given_with_the_chat_are_found_and_registered(tiny_engine):
    engine = tiny_engine("llama")
    r = engine.chat(_stuffed(), documents=[DOCS[0], DOCS[2]], strategy="reuse", max_new_tokens=2)
    assert (r.cache_hits, r.cache_misses) == (0, 2)
    r = engine.chat(_stuffed("Who built it?"), strategy="reuse", max_new_tokens=2)  # registered by the first call
    assert (r.cache_hits, r.cache_misses) == (2, 0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_chat_recompute_all_equals_full_prefill(tiny_engine, family):
    engine = tiny_engine(family)
    engine.precompute(DOCS)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": _stuffed()}]
    full = engine.chat(msgs, strategy="full", max_new_tokens=4, return_logprobs=True)
    fused = engine.chat(msgs, strategy="cacheblend", recompute_ratio=1.0, max_new_tokens=4, return_logprobs=True)
    assert fused.cache_hits == 2 and fused.recomputed_tokens == fused.doc_tokens
    assert fused.token_ids == full.token_ids
    torch.testing.assert_close(fused.extra["logprobs"], full.extra["logprobs"], rtol=1e-4, atol=1e-4)


def test_multi_turn_chat_is_the_chat_template_exactly(tiny_engine):
    engine = tiny_engine("qwen2")
    msgs = [{"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "And another?"}]
    ids = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor(ids if isinstance(ids, list) else ids["input_ids"], dtype=torch.long)
    r = engine.chat(msgs, strategy="full", max_new_tokens=1, return_logprobs=True)
    assert r.prompt_tokens == ids.numel()
    with torch.inference_mode():
        ref = torch.log_softmax(engine.hf_model(ids[None]).logits[0, -1].float(), -1)
    torch.testing.assert_close(r.extra["logprobs"][0], ref, rtol=2e-4, atol=2e-4)


def test_one_canonical_body_across_entry_points(tiny_engine):
    engine = tiny_engine("llama")
    body = DOCS[1][1]
    engine.precompute([{"id": "q", "title": "Quillon festival", "text": body}])  # a CLI record with a title
    r = engine.generate(QUESTION, [("q", body)], strategy="reuse", max_new_tokens=2)  # a LangChain page_content
    assert (r.cache_hits, r.cache_misses, r.stale) == (1, 0, 0)
    titled = engine.generate(QUESTION, [Document("q", body, "Quillon festival")], strategy="reuse",
                             max_new_tokens=2)
    assert titled.cache_hits == 1 and titled.prompt_tokens > r.prompt_tokens  # the title is computed glue
    node = f"title: Quillon festival\n\n{body}"  # a LlamaIndex node's LLM rendering
    assert engine.chat(f"{node}\n\nWho founded it?", strategy="reuse", max_new_tokens=2).cache_hits == 1


def test_forget_evicts_by_id_everywhere(tiny_engine, tmp_path):
    engine = tiny_engine("llama", disk_cache_dir=tmp_path)
    engine.precompute(DOCS)
    assert engine.forget(["voss", "nope"]) == 1
    r = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=2)
    assert (r.cache_hits, r.cache_misses) == (2, 1)
    engine.forget("larkspur")
    other = tiny_engine("llama", disk_cache_dir=tmp_path)  # gone from disk too
    r = other.generate(QUESTION, DOCS[:1], strategy="reuse", max_new_tokens=2)
    assert r.cache_misses == 1
    # larkspur is no longer registered; voss was registered again by the request above
    assert engine.chat(_stuffed(), strategy="reuse", max_new_tokens=2).extra["documents"] == ["voss"]


def test_seed_none_is_unseeded(tiny_engine):
    engine = tiny_engine("llama")
    draws = {tuple(engine.generate(QUESTION, DOCS, temperature=1.5, max_new_tokens=8).token_ids) for _ in range(3)}
    assert len(draws) > 1
    seeded = {tuple(engine.generate(QUESTION, DOCS, temperature=1.5, seed=7, max_new_tokens=8).token_ids)
              for _ in range(2)}
    assert len(seeded) == 1


def test_bad_messages_are_one_clear_error(tiny_engine):
    engine = tiny_engine("llama")
    for bad, match in [([], "end with a user turn"), ([{"role": "tool", "content": "x"}], "role"),
                       ([{"role": "user"}], "'role' and 'content'"), (42, "messages must be"),
                       ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "user turn")]:
        with pytest.raises(ValueError, match=match):
            engine.chat(bad)
    assert engine.cache_stats()["misses"] == 0


def test_document_index_finds_longest_verified_bodies_and_stays_bounded():
    idx = DocumentIndex(budget_bytes=5000)
    long_a = "The Larkspur Observatory was built in 1887 on Mount Helder."
    a = Document("a", long_a)
    a2 = Document("a2", long_a + " Its first director was Amelia Voss.")
    b = Document("b", "Amelia Voss was born in the river town of Dunmore in 1851.")
    for d in (a, a2, b):
        assert idx.add(d)
    assert not idx.add(Document("short", "too short"))
    text = f"intro {a2.text}\n\n{b.text} and {long_a[:-1]}"  # the last one is cut: not a match
    got = [(m.doc.id, text[m.start:m.end]) for m in idx.find(text)]
    assert got == [("a2", a2.text), ("b", b.text)]
    for i in range(100):  # bounded: old ids are forgotten
        idx.add(Document(f"d{i}", f"filler document number {i:04d} with some words in it"))
    assert idx.used <= 5000 and "a" not in idx and "d99" in idx


def test_registrations_persist_with_the_disk_cache(tiny_engine, tmp_path):
    import sqlite3

    first = tiny_engine("llama", disk_cache_dir=tmp_path)
    first.precompute(DOCS)  # e.g. `kvfuse precompute` into the folder an index's engine uses
    first.close()
    second = tiny_engine("llama", disk_cache_dir=tmp_path)  # a new process: the stuffed prompt still fuses
    r = second.chat(_stuffed(), strategy="reuse", max_new_tokens=2)
    assert r.extra["documents"] == ["larkspur", "voss"] and r.cache_hits == 2
    second.forget(["voss"])
    second.close()
    con = sqlite3.connect(tmp_path / "cache.db")
    with con:  # a damaged registration row is dropped, not fatal
        con.execute("UPDATE Cache SET value = ? WHERE key LIKE 'reg:%:larkspur'", (b"{not json",))
    con.close()
    third = tiny_engine("llama", disk_cache_dir=tmp_path)
    assert "voss" not in third.registry and "larkspur" not in third.registry and "quillon" in third.registry
    assert third.cache_stats()["corrupt"] == 1
