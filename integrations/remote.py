"""`RemoteEngine`: a running `kvfuse serve` seen through the small engine interface the adapters use.

`FusionLLM(base_url=...)`, `ChatKVFuse(base_url=...)` and `FusionRunnable(base_url=...)` build one, and then
take the same code path as over an in-process `FusionEngine`: `generate` / `stream` go to `/v1/completions` (the
engine's RAG layout, the documents in the server's `documents` field), `chat` / `stream_chat` to
`/v1/chat/completions` (a document given as a bare id string names one the server has registered); the async twins (`agenerate`, `astream`, `achat`, `astream_chat`) never block the event
loop. Every generation is streamed (server-sent events, usage included), so closing a stream, a cancelled task or
a timeout closes the HTTP response and the server cancels the request. Results are `RemoteResult`s (a
`GenerationResult` built from the response's `usage` and `kvfuse` objects; `token_ids` stays empty, the
server does not send them). `register` / `precompute` / `forget` use `/v1/documents`.

Errors: an HTTP 4xx answer raises ValueError with the server's message (`RemoteError.status` / `.code` say
more), 429 and 503 raise `RemoteOverloaded` (an `EngineOverloaded`, with `retry_after_s` from Retry-After),
5xx RuntimeError, and an unreachable server ConnectionError naming the address.

Needs httpx (`pip install 'kvfuse[serve]'` or the openai client, which depends on it).
"""
from __future__ import annotations

import asyncio
import json
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from kvfuse.engine.types import Document, EngineOverloaded, GenerationResult, PrecomputeReport, as_documents

__all__ = ["RemoteEngine", "RemoteResult", "RemoteError", "RemoteOverloaded"]

#: engine keywords a server request can carry (their OpenAI names where they differ)
_BODY_NAMES = {"strategy": "strategy", "recompute_ratio": "recompute_ratio", "max_new_tokens": "max_tokens",
               "temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop",
               "target_fidelity": "target_fidelity", "ttft_budget_s": "ttft_budget_s",
               "guard_margin": "guard_margin", "guard_tokens": "guard_tokens", "guard_at": "guard_at"}


class RemoteError(ValueError):
    """The server refused the request (HTTP 4xx): the message is the server's."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class RemoteOverloaded(EngineOverloaded):
    """The server is overloaded (429) or shutting down (503): retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: float = 1.0, status: int | None = None,
                 code: str | None = None) -> None:
        super().__init__(message, retry_after_s)
        self.status, self.code = status, code


@dataclass
class RemoteResult(GenerationResult):
    """A generation answered by a server: the `GenerationResult` fields its response carries (the rest 0 / empty;
    `token_ids` is empty), with the server's token counts as `usage()`."""

    counts: dict[str, int] = field(default_factory=dict)

    def usage(self) -> dict[str, int]:
        return dict(self.counts)

    def as_dict(self) -> dict[str, Any]:
        d = super().as_dict()
        d.pop("counts", None)
        return d


def _error(status: int, body: Any, retry_after: str | None = None) -> Exception:
    """The exception of an error answer (HTTP status, body as JSON or text)."""
    err = body.get("error") if isinstance(body, dict) else None
    message = str(err.get("message")) if isinstance(err, dict) else str(body or "").strip()[:500]
    code = err.get("code") if isinstance(err, dict) else None
    text = f"kvfuse server: {message or 'no message'} (HTTP {status}{', ' + code if code else ''})"
    if status in (429, 503):
        try:
            wait = float(retry_after) if retry_after else 1.0
        except ValueError:
            wait = 1.0
        return RemoteOverloaded(text, wait, status, code)
    if 400 <= status < 500:
        return RemoteError(text, status, code)
    return RuntimeError(text)


def _event_error(err: dict) -> Exception:
    """The exception of an error event inside a stream (the status is already sent: judged by its type)."""
    status = {"rate_limit_error": 429, "service_unavailable": 503, "invalid_request_error": 400}.get(
        err.get("type"), 500)
    return _error(status, {"error": err})


