"""Property-based requests: random unicode documents, lengths, orders, subsets, repeats and cached/uncached
mixes (in memory and through the disk tier of another engine) against full prefill and a cold engine.

Properties, for every drawn request:
- the prompt is exactly the documents' own tokens between the prefix and the question, in the order given;
- recompute-all (cacheblend at ratio 1.0) answers with full prefill's tokens;
- what was cached before the request (nothing, some, all; from memory or from disk) never changes the answer:
  the log-probabilities are bit-identical to a cold engine's.
"""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_fs import compare

from kvfuse.engine.types import Document

QUESTION = "What do the notes say about the lantern makers?"
_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=120).filter(
    lambda t: t.strip())
_WORDS = st.lists(st.sampled_from(["lantern", "Dunmore", "1887", "Voss", "été", "東京", "🚀", "harbour", "\n",
                                   "zaïre", "—", "observatory"]), min_size=1, max_size=400).map(" ".join).filter(
    lambda t: t.strip())


@st.composite
def requests(draw):
    texts = draw(st.lists(st.one_of(_TEXT, _WORDS), min_size=1, max_size=4, unique=True))
    docs = [(f"d{i}", t) for i, t in enumerate(texts)]
    order = draw(st.lists(st.integers(0, len(docs) - 1), min_size=1, max_size=6))  # subsets, repeats, any order
    cached = draw(st.lists(st.booleans(), min_size=len(docs), max_size=len(docs)))
    via_disk = draw(st.booleans())
    return docs, order, cached, via_disk


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(req=requests())
def test_any_request_matches_full_prefill_and_a_cold_engine(tiny_engine, tmp_path_factory, tally, req):
    docs, order, cached, via_disk = req
    asked = [docs[i] for i in order]
    cold = tiny_engine("llama")
    ref = cold.generate(QUESTION, asked, strategy="reuse", max_new_tokens=3, return_logprobs=True)
    full = cold.generate(QUESTION, asked, strategy="full", max_new_tokens=3)

    layout = cold.layout(QUESTION, asked)
    want = list(cold.prompts.prefix_ids)
    for d in asked:
        want += cold.prompts.encode_document(Document(*d))
    assert layout.ids.tolist()[:len(want)] == want
    assert [len(s) for s in layout.docs] == [len(cold.prompts.encode_document(Document(*d))) for d in asked]

    pre = [d for d, c in zip(docs, cached) if c]
    if via_disk:
        folder = tmp_path_factory.mktemp("kv")
        if pre:
            tiny_engine("llama", disk_cache_dir=folder).precompute(pre)
        warm = tiny_engine("llama", disk_cache_dir=folder)
    else:
        warm = tiny_engine("llama")
        if pre:
            warm.precompute(pre)
    r = warm.generate(QUESTION, asked, strategy="reuse", max_new_tokens=3, return_logprobs=True)
    all_of_it = warm.generate(QUESTION, asked, strategy="cacheblend", recompute_ratio=1.0, max_new_tokens=3)
    wrong, stale = compare(r, ref)
    tally(None, 1, wrong + int(all_of_it.token_ids != full.token_ids), stale)
    assert r.cache_hits + r.cache_misses == len(asked)
    assert r.cache_misses == len({i for i in order if not cached[i]})  # each new document computed once
    assert r.token_ids == ref.token_ids
    torch.testing.assert_close(r.extra["logprobs"], ref.extra["logprobs"], rtol=0, atol=0)

    assert all_of_it.token_ids == full.token_ids
    first = layout.docs[0]  # exact when it follows the cached prefix directly: never recomputed
    exact = layout.prefix_cached and first.start == layout.prefix.end
    assert all_of_it.recomputed_tokens == layout.doc_tokens - exact * (first.end - first.start)
