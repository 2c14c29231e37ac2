"""The OpenAI-compatible HTTP app over one FusionEngine (`create_app`).

Generation runs through the engine's asyncio fronts (`astream_chat`, `astream`), so the event loop is never
blocked by model work; the blocking calls the engine has no async front for (`register`, `precompute`, `forget`,
stats) run on worker threads. Every request is admitted by `_Admission` (429 past `max_pending`, 503 while
draining), and a streamed answer is closed (`aclose`: the engine stops decoding it) however it ends: finished,
client gone, or cancelled at shutdown.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from typing import Any

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfuse.engine.types import Document, EngineOverloaded

from .errors import APIError, error_body, error_response
from .metrics import CONTENT_TYPE, ServerMetrics
from .schemas import (ChatRequest, CompletionRequest, DocumentIn, DocumentsRequest, chat_messages,
                      engine_options)

__all__ = ["create_app", "ServerState"]

log = logging.getLogger("kvfuse.server")


class ServerState:
    """What the routes share: the engine, the settings, the documents known by id, the admission counters and
    the streams in flight."""

    def __init__(self, engine, *, model_name: str | None, api_key: str | None, max_pending: int,
                 default_max_tokens: int, owns_engine: bool) -> None:
        self.engine = engine
        self.model_name = model_name or getattr(engine, "model_name", None) or "kvfuse"
        self.api_key = api_key or None
        self.max_pending = max_pending
        self.default_max_tokens = default_max_tokens
        self.owns_engine = owns_engine
        self.documents: dict[str, Document] = {}  # by id: what a request may name by its id alone
        self.pending = 0
        self.draining = False
        self.streams: set[Any] = set()  # engine streams not closed yet
        self.metrics = ServerMetrics(engine)
        self.created = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once started
        self.warmup: dict | None = None  # what `engine.warmup` did before serving (kvfuse serve --warmup)

    # -- admission --------------------------------------------------------------------------------------
    def admit(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down", retry_after_s=1.0)
        if self.pending >= self.max_pending:
            raise APIError(429, f"too many requests in flight ({self.pending}); retry later",
                           code="server_overloaded", retry_after_s=1.0)
        self.pending += 1
        self.metrics.in_flight.set(self.pending)

    def release(self) -> None:
        self.pending -= 1
        self.metrics.in_flight.set(self.pending)

    def start_draining(self, cancel_after_s: float | None = None) -> None:
        """Refuses new requests from now on; with `cancel_after_s`, cancels the requests still running then
        (their clients get a `shutting_down` error; thread-safe: called from a signal handler)."""
        self.draining = True
        self.metrics.draining.set(1)
        loop = self.loop
        if cancel_after_s is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.call_later, cancel_after_s,
                                      lambda: loop.create_task(self.cancel_all()))

    async def cancel_all(self) -> None:
        for s in list(self.streams):
            await _close(self, s)

    # -- documents ---------------------------------------------------------------------------------------
    def resolve(self, refs: list[Any] | None) -> list[Document]:
        """A request's `documents`: inline ones ({id, text, title?}) are validated (and remembered by id), bare
        ids looked up."""
        out = []
        for i, ref in enumerate(refs or []):
            if isinstance(ref, dict):
                try:
                    ref = DocumentIn.model_validate(ref)
                except ValidationError as e:
                    first = e.errors()[0]
                    where = ".".join(str(p) for p in first["loc"])
                    raise APIError(400, f"documents[{i}]{'.' + where if where else ''}: {first['msg']} (a document "
                                        f"is {{id, text, title?}} or the id of one registered before)",
                                   param=f"documents[{i}]") from None
            elif not isinstance(ref, (str, DocumentIn)):
                raise APIError(400, f"documents[{i}] must be an object {{id, text, title?}} or a document id "
                                    f"(string), got {type(ref).__name__}", param=f"documents[{i}]")
            if isinstance(ref, str):
                doc = self.documents.get(ref)
                if doc is None:
                    raise APIError(400, f"unknown document id {ref!r}: register it with POST /v1/documents or "
                                        f"give its text", param=f"documents[{i}]", code="unknown_document")
            else:
                try:
                    doc = Document(str(ref.id), ref.text, ref.title.strip())
                except ValueError as e:
                    raise APIError(400, f"documents[{i}]: {e}", param=f"documents[{i}]") from None
                self.documents[doc.id] = doc
            out.append(doc)
        return out


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


def _inline_documents(messages: list[dict[str, str]], docs: list[Document]) -> list[dict[str, str]]:
    """Places the request's documents that no message contains at the head of the last user turn (title line,
    body, blank line: as the engine lays documents out), where the chat path finds and fuses them."""
    missing = [d for d in docs if not any(d.text in m["content"] for m in messages)]
    if not missing:
        return messages
    head = "".join((f"{d.title}\n" if d.title else "") + d.text + "\n\n" for d in missing)
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = list(messages)
    out[last] = {"role": "user", "content": head + messages[last]["content"]}
    return out


def _engine_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloaded):
        return APIError(429, str(exc) or "the engine is overloaded", code="engine_overloaded",
                        retry_after_s=getattr(exc, "retry_after_s", 1.0))
    if isinstance(exc, (ValueError, KeyError)):
        msg = str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
        code = "context_length_exceeded" if "context window" in msg else None
        return APIError(400, msg, code=code)
    log.exception("request failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}")


_SHUT_DOWN = APIError(503, "the server shut down before the answer was complete", code="shutting_down",
                      retry_after_s=1.0)


def _usage(result) -> dict[str, Any]:
    u = result.usage()
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"], "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}


def _extension(result) -> dict[str, Any]:
    """kvfuse's own numbers about a request, next to the OpenAI fields."""
    return {"strategy": result.strategy, "recompute_ratio": result.recompute_ratio,
            "recompute_fraction": result.recompute_fraction, "cache_hits": result.cache_hits,
            "cache_misses": result.cache_misses, "stale": result.stale, "ttft_s": result.ttft_s,
            "queue_s": result.queue_s, "prefill_s": result.prefill_s, "decode_s": result.decode_s,
            "selection_s": result.selection_s, "miss_prefill_s": result.miss_prefill_s,
            "prompt_tokens": result.prompt_tokens, "doc_tokens": result.doc_tokens,
            "question_tokens": result.question_tokens, "recomputed_tokens": result.recomputed_tokens,
            "finish_reason": result.finish_reason, "documents": list(result.extra.get("documents", [])),
            **({"auto": result.extra["auto"]} if "auto" in result.extra else {}),
            **{k: result.extra[k] for k in ("cold", "guard") if k in result.extra}}