class _Collector:
    """Reads one answer's server-sent events: yields text deltas, builds the result from the final chunks."""

    def __init__(self, chat: bool, opts: dict[str, Any]) -> None:
        self.chat, self.opts = chat, opts
        self.text = ""
        self.finish: str | None = None
        self.result: RemoteResult | None = None

    def feed(self, line: str) -> tuple[str | None, bool]:
        """(delta or None, whether the answer is complete) of one SSE line; raises the server's error events."""
        if not line.startswith("data:"):
            return None, False
        data = line[5:].strip()
        if data == "[DONE]":
            if self.result is None:
                raise RuntimeError("kvfuse server: the stream ended without usage (is it a kvfuse server?)")
            return None, True
        event = json.loads(data)
        if "error" in event:
            raise _event_error(event["error"] or {})
        if event.get("usage"):
            self.result = self._result(event)
        delta = None
        for choice in event.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if piece:
                delta = (delta or "") + piece
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        if delta:
            self.text += delta
        return delta, False

    def _result(self, event: dict) -> RemoteResult:
        usage, ext = event["usage"], event.get("kvfuse") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        counts = {"prompt_tokens": int(usage.get("prompt_tokens", 0)),
                  "completion_tokens": int(usage.get("completion_tokens", 0)),
                  "total_tokens": int(usage.get("total_tokens", 0)), "cached_tokens": cached}
        doc_tokens = int(ext.get("doc_tokens", 0))
        return RemoteResult(
            text=self.text, token_ids=[], strategy=str(ext.get("strategy", self.opts.get("strategy", ""))),
            recompute_ratio=float(ext.get("recompute_ratio", self.opts.get("recompute_ratio", 0.0))),
            finish_reason=str(ext.get("finish_reason") or self.finish or "stop"),
            ttft_s=float(ext.get("ttft_s", 0.0)), prefill_s=float(ext.get("prefill_s", 0.0)),
            decode_s=float(ext.get("decode_s", 0.0)), selection_s=float(ext.get("selection_s", 0.0)),
            miss_prefill_s=float(ext.get("miss_prefill_s", 0.0)), prompt_tokens=counts["prompt_tokens"],
            doc_tokens=doc_tokens, question_tokens=int(ext.get("question_tokens", 0)),
            recomputed_tokens=int(ext.get("recomputed_tokens", max(0, doc_tokens - cached))),
            cache_hits=int(ext.get("cache_hits", 0)), cache_misses=int(ext.get("cache_misses", 0)),
            stale=int(ext.get("stale", 0)),
            extra={"documents": list(ext.get("documents", [])),
                   **{k: ext[k] for k in ("auto", "cold", "guard") if isinstance(ext.get(k), dict)}},
            queue_s=float(ext.get("queue_s", 0.0)), counts=counts)


class _Cancel:
    """`stream.cancel.set()` (what a timeout calls, from any thread) closes the HTTP response: the server then
    cancels the request."""

    def __init__(self, stream: RemoteStream) -> None:
        self._stream = weakref.ref(stream)
        self._set = threading.Event()

    def set(self) -> None:
        self._set.set()
        stream = self._stream()
        if stream is not None:
            stream._shut()

    def is_set(self) -> bool:
        return self._set.is_set()


