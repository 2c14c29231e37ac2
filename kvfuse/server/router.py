"""`kvfuse route`: one OpenAI-compatible front over several `kvfuse serve` replicas (`create_router_app`).

Each replica keeps its own document caches, so the router's job is to send a request where its documents'
caches most likely are. Policies:

- "affinity" (default): a consistent-hash ring (virtual nodes) over the replicas places every document id on
  one owner (the first healthy replica clockwise from the id's hash). A request goes to the replica that owns
  the largest share of its documents, weighted by their size when the router has seen their text (inline, or
  registered through it); ties go to the owner of the first (highest-ranked) document. A replica at or over
  `max_in_flight` requests is passed over for the next one in the ranking; a request without documents goes to
  the least loaded replica. When a replica leaves the ring (unhealthy) only its documents move, each to the next
  replica clockwise, so the other replicas' caches stay useful.
- "round_robin", "random": the baselines, blind to documents.

Health: `/health` of every replica is polled every `health_interval_s` (refused, or two polls in a row late
past 5 s or failed: unhealthy); a replica that fails a request (refused connection, reset, timeout) or answers
503 (draining) is marked unhealthy at once and skipped until a poll
finds it healthy again. A request is retried on the next candidate when a replica could not be reached or
answered 429 / 503, as long as no byte of the answer was sent to the client; a stream cut in the middle ends
with an error event (its tokens can't be taken back).

Documents: `POST /v1/documents` precomputes each document on its owner only, and registers it (text, no
computation) on the other replicas, so an id stays usable after a failover; `GET` asks the owner first,
`DELETE` goes to every replica.

The router holds no model and imports no torch; it passes the Authorization header through (the replicas check
the key).
"""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import json
import logging
import random
from collections import OrderedDict
from typing import Any, Iterable, Sequence

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from .errors import APIError, error_body, error_response
from .metrics import CONTENT_TYPE

__all__ = ["HashRing", "Replica", "RouterState", "create_router_app", "POLICIES"]

log = logging.getLogger("kvfuse.router")

POLICIES = ("affinity", "round_robin", "random")
_RETRYABLE = (429, 503)
_FORWARDED = ("authorization", "content-type", "accept", "openai-organization", "openai-project")


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing: each node at `vnodes` points of a 64-bit ring; a key belongs to the first node
    clockwise from its hash. `preference(key)` lists every node once, in the order a key falls back through
    them when nodes leave."""

    def __init__(self, nodes: Sequence[str], vnodes: int = 160) -> None:
        if not nodes:
            raise ValueError("a hash ring needs at least one node")
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.nodes = list(dict.fromkeys(nodes))
        points = sorted((_hash(f"{node}#{i}"), node) for node in self.nodes for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [n for _, n in points]

    def preference(self, key: str) -> list[str]:
        out: list[str] = []
        i = bisect.bisect(self._hashes, _hash(key))
        for j in range(len(self._owners)):
            node = self._owners[(i + j) % len(self._owners)]
            if node not in out:
                out.append(node)
                if len(out) == len(self.nodes):
                    break
        return out

    def owner(self, key: str, alive: Iterable[str] | None = None) -> str | None:
        """The first node clockwise from `key` among `alive` (all nodes when None)."""
        alive = None if alive is None else set(alive)
        return next((n for n in self.preference(key) if alive is None or n in alive), None)


class Replica:
    """One `kvfuse serve` behind the router, as the router sees it."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.healthy = True  # until a check or a request says otherwise
        self.in_flight = 0  # requests this router has sent and not finished
        self.reported_in_flight = 0  # the replica's own count at the last health check (other routers too)
        self.last_error: str | None = None
        self.failed_polls = 0  # /health polls failed in a row

    def load(self) -> int:
        return max(self.in_flight, self.reported_in_flight)

    def as_dict(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
                "reported_in_flight": self.reported_in_flight, "last_error": self.last_error}


class _Metrics:
    def __init__(self, replicas: list[Replica]) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvfuse_router_requests", "Requests forwarded, by replica and endpoint",
                                ["replica", "endpoint"], registry=r)
        self.retries = Counter("kvfuse_router_retries", "Attempts given to another replica, by reason",
                               ["reason"], registry=r)
        self.unavailable = Counter("kvfuse_router_unavailable", "Requests no replica could take", registry=r)
        self.routed = Counter("kvfuse_router_routed", "Routing decisions by kind (affinity, load, fallback, "
                                                      "round_robin, random)", ["kind"], registry=r)
        self.doc_hits = Counter("kvfuse_router_document_hits", "Documents answered from a replica's cache "
                                                               "(non-streamed answers)", registry=r)
        self.doc_misses = Counter("kvfuse_router_document_misses", "Documents a replica computed (non-streamed "
                                                                   "answers)", registry=r)
        self.healthy = Gauge("kvfuse_router_replica_healthy", "1 while the replica is in rotation", ["replica"],
                             registry=r)
        self.in_flight = Gauge("kvfuse_router_replica_in_flight", "Requests in flight on the replica (this router)",
                               ["replica"], registry=r)
        for rep in replicas:
            self.healthy.labels(rep.url).set(1)
            self.in_flight.labels(rep.url).set(0)


