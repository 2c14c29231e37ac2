"""Documents registered, used by id, read and deleted over HTTP; /metrics scraped and parsed; a client that
disconnects mid-stream cancels its request."""
from __future__ import annotations

import time

import httpx
import pytest
from serving import KEY

AUTH = {"Authorization": f"Bearer {KEY}"}

parser = pytest.importorskip("prometheus_client.parser", reason="prometheus-client is in the serve extra")


def _metrics(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics").text
    out = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _sum(metrics, name, **labels):
    return sum(v for (n, lab), v in metrics.items() if n == name and all((k, v2) in lab for k, v2 in labels.items()))


def test_document_round_trip(server):
    docs = [{"id": "rt-1", "title": "Harbour", "text": "The harbour of Quillon was dredged in 1902 and now takes "
                                                       "ships of up to 40,000 tonnes."},
            {"id": "rt-2", "text": "Mount Helder rises 2,310 metres above the valley and is climbed every summer."}]
    r = httpx.post(f"{server.url}/v1/documents", json={"documents": docs}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["ids"] == ["rt-1", "rt-2"] and body["computed"] == 2 and body["searchable"] == 2
    again = httpx.post(f"{server.url}/v1/documents", json={"documents": docs}, headers=AUTH, timeout=60).json()
    assert again["computed"] == 0 and again["cached"] == 2

    got = httpx.get(f"{server.url}/v1/documents/rt-1", headers=AUTH).json()
    assert got["text"] == docs[0]["text"] and got["title"] == "Harbour"

    chat = {"model": server.model, "messages": [{"role": "user", "content": "When was it dredged?"}],
            "documents": ["rt-1", "rt-2"], "max_tokens": 3, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=AUTH, timeout=60).json()
    assert r["kvfuse"]["cache_hits"] == 2 and r["kvfuse"]["cache_misses"] == 0
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    assert httpx.delete(f"{server.url}/v1/documents/rt-1", headers=AUTH).json()["deleted"] is True
    assert httpx.get(f"{server.url}/v1/documents/rt-1", headers=AUTH).status_code == 404
    assert httpx.delete(f"{server.url}/v1/documents/rt-1", headers=AUTH).status_code == 404
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "rt-1" in r.json()["error"]["message"]


def test_documents_endpoint_validates(server):
    r = httpx.post(f"{server.url}/v1/documents", json={"documents": [{"id": "a"}]}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents.0.text"
    r = httpx.post(f"{server.url}/v1/documents", json={"documents": [{"id": "a", "text": "x " * 5000}]},
                   headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_metrics_count_requests(server):
    before = _metrics(server)
    chat = {"model": server.model, "messages": [{"role": "user", "content": "Count me."}], "max_tokens": 5,
            "temperature": 0, "documents": [{"id": "m-doc", "text": "A document for the metrics test, long "
                                                                    "enough to be searched for."}]}
    for _ in range(2):
        assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=AUTH, timeout=60).status_code == 200
    after = _metrics(server)
    done = lambda m: _sum(m, "kvfuse_requests_total", endpoint="chat")  # noqa: E731
    assert done(after) - done(before) == 2
    assert _sum(after, "kvfuse_ttft_seconds_count", endpoint="chat") - \
        _sum(before, "kvfuse_ttft_seconds_count", endpoint="chat") == 2
    assert _sum(after, "kvfuse_queue_seconds_count", endpoint="chat") >= 2
    assert _sum(after, "kvfuse_completion_tokens_total") - _sum(before, "kvfuse_completion_tokens_total") <= 10
    assert _sum(after, "kvfuse_request_cache_hits_total") - _sum(before, "kvfuse_request_cache_hits_total") >= 1
    assert _sum(after, "kvfuse_cached_tokens_total") > _sum(before, "kvfuse_cached_tokens_total")
    assert _sum(after, "kvfuse_recompute_fraction_count") >= 2
    assert 0.0 < after[("kvfuse_cache_hit_rate", ())] <= 1.0
    assert after[("kvfuse_cache_hits_total", ())] >= 1
    for gauge in ("kvfuse_requests_in_flight", "kvfuse_engine_running", "kvfuse_engine_queued",
                  "kvfuse_engine_batch_size", "kvfuse_engine_pool_occupancy"):
        assert (gauge, ()) in after, gauge
    assert after[("kvfuse_requests_in_flight", ())] == 0


def test_client_disconnect_cancels_the_stream(server):
    before = _metrics(server)
    body = {"model": server.model, "messages": [{"role": "user", "content": "Talk for a long time."}],
            "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    # closed after the first event: the server cancels the request (the engine stops decoding it)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = _metrics(server)
        if _sum(m, "kvfuse_requests_total", finish_reason="cancelled") > \
                _sum(before, "kvfuse_requests_total", finish_reason="cancelled"):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the disconnected stream was never cancelled")
    assert m[("kvfuse_requests_in_flight", ())] == 0
    tokens = _sum(m, "kvfuse_completion_tokens_total") - _sum(before, "kvfuse_completion_tokens_total")
    assert tokens == 0  # a cancelled request is counted as cancelled, not as generated output
