"""`kvfuse serve --cold-documents full` through the real server process: a request whose documents the server has
no cache for is answered by full prefill (said in the response's kvfuse extension) and the next one is fused."""
from __future__ import annotations

import pytest
from serving import DOCS, KEY

openai = pytest.importorskip("openai", reason="the openai client is part of the dev extra")

QUESTION = "In which town was the first director of the Larkspur Observatory born?"


def test_new_documents_get_full_prefill_then_the_fused_path(start_server, local_engine):
    srv = start_server("--cold-documents", "full")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
    docs = [{"id": d["id"], "text": d["text"]} for d in DOCS]
    body = {"documents": docs, "strategy": "cacheblend", "recompute_ratio": 0.3}
    r = client.completions.create(model=srv.model, prompt=QUESTION, max_tokens=8, temperature=0, extra_body=body)
    ext = r.model_extra["kvfuse"]
    assert ext["strategy"] == "full" and ext["cold"]["requested"] == "cacheblend"
    assert ext["cold"]["missing_documents"] == len(docs) and ext["cache_misses"] == 0
    full = local_engine.generate(QUESTION, docs, max_new_tokens=8, temperature=0.0, strategy="full")
    assert r.choices[0].text == full.text
    # The server builds the missing caches between requests; a document still waiting when the next request
    # names it is computed by that request (its second sight), so the next request is fused either way.
    r = client.completions.create(model=srv.model, prompt=QUESTION, max_tokens=8, temperature=0, extra_body=body)
    ext = r.model_extra["kvfuse"]
    assert ext["strategy"] == "cacheblend" and "cold" not in ext
    assert ext["cache_hits"] + ext["cache_misses"] == len(docs)
    fused = local_engine.generate(QUESTION, docs, max_new_tokens=8, temperature=0.0, strategy="cacheblend",
                                  recompute_ratio=0.3)
    assert r.choices[0].text == fused.text
    r = client.completions.create(model=srv.model, prompt=QUESTION, max_tokens=8, temperature=0, extra_body=body)
    ext = r.model_extra["kvfuse"]  # every cache is there now, whichever way it was built
    assert ext["strategy"] == "cacheblend" and ext["cache_hits"] == len(docs) and ext["cache_misses"] == 0
    assert r.choices[0].text == fused.text