class RouterState:
    """What the routes share: the replicas, the ring, the policy, the HTTP client, document weights."""

    def __init__(self, replicas: Sequence[str], *, policy: str, vnodes: int, max_in_flight: int,
                 health_interval_s: float, request_timeout_s: float, weights_capacity: int,
                 seed: int | None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        urls = [u.rstrip("/") for u in replicas]
        if not urls:
            raise ValueError("the router needs at least one replica")
        if len(set(urls)) != len(urls):
            raise ValueError("a replica is listed twice")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if not health_interval_s > 0:
            raise ValueError(f"health_interval_s must be > 0, got {health_interval_s}")
        self.replicas = [Replica(u) for u in urls]
        self.by_url = {r.url: r for r in self.replicas}
        self.ring = HashRing(urls, vnodes)
        self.policy = policy
        self.max_in_flight = max_in_flight
        self.health_interval_s = health_interval_s
        self.request_timeout_s = request_timeout_s
        self.weights: OrderedDict[str, int] = OrderedDict()  # document id -> characters, least recent first
        self.weights_capacity = weights_capacity
        self.rng = random.Random(seed)
        self.turn = 0
        self.draining = False
        self.model_name = f"a router over {len(urls)} replicas ({policy})"  # what `serve` prints
        self.metrics = _Metrics(self.replicas)
        self.client: httpx.AsyncClient | None = None

    # -- what `serve` expects of an app's state ------------------------------------------------------------
    def start_draining(self, cancel_after_s: float | None = None) -> None:
        self.draining = True

    # -- replica state ---------------------------------------------------------------------------------
    def set_health(self, rep: Replica, healthy: bool, error: str | None = None) -> None:
        if rep.healthy != healthy:
            log.warning("kvfuse: router: replica %s is %s%s", rep.url, "back" if healthy else "out of rotation",
                        f" ({error})" if error else "")
        rep.healthy = healthy
        if error:
            rep.last_error = error
        self.metrics.healthy.labels(rep.url).set(1 if healthy else 0)

    def acquire(self, rep: Replica) -> None:
        rep.in_flight += 1
        self.metrics.in_flight.labels(rep.url).set(rep.in_flight)

    def release(self, rep: Replica) -> None:
        rep.in_flight -= 1
        self.metrics.in_flight.labels(rep.url).set(rep.in_flight)

    def remember(self, doc_id: str, chars: int) -> None:
        self.weights[doc_id] = chars
        self.weights.move_to_end(doc_id)
        while len(self.weights) > self.weights_capacity:
            self.weights.popitem(last=False)

    def owner(self, doc_id: str) -> Replica:
        alive = [r.url for r in self.replicas if r.healthy] or [r.url for r in self.replicas]
        return self.by_url[self.ring.owner(doc_id, alive)]

    # -- routing ---------------------------------------------------------------------------------------
    def candidates(self, docs: list[tuple[str, int]]) -> list[Replica]:
        """Every replica, in the order to try them: the healthy ones ranked by the policy (those at the load
        limit moved behind), then the unhealthy ones (a last resort: a health mark may be stale)."""
        healthy = [r for r in self.replicas if r.healthy]
        sick = [r for r in self.replicas if not r.healthy]
        if not healthy:
            self.metrics.routed.labels("fallback").inc()
            return sick
        if self.policy == "round_robin":
            k = self.turn % len(healthy)
            self.turn += 1
            self.metrics.routed.labels("round_robin").inc()
            return healthy[k:] + healthy[:k] + sick
        if self.policy == "random":
            self.rng.shuffle(healthy)
            self.metrics.routed.labels("random").inc()
            return healthy + sick
        ranked = self._affinity(healthy, docs)
        free = [r for r in ranked if r.load() < self.max_in_flight]
        if ranked and free and free[0] is not ranked[0]:
            self.metrics.routed.labels("load").inc()
        else:
            self.metrics.routed.labels("affinity" if docs else "load").inc()
        return free + [r for r in ranked if r not in free] + sick

    def _affinity(self, healthy: list[Replica], docs: list[tuple[str, int]]) -> list[Replica]:
        if not docs:  # nothing to be near: the least loaded, ties in turn
            self.turn += 1
            k = self.turn % len(healthy)
            order = healthy[k:] + healthy[:k]
            return sorted(order, key=lambda r: r.load())
        alive = [r.url for r in healthy]
        score = {r.url: 0.0 for r in healthy}
        for doc_id, weight in docs:
            score[self.ring.owner(doc_id, alive)] += weight
        first = self.ring.preference(docs[0][0])
        return sorted(healthy, key=lambda r: (-score[r.url], first.index(r.url), r.load()))


def _doc_keys(state: RouterState, body: Any) -> list[tuple[str, int]]:
    """A request's documents as (id, weight): inline ones weigh their text's length (and are remembered),
    ids the router has seen weigh what it remembers, others 1."""
    refs = body.get("documents") if isinstance(body, dict) else None
    if not isinstance(refs, list):
        return []
    out: list[tuple[str, int]] = []
    for ref in refs:
        if isinstance(ref, dict) and isinstance(ref.get("id"), (str, int)) and not isinstance(ref.get("id"), bool):
            doc_id, text = str(ref["id"]), ref.get("text")
            if isinstance(text, str):
                state.remember(doc_id, max(1, len(text)))
            out.append((doc_id, state.weights.get(doc_id, 1)))
        elif isinstance(ref, str):
            out.append((ref, state.weights.get(ref, 1)))
    return out


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}


