"""`guard_margin` through the real server process: the OpenAI body's kvfuse field reaches the engine, the
response's kvfuse extension says where the guard handed the answer to full prefill, and the remote adapter's
result carries it too."""
from __future__ import annotations

import pytest
from serving import DOCS, KEY

openai = pytest.importorskip("openai", reason="the openai client is part of the dev extra")

QUESTION = "In which town was the first director of the Larkspur Observatory born?"


def test_a_guarded_request_is_answered_by_full_prefill_and_says_so(start_server, local_engine):
    srv = start_server("--guard-margin", "1e9", "--guard-tokens", "2")  # every request that sets no guard is guarded
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
    docs = [{"id": d["id"], "text": d["text"]} for d in DOCS]
    body = {"documents": docs, "strategy": "reuse", "guard_margin": 0}  # off for this one
    r = client.completions.create(model=srv.model, prompt=QUESTION, max_tokens=8, temperature=0, extra_body=body)
    assert r.model_extra["kvfuse"]["strategy"] == "reuse" and "guard" not in r.model_extra["kvfuse"]
    del body["guard_margin"]
    r = client.completions.create(model=srv.model, prompt=QUESTION, max_tokens=8, temperature=0, extra_body=body)
    ext = r.model_extra["kvfuse"]
    assert ext["strategy"] == "full" and ext["guard"]["requested"] == "reuse" and ext["guard"]["escalated_at"] == 0
    assert ext["guard"]["margin_nats"] == 1e9
    full = local_engine.generate(QUESTION, docs, max_new_tokens=8, temperature=0.0, strategy="full")
    assert r.choices[0].text == full.text
    body["guard_tokens"] = 1  # the first token checked: the same hand-over
    r = client.completions.create(model=srv.model, prompt=QUESTION, max_tokens=8, temperature=0, extra_body=body)
    assert r.model_extra["kvfuse"]["guard"]["escalated_at"] == 0 and r.choices[0].text == full.text
    body["guard_tokens"] = 0
    with pytest.raises(openai.BadRequestError, match="guard_tokens"):
        client.completions.create(model=srv.model, prompt=QUESTION, max_tokens=8, temperature=0, extra_body=body)
    del body["guard_tokens"]
    body["guard_margin"] = -1
    with pytest.raises(openai.BadRequestError, match="guard_margin"):
        client.completions.create(model=srv.model, prompt=QUESTION, max_tokens=8, temperature=0, extra_body=body)
    from kvfuse.integrations.remote import RemoteEngine

    remote = RemoteEngine(f"{srv.url}/v1", api_key=KEY, model=srv.model)
    res = remote.generate(QUESTION, docs, strategy="reuse", guard_margin=1e8, max_new_tokens=8, temperature=0.0)
    assert res.text == full.text and res.extra["guard"]["margin_nats"] == 1e8
    # the guard read at the question probe (guard_at "probe"): a query-aware strategy hands over before its fused pass
    probe = {"documents": docs, "strategy": "infoflow", "recompute_ratio": 0.3, "guard_at": "probe"}
    r = client.completions.create(model=srv.model, prompt=QUESTION, max_tokens=8, temperature=0, extra_body=probe)
    ext = r.model_extra["kvfuse"]
    assert ext["strategy"] == "full" and ext["guard"]["at"] == "probe" and r.choices[0].text == full.text
    with pytest.raises(openai.BadRequestError, match="guard_at"):
        client.completions.create(model=srv.model, prompt=QUESTION, max_tokens=8, temperature=0,
                                  extra_body={**probe, "guard_at": "before"})
    with pytest.raises(openai.BadRequestError, match="runs none"):
        client.completions.create(model=srv.model, prompt=QUESTION, max_tokens=8, temperature=0,
                                  extra_body={**probe, "strategy": "cacheblend"})
    res = remote.generate(QUESTION, docs, strategy="prophetkv", recompute_ratio=0.3, guard_margin=1e8,
                          guard_at="probe", max_new_tokens=8, temperature=0.0)
    assert res.text == full.text and res.extra["guard"]["at"] == "probe"