class RemoteStream:
    """Iterator over the text deltas of one remote generation; `.result` once exhausted; `close()` cancels."""

    def __init__(self, engine: RemoteEngine, path: str, body: dict[str, Any], chat: bool,
                 opts: dict[str, Any]) -> None:
        self._engine, self._path, self._body = engine, path, body
        self._collector = _Collector(chat, opts)
        self.result: RemoteResult | None = None
        self.cancel = _Cancel(self)
        self._cm = self._response = self._lines = None
        self._done = False

    def __iter__(self) -> RemoteStream:
        return self

    def _open(self) -> None:
        cm = self._engine._client().stream("POST", self._engine._url(self._path), json=self._body)
        response = self._engine._send(cm.__enter__)
        self._cm, self._response = cm, response
        if response.status_code != 200:
            response.read()
            exc = _error(response.status_code, _json(response), response.headers.get("retry-after"))
            self._shut()
            raise exc
        self._lines = response.iter_lines()

    def __next__(self) -> str:
        if self._done:
            raise StopIteration
        try:
            if self._cm is None:
                self._open()
            while True:
                line = self._engine._read(lambda: next(self._lines, None))
                if line is None:
                    raise RuntimeError("kvfuse server: the stream ended before the answer was complete")
                delta, complete = self._collector.feed(line)
                if complete:
                    self.result = self._collector.result
                    self._done = True
                    self._shut()
                    raise StopIteration
                if delta:
                    return delta
        except StopIteration:
            raise
        except BaseException:
            self._done = True
            self._shut()
            raise

    def wait(self) -> RemoteResult | None:
        for _ in self:
            pass
        return self.result

    def _shut(self) -> None:
        cm, self._cm = self._cm, False  # False: never opened again
        if cm:
            try:
                cm.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - a response closed from another thread may complain; it is closed
                pass

    def close(self) -> None:
        """Closes the response (the server cancels the request if it was still running); idempotent."""
        self._done = True
        self.cancel._set.set()
        self._shut()


class AsyncRemoteStream:
    """`async for delta in stream` over one remote generation; `.result` once exhausted; `await aclose()` cancels."""

    def __init__(self, engine: RemoteEngine, path: str, body: dict[str, Any], chat: bool,
                 opts: dict[str, Any]) -> None:
        self._engine, self._path, self._body = engine, path, body
        self._collector = _Collector(chat, opts)
        self.result: RemoteResult | None = None
        self._cm = self._lines = None
        self._done = False

    def __aiter__(self) -> AsyncRemoteStream:
        return self

    async def _open(self) -> None:
        cm = self._engine._aclient().stream("POST", self._engine._url(self._path), json=self._body)
        self._cm = cm
        response = await self._engine._asend(cm.__aenter__)
        if response.status_code != 200:
            await response.aread()
            raise _error(response.status_code, _json(response), response.headers.get("retry-after"))
        self._lines = response.aiter_lines()

    async def __anext__(self) -> str:
        if self._done:
            raise StopAsyncIteration
        try:
            if self._cm is None:
                await self._open()
            while True:
                line = await self._engine._asend(self._lines.__anext__)
                delta, complete = self._collector.feed(line)
                if complete:
                    self.result = self._collector.result
                    self._done = True
                    await self._shut()
                    raise StopAsyncIteration
                if delta:
                    return delta
        except StopAsyncIteration as e:
            if self.result is None:
                self._done = True
                await self._shut()
                raise RuntimeError("kvfuse server: the stream ended before the answer was complete") from e
            raise
        except BaseException:
            self._done = True
            await self._shut()
            raise

    async def _shut(self) -> None:
        cm, self._cm = self._cm, False
        if cm:
            try:
                await cm.__aexit__(None, None, None)
            except Exception:  # noqa: BLE001 - closing must not mask the outcome
                pass

    async def aclose(self) -> None:
        """Closes the response (the server cancels the request if it was still running); idempotent."""
        self._done = True
        await self._shut()


