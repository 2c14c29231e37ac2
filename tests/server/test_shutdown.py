"""SIGTERM while a stream is in flight: the server stops accepting, lets the stream finish (or cancels it after
--shutdown-timeout) and exits with status 0."""
from __future__ import annotations

import signal
import time

import httpx
import pytest
from serving import KEY

AUTH = {"Authorization": f"Bearer {KEY}"}
pytestmark = pytest.mark.timeout(180)


def _events(server, max_tokens):
    body = {"model": server.model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    return httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def test_sigterm_lets_an_inflight_stream_finish(start_server):
    srv = start_server("--shutdown-timeout", "120")
    with _events(srv, 300) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data:"))
        assert next(lines)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.HTTPError):  # no new connection is accepted while draining
            httpx.get(f"{srv.url}/health", timeout=5)
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    assert '"finish_reason": "length"' in rest[-2]
    assert srv.proc.wait(60) == 0, srv.logs()
    assert "Traceback" not in srv.logs()


def test_sigterm_cancels_a_stream_past_the_timeout(start_server):
    srv = start_server("--shutdown-timeout", "0.5")
    t0 = time.monotonic()
    with _events(srv, 4000) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data:"))
        assert next(lines)
        srv.proc.send_signal(signal.SIGTERM)
        try:
            rest = list(lines)
        except httpx.HTTPError:  # the connection may be cut mid-event
            rest = []
    assert rest and "shutting_down" in rest[-1]  # cut with an error event, never a [DONE]
    assert srv.proc.wait(60) == 0, srv.logs()
    assert time.monotonic() - t0 < 60
    assert "Traceback" not in srv.logs()