def _finish(result) -> str:
    return result.finish_reason if result.finish_reason in ("stop", "length") else "stop"


class _Shapes:
    """The OpenAI object shapes of one endpoint (chat or text completions)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def response(self, text: str, result) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": _finish(result)}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish(result)}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": _usage(result),
                "system_fingerprint": None, "kvfuse": _extension(result)}

    def chunk(self, delta: str | None, finish: str | None = None, *, first: bool = False,
              usage: bool = False) -> dict[str, Any]:
        if self.chat:
            d: dict[str, Any] = {}
            if first:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice], "system_fingerprint": None}
        if usage:
            out["usage"] = None
        return out

    def usage_chunk(self, result) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": _usage(result),
                "system_fingerprint": None, "kvfuse": _extension(result)}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that runs `on_end` however the response ends (even when the body never started)."""

    def __init__(self, body, on_end) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_end()


async def _generate(state: ServerState, endpoint: str, req, start) -> Response:
    """Runs one generation request: admitted, started, and answered as JSON or as server-sent events."""
    state.admit()
    t0 = time.perf_counter()
    shapes = _Shapes(endpoint == "chat", state.model_name)
    stream = None
    handed_over = False
    try:
        try:
            stream = start()
            state.streams.add(stream)
            if not req.stream:
                parts = [d async for d in stream]
                result = stream.result
                if result is None or result.finish_reason == "cancelled":
                    state.metrics.cancelled(endpoint)
                    raise _SHUT_DOWN
                state.metrics.observe(endpoint, result, time.perf_counter() - t0)
                return JSONResponse(shapes.response("".join(parts), result))
            first = await anext(stream, None)  # errors before the first token are still an HTTP error
        except Exception as exc:  # noqa: BLE001 - every failure is answered in OpenAI's shape
            raise _engine_error(exc) from None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        done = {"observed": False}

        async def events():
            if shapes.chat:  # the role first, as OpenAI sends it
                yield _sse(shapes.chunk("", first=True, usage=include_usage))
            if first:
                yield _sse(shapes.chunk(first, usage=include_usage))
            try:
                async for delta in stream:
                    yield _sse(shapes.chunk(delta, usage=include_usage))
            except Exception as exc:  # noqa: BLE001 - the status is sent: an error event ends the stream
                yield _sse(error_body(_engine_error(exc)))
                return
            result = stream.result
            if result is None or result.finish_reason == "cancelled":  # closed by the shutdown, not the client
                yield _sse(error_body(_SHUT_DOWN))
                return
            state.metrics.observe(endpoint, result, time.perf_counter() - t0)
            done["observed"] = True
            yield _sse(shapes.chunk(None, _finish(result), usage=include_usage))
            if include_usage:
                yield _sse(shapes.usage_chunk(result))
            yield "data: [DONE]\n\n"

        async def on_end():
            await _close(state, stream)
            if not done["observed"]:
                state.metrics.cancelled(endpoint)
            state.release()

        handed_over = True
        return _ClosingStream(events(), on_end)
    finally:
        if not handed_over:
            with anyio.CancelScope(shield=True):
                if stream is not None:
                    await _close(state, stream)
            state.release()