def _json(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


class _Prompts:
    def __init__(self, fmt: Any) -> None:
        self.fmt = fmt


class RemoteEngine:
    """A `kvfuse serve` server behind the engine methods the adapters call.

    Args:
        base_url: the server's OpenAI base URL, e.g. "http://127.0.0.1:8000/v1" (a URL without /v1 gets it).
        api_key: the server's API key (sent as `Authorization: Bearer ...`), if it has one.
        model: the served model's name (default: the one the server lists, asked on first need).
        timeout: seconds to wait for the server to answer or send the next piece (None: no limit).
        connect_timeout: seconds to connect.
        headers: more HTTP headers for every request.
    """

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None, *,
                 timeout: float | None = 600.0, connect_timeout: float = 10.0,
                 headers: dict[str, str] | None = None) -> None:
        import httpx

        url = str(base_url).rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL like http://host:8000/v1, got {base_url!r}")
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self._headers = {"Accept": "application/json", **(headers or {})}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._model = model or None
        self._card: dict[str, Any] | None = None
        self._sync: Any = None
        self._async: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> AsyncClient
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteEngine({self.base_url!r}, model={self._model!r})"

    # -- transport ----------------------------------------------------------------------------------------
    def _url(self, path: str) -> str:
        return self.base_url + path

    def _client(self) -> Any:
        if self._sync is None:
            import httpx

            with self._lock:
                if self._sync is None:
                    self._sync = httpx.Client(headers=self._headers, timeout=self._timeout)
        return self._sync

    def _aclient(self) -> Any:
        """One AsyncClient per event loop (its connections belong to that loop)."""
        import httpx

        loop = asyncio.get_running_loop()
        client = self._async.get(loop)
        if client is None:
            client = self._async[loop] = httpx.AsyncClient(headers=self._headers, timeout=self._timeout)
        return client

    def _transport_error(self, exc: Exception) -> Exception:
        import httpx

        if isinstance(exc, httpx.TimeoutException):
            return TimeoutError(f"kvfuse server at {self.base_url} did not answer in time ({type(exc).__name__}); "
                                "raise the RemoteEngine timeout= for long answers")
        return ConnectionError(f"cannot reach the kvfuse server at {self.base_url}: {exc} (is `kvfuse serve` "
                               "running there?)")

    def _send(self, call: Any) -> Any:
        import httpx

        try:
            return call()
        except httpx.TransportError as exc:
            raise self._transport_error(exc) from exc

    _read = _send

    async def _asend(self, call: Any) -> Any:
        import httpx

        try:
            return await call()
        except httpx.TransportError as exc:
            raise self._transport_error(exc) from exc

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        response = self._send(lambda: self._client().request(method, self._url(path), json=body))
        if response.status_code >= 400:
            raise _error(response.status_code, _json(response), response.headers.get("retry-after"))
        return response.json()

    # -- what the server serves -----------------------------------------------------------------------------
    def _model_card(self) -> dict[str, Any]:
        if self._card is None:
            cards = self._request("GET", "/models").get("data") or []
            if not cards:
                raise RuntimeError(f"kvfuse server at {self.base_url} lists no model")
            card = cards[0]
            if self._model is not None:
                card = next((c for c in cards if c.get("id") == self._model), None)
                if card is None:
                    raise RemoteError(f"kvfuse server at {self.base_url} serves "
                                      f"{[c.get('id') for c in cards]}, not {self._model!r}", 404,
                                      "model_not_found")
            self._card = card
        return self._card

    @property
    def model_name(self) -> str:
        if self._model is None:
            self._model = str(self._model_card()["id"])
        return self._model

    @property
    def context_window(self) -> int:
        return int(self._model_card().get("context_window") or 4096)

    @property
    def prompts(self) -> _Prompts:
        """The server engine's prompt format (how documents are laid out before a question)."""
        from kvfuse.engine.prompt import PromptFormat

        given = (self._model_card().get("kvfuse") or {}).get("prompt_format") or {}
        keys = ("instruction", "doc_suffix", "question_template")
        return _Prompts(PromptFormat(**{k: given[k] for k in keys if k in given}))

    # -- generation ---------------------------------------------------------------------------------------------
    def _body(self, docs: Any, opts: dict[str, Any]) -> dict[str, Any]:
        opts = dict(opts)
        for name in ("teacher_ids", "return_logprobs"):
            if opts.pop(name, None):
                raise ValueError(f"{name} is not available from a remote engine")
        unknown = sorted(k for k in opts if k not in _BODY_NAMES)
        if unknown:
            raise ValueError(f"a remote engine takes no strategy options ({unknown}): the server applies its "
                             "strategies' defaults")
        body: dict[str, Any] = {"model": self.model_name, "stream": True,
                                "stream_options": {"include_usage": True}, "temperature": 0.0}
        for key, value in opts.items():
            if value is not None:
                body[_BODY_NAMES[key]] = value
        if isinstance(docs, (str, bytes)):
            raise ValueError("docs must be a list of documents or document ids, not a single string")
        # a bare string is the id of a document the server knows (registered before); the rest are sent whole
        documents = [d if isinstance(d, str) else _document(as_documents([d])[0]) for d in docs or []]
        if documents:
            body["documents"] = documents
        return body

    def _stream(self, cls: type, chat: bool, first: Any, docs: Any, opts: dict[str, Any]) -> Any:
        body = self._body(docs, opts)
        if chat:
            body["messages"] = _messages(first)
            return cls(self, "/chat/completions", body, True, opts)
        body["prompt"] = str(first)
        return cls(self, "/completions", body, False, opts)

    def stream(self, question: str, docs: Any = (), **opts: Any) -> RemoteStream:
        """`FusionEngine.stream` on the server (`/v1/completions`: the engine's RAG layout)."""
        return self._stream(RemoteStream, False, question, docs, opts)

    def stream_chat(self, messages: Any, documents: Any = (), **opts: Any) -> RemoteStream:
        """`FusionEngine.stream_chat` on the server (`/v1/chat/completions`)."""
        return self._stream(RemoteStream, True, messages, documents, opts)

    def generate(self, question: str, docs: Any = (), **opts: Any) -> RemoteResult:
        return self.stream(question, docs, **opts).wait()

    def chat(self, messages: Any, documents: Any = (), **opts: Any) -> RemoteResult:
        return self.stream_chat(messages, documents, **opts).wait()

    def astream(self, question: str, docs: Any = (), **opts: Any) -> AsyncRemoteStream:
        return self._stream(AsyncRemoteStream, False, question, docs, opts)

    def astream_chat(self, messages: Any, documents: Any = (), **opts: Any) -> AsyncRemoteStream:
        return self._stream(AsyncRemoteStream, True, messages, documents, opts)

    async def agenerate(self, question: str, docs: Any = (), **opts: Any) -> RemoteResult | None:
        return await _drain(self.astream(question, docs, **opts))

    async def achat(self, messages: Any, documents: Any = (), **opts: Any) -> RemoteResult | None:
        return await _drain(self.astream_chat(messages, documents, **opts))

    # -- documents ------------------------------------------------------------------------------------------
    def precompute(self, docs: Any, strategy: str | None = None, **_: Any) -> PrecomputeReport:
        """Registers documents on the server and computes their caches there (`POST /v1/documents`)."""
        out = self._request("POST", "/documents", {"documents": [_document(d) for d in as_documents(docs)],
                                                   "strategy": strategy, "precompute": True})
        return PrecomputeReport(hits=int(out.get("cached", 0)), misses=int(out.get("computed", 0)),
                                tokens=int(out.get("tokens", 0)), seconds=float(out.get("seconds", 0.0)))

    def register(self, docs: Any) -> int:
        """Registers documents on the server without computing them; returns how many are searchable."""
        out = self._request("POST", "/documents", {"documents": [_document(d) for d in as_documents(docs)],
                                                   "precompute": False})
        return int(out.get("searchable", 0))

    def forget(self, doc_ids: Any) -> int:
        """Drops documents by id on the server; returns how many it knew."""
        n = 0
        for doc_id in doc_ids:
            try:
                self._request("DELETE", f"/documents/{doc_id}")
                n += 1
            except RemoteError as e:
                if e.status != 404:
                    raise
        return n

    def close(self) -> None:
        """Closes the HTTP connections (the server keeps running)."""
        if self._sync is not None:
            self._sync.close()
            self._sync = None


async def _drain(stream: AsyncRemoteStream) -> RemoteResult | None:
    try:
        async for _ in stream:
            pass
    finally:
        await stream.aclose()
    return stream.result


def _document(doc: Document) -> dict[str, Any]:
    out = {"id": doc.id, "text": doc.text}
    if doc.title:
        out["title"] = doc.title
    return out


def _messages(messages: Any) -> list[dict[str, str]]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return [{"role": m["role"], "content": m["content"]} for m in messages]