def _passed_headers(resp: httpx.Response, rep: Replica) -> dict[str, str]:
    out = {"X-Kvfuse-Replica": rep.url}
    for name in ("retry-after", "www-authenticate", "cache-control", "x-accel-buffering"):
        if name in resp.headers:
            out[name] = resp.headers[name]
    return out


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class _RelayStream(StreamingResponse):
    """A replica's server-sent events relayed as they come; `on_end` runs however the response ends."""

    def __init__(self, body, status_code: int, headers: dict[str, str], media_type: str, on_end) -> None:
        super().__init__(body, status_code=status_code, headers=headers, media_type=media_type)
        self._on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_end()


def create_router_app(replicas: Sequence[str], *, policy: str = "affinity", vnodes: int = 160,
                      max_in_flight: int = 32, health_interval_s: float = 2.0, request_timeout_s: float = 600.0,
                      weights_capacity: int = 1_000_000, seed: int | None = None) -> FastAPI:
    """The router's FastAPI app over `replicas` (base URLs of `kvfuse serve`, e.g. "http://10.0.0.5:8000").

    Args:
        policy: "affinity" (consistent hashing on document ids, load fallback), "round_robin" or "random".
        vnodes: points per replica on the hash ring (more: a more even share of the documents).
        max_in_flight: a replica with this many requests in flight is passed over while another has room.
        health_interval_s: seconds between two `/health` polls of every replica.
        request_timeout_s: the longest a replica may take to answer (or between two chunks of a stream).
        weights_capacity: document sizes remembered for weighting (least recently seen forgotten beyond it).
        seed: of the "random" policy.
    """
    state = RouterState(replicas, policy=policy, vnodes=vnodes, max_in_flight=max_in_flight,
                        health_interval_s=health_interval_s, request_timeout_s=request_timeout_s,
                        weights_capacity=weights_capacity, seed=seed)

    async def check(rep: Replica) -> None:
        # a busy replica may answer late: a poll waits 5 s, and two failed polls in a row (or one failed request,
        # or a 503) take it out of rotation; one good poll brings it back
        try:
            r = await state.client.get(f"{rep.url}/health", timeout=5.0)
        except httpx.HTTPError as e:
            rep.failed_polls += 1
            if rep.failed_polls >= 2 or isinstance(e, httpx.ConnectError):
                state.set_health(rep, False, _describe(e))
            return
        if r.status_code == 200:
            rep.failed_polls = 0
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                rep.reported_in_flight = int(r.json().get("in_flight", 0))
            state.set_health(rep, True)
        else:
            rep.failed_polls += 1
            state.set_health(rep, False, f"/health answered {r.status_code}")

    async def health_loop() -> None:
        while True:
            await asyncio.gather(*(check(r) for r in state.replicas))
            await asyncio.sleep(state.health_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=5.0),
                                         limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64))
        task = asyncio.create_task(health_loop())
        try:
            yield
        finally:
            state.draining = True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await state.client.aclose()

    app = FastAPI(title="kvfuse router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvfuse = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    def admit() -> None:
        if state.draining:
            raise APIError(503, "the router is shutting down", code="shutting_down", retry_after_s=1.0)

    def unavailable(tried: list[str]) -> APIError:
        state.metrics.unavailable.inc()
        return APIError(503, f"no replica could take the request (tried {', '.join(tried) or 'none'})",
                        code="no_replica", retry_after_s=1.0)

    async def forward(request: Request, path: str, endpoint: str) -> Response:
        admit()
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None  # a replica answers the 400
        docs = _doc_keys(state, body)
        headers = _headers(request)
        tried: list[str] = []
        last: tuple[int, bytes, dict[str, str], str] | None = None
        for rep in state.candidates(docs):
            tried.append(rep.url)
            state.acquire(rep)
            released = False
            try:
                resp = await state.client.send(state.client.build_request("POST", rep.url + path, content=raw,
                                                                          headers=headers), stream=True)
            except httpx.HTTPError as e:  # not reached, reset, timed out: nothing was sent to the client yet
                state.release(rep)
                state.set_health(rep, False, _describe(e))
                state.metrics.retries.labels("unreachable").inc()
                continue
            try:
                if resp.status_code in _RETRYABLE:
                    content = await resp.aread()
                    last = (resp.status_code, content, _passed_headers(resp, rep),
                            resp.headers.get("content-type", "application/json"))
                    if resp.status_code == 503:
                        state.set_health(rep, False, "answered 503")
                    state.metrics.retries.labels(str(resp.status_code)).inc()
                    continue
                state.metrics.requests.labels(rep.url, endpoint).inc()
                media = resp.headers.get("content-type", "application/json")
                if not media.startswith("text/event-stream"):
                    content = await resp.aread()
                    _count_hits(state, content)
                    return Response(content, status_code=resp.status_code, headers=_passed_headers(resp, rep),
                                    media_type=media)
                released = True  # the relay's end releases it
                return _relay(state, rep, resp, media)
            except httpx.HTTPError as e:  # the replica went away while answering (before the relay started)
                state.set_health(rep, False, _describe(e))
                state.metrics.retries.labels("unreachable").inc()
                continue
            finally:
                if not released:
                    await resp.aclose()
                    state.release(rep)
        if last is not None:  # every replica was busy or draining: the last answer, as the replica gave it
            status, content, hdrs, media = last
            return Response(content, status_code=status, headers=hdrs, media_type=media)
        raise unavailable(tried)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await forward(request, "/v1/chat/completions", "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions", "completions")

    async def first_answer(method: str, path: str, request: Request, order: list[Replica],
                           content: bytes | None = None) -> Response:
        """`path` asked of the replicas in `order` until one answers (any status but 5xx)."""
        tried = []
        for rep in order:
            tried.append(rep.url)
            try:
                r = await state.client.request(method, rep.url + path, headers=_headers(request), content=content)
            except httpx.HTTPError as e:
                state.set_health(rep, False, _describe(e))
                continue
            if r.status_code < 500:
                return Response(r.content, status_code=r.status_code, headers=_passed_headers(r, rep),
                                media_type=r.headers.get("content-type"))
        raise unavailable(tried)

    @app.get("/v1/models")
    async def models(request: Request):
        return await first_answer("GET", "/v1/models", request, state.candidates([]))

    @app.post("/v1/documents")
    async def add_documents(request: Request):
        admit()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        refs = body.get("documents") if isinstance(body, dict) else None
        if not isinstance(refs, list) or not refs or not all(
                isinstance(d, dict) and isinstance(d.get("id"), (str, int)) for d in refs):
            # not a list of documents: the first replica explains what is wrong with it
            return await first_answer("POST", "/v1/documents", request, state.candidates([]), raw)
        extra = {k: v for k, v in body.items() if k != "documents"}
        for d in refs:
            if isinstance(d.get("text"), str):
                state.remember(str(d["id"]), max(1, len(d["text"])))
        return await register(request, refs, extra)

    async def register(request: Request, refs: list[dict], extra: dict[str, Any]) -> Response:
        """Each document precomputed on its owner; then registered (no computation) on the other replicas."""
        headers = _headers(request)
        placement: dict[str, str] = {}
        totals = {"computed": 0, "cached": 0, "tokens": 0, "seconds": 0.0, "searchable": 0}
        pending = list(refs)
        for _ in range(len(state.replicas)):
            groups: dict[str, list[dict]] = {}
            for d in pending:
                groups.setdefault(state.owner(str(d["id"])).url, []).append(d)
            pending = []
            for url, group in groups.items():
                rep = state.by_url[url]
                try:
                    r = await state.client.post(f"{url}/v1/documents", json={"documents": group, **extra},
                                                headers=headers)
                except httpx.HTTPError as e:
                    state.set_health(rep, False, _describe(e))
                    pending.extend(group)  # to the next owner on the ring
                    continue
                if r.status_code == 503:
                    state.set_health(rep, False, "answered 503")
                    pending.extend(group)
                    continue
                if r.status_code != 200:  # the documents' own fault (400) or the key's (401): as the replica said
                    return Response(r.content, status_code=r.status_code, headers=_passed_headers(r, rep),
                                    media_type=r.headers.get("content-type"))
                out = r.json()
                for k in totals:
                    totals[k] += out.get(k, 0) or 0
                placement.update((str(d["id"]), url) for d in group)
            if not pending:
                break
        if pending:
            raise unavailable([r.url for r in state.replicas])
        others = [r for r in state.replicas if r.healthy]
        register_only = {**{k: v for k, v in extra.items() if k != "strategy"}, "precompute": False}

        async def spread(rep: Replica) -> None:
            mine = [d for d in refs if placement[str(d["id"])] != rep.url]
            if not mine:
                return
            try:
                await state.client.post(f"{rep.url}/v1/documents", json={"documents": mine, **register_only},
                                        headers=headers)
            except httpx.HTTPError as e:
                state.set_health(rep, False, _describe(e))

        await asyncio.gather(*(spread(r) for r in others))
        ids = [str(d["id"]) for d in refs]
        out = {"object": "list", "ids": ids, "registered": len(ids), "searchable": totals["searchable"],
               "placement": placement}
        if extra.get("precompute", True):
            out.update(computed=totals["computed"], cached=totals["cached"], tokens=totals["tokens"],
                       seconds=totals["seconds"])
        return JSONResponse(out)

    @app.get("/v1/documents/{doc_id}")
    async def get_document(doc_id: str, request: Request):
        owner = state.owner(doc_id)
        order = [owner] + [r for r in state.replicas if r is not owner and r.healthy]
        return await first_answer("GET", f"/v1/documents/{_quote(doc_id)}", request, order)

    @app.delete("/v1/documents/{doc_id}")
    async def delete_document(doc_id: str, request: Request):
        state.weights.pop(doc_id, None)
        answers: list[httpx.Response] = []

        async def one(rep: Replica) -> None:
            try:
                answers.append(await state.client.delete(f"{rep.url}/v1/documents/{_quote(doc_id)}",
                                                         headers=_headers(request)))
            except httpx.HTTPError as e:
                state.set_health(rep, False, _describe(e))

        await asyncio.gather(*(one(r) for r in state.replicas if r.healthy))
        ok = [a for a in answers if a.status_code == 200]
        if ok:
            return Response(ok[0].content, media_type=ok[0].headers.get("content-type"))
        if answers:
            a = answers[0]
            return Response(a.content, status_code=a.status_code, media_type=a.headers.get("content-type"))
        raise unavailable([r.url for r in state.replicas])

    @app.get("/health")
    async def health():
        up = sum(r.healthy for r in state.replicas)
        body = {"status": "draining" if state.draining else "ok" if up else "unavailable", "policy": state.policy,
                "replicas": [r.as_dict() for r in state.replicas], "healthy_replicas": up,
                "in_flight": sum(r.in_flight for r in state.replicas)}
        if state.draining or not up:
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        return body

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE)

    return app


def _quote(doc_id: str) -> str:
    from urllib.parse import quote

    return quote(doc_id, safe="")


def _count_hits(state: RouterState, content: bytes) -> None:
    try:
        ext = json.loads(content).get("kvfuse") or {}
    except (ValueError, AttributeError):
        return
    state.metrics.doc_hits.inc(ext.get("cache_hits") or 0)
    state.metrics.doc_misses.inc(ext.get("cache_misses") or 0)


def _relay(state: RouterState, rep: Replica, resp: httpx.Response, media: str) -> Response:
    async def body():
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # the replica died mid-answer: what was sent stands, the stream ends in error
            state.set_health(rep, False, _describe(e))
            err = APIError(502, f"the replica serving this stream failed: {_describe(e)}", code="replica_failed")
            yield f"data: {json.dumps(error_body(err))}\n\n".encode()

    async def on_end():
        await resp.aclose()
        state.release(rep)

    return _RelayStream(body(), resp.status_code, _passed_headers(resp, rep), media, on_end)