async def _close(state: ServerState, stream) -> None:
    state.streams.discard(stream)
    try:
        await stream.aclose()
    except Exception:  # noqa: BLE001 - closing must not mask the request's own outcome
        log.exception("closing an engine stream failed")


def create_app(engine, *, model_name: str | None = None, api_key: str | None = None, max_pending: int = 64,
               default_max_tokens: int = 256, owns_engine: bool = False) -> FastAPI:
    """The FastAPI app serving `engine`.

    Args:
        model_name: the `model` clients must name (default: the engine's model name).
        api_key: when set, /v1/* requires `Authorization: Bearer <api_key>` (/health and /metrics stay open).
        max_pending: generation requests in flight at most; past it, 429 with Retry-After.
        default_max_tokens: the answer length when a request gives none.
        owns_engine: shut the engine down (`shutdown()` or `close()`) when the app stops.
    """
    state = ServerState(engine, model_name=model_name, api_key=api_key, max_pending=max_pending,
                        default_max_tokens=default_max_tokens, owns_engine=owns_engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        yield
        state.start_draining()
        await state.cancel_all()  # whatever the graceful period left running
        if owns_engine:
            stop = getattr(engine, "shutdown", None) or getattr(engine, "close", None)
            if stop is not None:
                await asyncio.to_thread(stop)

    app = FastAPI(title="kvfuse", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvfuse = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        state.metrics.errors.labels(str(exc.status)).inc()
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = f"{param}: {first.get('msg', 'invalid request')}" if param else first.get("msg", "invalid request")
        if len(errs) > 1:
            msg += f" (and {len(errs) - 1} more problems)"
        return await _api_error(request, APIError(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return await _api_error(request, APIError(exc.status_code, str(exc.detail)))

    async def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatRequest):
        _check_model(state, req.model)
        req.refuse_unsupported()
        opts = engine_options(req, state.default_max_tokens)
        docs = state.resolve(req.documents)
        messages = _inline_documents(chat_messages(req.messages), docs)
        return await _generate(state, "chat", req, lambda: engine.astream_chat(messages, docs, **opts))

    @v1.post("/completions")
    async def completions(req: CompletionRequest):
        _check_model(state, req.model)
        req.refuse_unsupported()
        opts = engine_options(req, state.default_max_tokens)
        docs = state.resolve(req.documents)
        question = req.question()
        return await _generate(state, "completions", req, lambda: engine.astream(question, docs, **opts))

    @v1.get("/models")
    async def models():
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "kvfuse"}
        window = getattr(engine, "context_window", None)
        if window:
            card["context_window"] = int(window)
        fmt = getattr(getattr(engine, "prompts", None), "fmt", None)
        if fmt is not None:  # how the engine lays documents out (clients that write them into a chat use it)
            card["kvfuse"] = {"prompt_format": {"instruction": fmt.instruction, "doc_suffix": fmt.doc_suffix,
                                                "question_template": fmt.question_template}}
        return {"object": "list", "data": [card]}

    @v1.post("/documents")
    async def add_documents(req: DocumentsRequest):
        if state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down", retry_after_s=1.0)
        docs = state.resolve(req.documents)
        try:
            searchable = await asyncio.to_thread(engine.register, docs)
            report = await asyncio.to_thread(engine.precompute, docs, req.strategy) if req.precompute else None
        except Exception as exc:  # noqa: BLE001
            raise _engine_error(exc) from None
        out = {"object": "list", "ids": [d.id for d in docs], "registered": len(docs), "searchable": searchable}
        if report is not None:
            out.update(computed=report.misses, cached=report.hits, tokens=report.tokens, seconds=report.seconds)
        return out

    @v1.get("/documents/{doc_id}")
    async def get_document(doc_id: str):
        doc = state.documents.get(doc_id)
        if doc is None:
            raise APIError(404, f"unknown document id {doc_id!r}", param="id", code="unknown_document")
        return {"id": doc.id, "object": "document", "title": doc.title, "text": doc.text}

    @v1.delete("/documents/{doc_id}")
    async def delete_document(doc_id: str):
        known = state.documents.pop(doc_id, None) is not None
        forgotten = await asyncio.to_thread(engine.forget, [doc_id])
        if not known and not forgotten:
            raise APIError(404, f"unknown document id {doc_id!r}", param="id", code="unknown_document")
        return {"id": doc_id, "object": "document", "deleted": True}

    app.include_router(v1)

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "1"})
        out = {"status": "ok", "model": state.model_name, "in_flight": state.pending}
        if state.warmup is not None:
            out["warmup"] = state.warmup
        return out

    @app.get("/metrics")
    async def metrics():
        body = await asyncio.to_thread(state.metrics.exposition)
        return Response(body, media_type=CONTENT_TYPE)

    return app
