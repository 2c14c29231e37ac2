"""Bad requests get clear 4xx bodies in OpenAI's error shape, from the real server; overload (429) and draining
(503) are checked in process with a fake engine, where they can be provoked deterministically."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from serving import KEY

AUTH = {"Authorization": f"Bearer {KEY}"}


def _post(server, path, body, headers=AUTH):
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def _error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _chat(server, **fields):
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 2}
    body.update(fields)
    return body


@pytest.mark.parametrize("fields, param, words", [
    ({"n": 2}, "n", "n=1"),
    ({"logprobs": True}, "logprobs", "logprobs"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"max_tokens": 0}, None, "max_new_tokens"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "tool"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, None, "user turn"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools"),
    ({"strategy": "nonesuch"}, None, "nonesuch"),
    ({"recompute_ratio": 2}, None, "recompute_ratio"),
    ({"strategy": "auto"}, None, "measured front"),  # this server was started without one
    ({"target_fidelity": 0.8}, None, "option of strategy 'auto'"),
    ({"documents": [{"id": "x", "text": ""}]}, "documents[0]", "empty"),
    ({"documents": [{"id": "x"}]}, "documents[0]", "text: Field required"),
    ({"documents": [7]}, "documents[0]", "got int"),
    ({"documents": "lark"}, "documents", "valid list"),
])
def test_bad_chat_fields_are_400(server, fields, param, words):
    err = _error(_post(server, "/v1/chat/completions", _chat(server, **fields)), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if words is not None:
        assert words in err["message"], err


def test_unknown_document_id_is_named(server):
    err = _error(_post(server, "/v1/chat/completions", _chat(server, documents=["never-registered"])), 400)
    assert "never-registered" in err["message"] and err["code"] == "unknown_document"
    assert err["param"] == "documents[0]"


def test_prompt_over_the_context_window(server):
    long = "lantern " * 5000  # over the tiny model's 4096 positions
    err = _error(_post(server, "/v1/chat/completions", _chat(server, messages=[{"role": "user", "content": long}])),
                 400)
    assert err["code"] == "context_length_exceeded" and "context window" in err["message"]
    err = _error(_post(server, "/v1/completions", {"model": server.model, "prompt": long, "max_tokens": 2}), 400)
    assert err["code"] == "context_length_exceeded"


def test_unknown_model_is_404(server):
    err = _error(_post(server, "/v1/chat/completions", _chat(server, model="gpt-4o")), 404)
    assert err["code"] == "model_not_found" and server.model in err["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_key_required(server, headers):
    err = _error(_post(server, "/v1/chat/completions", _chat(server), headers=headers), 401)
    assert err["code"] == "invalid_api_key"
    _error(httpx.get(f"{server.url}/v1/models", headers=headers), 401)
    assert httpx.get(f"{server.url}/health").status_code == 200  # open, as /metrics


def test_openai_client_raises_its_own_errors(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="only n=1"):
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}], n=3)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()


# -- in process: overload and draining with a fake engine -------------------------------------------------
class _Stream:
    def __init__(self, gate: asyncio.Event | None, overloaded: bool) -> None:
        self.gate, self.overloaded, self.result, self.closed = gate, overloaded, None, False
        self.sent = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        from kvfuse.engine.types import EngineOverloaded, GenerationResult

        if self.overloaded:
            raise EngineOverloaded("queue full", retry_after_s=2.5)
        if self.gate is not None:
            await self.gate.wait()
        if self.sent:
            self.result = GenerationResult("ok", [1], "full", 1.0, "stop", 0.01, 0.01, 0.0, 0.0, 0.0, 5, 0, 5, 0, 0, 0)
            raise StopAsyncIteration
        self.sent = True
        return "ok"

    async def aclose(self):
        self.closed = True


class FakeEngine:
    model_name, context_window = "fake", 128

    def __init__(self, overloaded=False, gate=None):
        self.overloaded, self.gate, self.streams = overloaded, gate, []

    def astream_chat(self, messages, documents=(), **kw):
        self.streams.append(_Stream(self.gate, self.overloaded))
        return self.streams[-1]

    astream = astream_chat

    def cache_stats(self):
        return {"hits": 3, "misses": 1}

    def serving_stats(self):
        return {"running": 0, "queued": 0, "batch_size": 0, "pool_rows_used": 0, "pool_rows_total": 0,
                "requests_done": 0}


def _run(app, fn):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            return await fn(c)
    return asyncio.run(main())


BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


def test_engine_overloaded_is_429_with_retry_after():
    from kvfuse.server import create_app

    engine = FakeEngine(overloaded=True)
    r = _run(create_app(engine), lambda c: c.post("/v1/chat/completions", json=BODY))
    err = _error(r, 429)
    assert r.headers["retry-after"] == "3" and err["code"] == "engine_overloaded"
    assert engine.streams[0].closed


def test_max_pending_is_429_and_draining_is_503():
    from kvfuse.server import create_app

    async def scenario(c):
        engine.gate = asyncio.Event()
        first = asyncio.create_task(c.post("/v1/chat/completions", json=BODY))
        while not engine.streams:
            await asyncio.sleep(0.01)
        busy = await c.post("/v1/chat/completions", json=BODY)  # the one slot is taken
        engine.gate.set()
        done = await first
        app.state.kvfuse.start_draining()
        draining = await c.post("/v1/chat/completions", json=BODY)
        health = await c.get("/health")
        return busy, done, draining, health

    engine = FakeEngine()
    app = create_app(engine, max_pending=1)
    busy, done, draining, health = _run(app, scenario)
    assert _error(busy, 429)["code"] == "server_overloaded" and busy.headers["retry-after"] == "1"
    assert done.status_code == 200 and done.json()["choices"][0]["message"]["content"] == "ok"
    assert _error(draining, 503)["code"] == "shutting_down" and draining.headers["retry-after"] == "1"
    assert health.status_code == 503
    assert app.state.kvfuse.pending == 0 and all(s.closed for s in engine.streams)
