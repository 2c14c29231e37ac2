"""Request and result types shared by the API, the CLI, the eval harness and the integrations.

No tensor math here: plain dataclasses that every layer above the runner can import cheaply.
"""
from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from .validate import check_doc_id, check_token_ids, lone_surrogate

__all__ = ["Document", "GenerationResult", "PrecomputeReport", "GenerationStream", "as_documents"]


@dataclass(frozen=True)
class Document:
    """One retrieved document, given as text or as token ids.

    Args:
        id: the caller's handle (a node id, a passage id). Used to find the cache quickly; the content
            is always verified, so a changed text under the same id is recomputed, never served stale.
        text: the document's body exactly as it should appear in the prompt. The body is what is cached, so the
            same passage hits the same cache from every entry point (a CLI record, a LangChain document, a
            LlamaIndex node). Empty when the document is given as `token_ids`.
        title: optional; shown on its own line before the body and always computed (never part of the cache).
        token_ids: the document as token ids instead of text: exactly the tokens it occupies in the prompt,
            nothing added (a text document's are `engine.prompts.encode_document(doc)`, the prompt format's
            `doc_suffix` included). They are its cache key, as a text document's tokens are (the same tokens hit
            the same cache), and no tokenizer is called for it. Any sequence of ints >= 0 or a 1-D integer tensor;
            stored as a tuple (checked against the model's vocabulary by the engine). Such a document can't be
            found inside chat messages (that search is by text).
        sift_index: optional; the document's selective index as bytes (`FusionEngine.sift_index_bytes`), carried
            with it (node or Document metadata) so that `strategy="sift"` needs no index store. It is checked at use:
            an index made for another model, tokenizer, prompt layout or text, or damaged, is never used (that
            document is prefilled densely, counted in `extra["sift"]["index_rejected"]`).
    """

    id: str
    text: str = ""
    title: str = ""
    token_ids: tuple[int, ...] | None = None
    sift_index: bytes | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"document id must be a non-empty string, got {self.id!r}")
        if lone_surrogate(self.id) is not None:
            raise ValueError(f"document id {self.id!r} contains a lone surrogate (not valid Unicode text)")
        if not isinstance(self.text, str):
            raise ValueError(f"document {self.id!r}: text must be a string, got {type(self.text).__name__}")
        if self.token_ids is not None:
            if self.text:
                raise ValueError(f"document {self.id!r}: give its text or its token_ids, not both")
            ids = check_token_ids(self.token_ids, f"document {self.id!r}: token_ids", None, allow_empty=False)
            object.__setattr__(self, "token_ids", tuple(ids))
        elif not self.text.strip():
            raise ValueError(f"document {self.id!r}: text is empty")
        at = lone_surrogate(self.text)
        if at is not None:
            raise ValueError(f"document {self.id!r}: text contains a lone surrogate {self.text[at]!r} at character "
                             f"{at} (not valid Unicode text)")
        if not isinstance(self.title, str):
            raise ValueError(f"document {self.id!r}: title must be a string, got {type(self.title).__name__}")
        if self.sift_index is not None:
            if not isinstance(self.sift_index, (bytes, bytearray, memoryview)):
                raise ValueError(f"document {self.id!r}: sift_index must be bytes (FusionEngine.sift_index_bytes), got "
                                 f"{type(self.sift_index).__name__}")
            object.__setattr__(self, "sift_index", bytes(self.sift_index))
        if lone_surrogate(self.title) is not None:
            raise ValueError(f"document {self.id!r}: title contains a lone surrogate (not valid Unicode text)")


def as_documents(docs: Iterable[Any]) -> list[Document]:
    """Normalises `(id, text)` pairs, mappings with `id`/`text` (or `token_ids`; optional `title`), or Documents.

    Raises:
        ValueError: on anything else, naming the offending position.
    """
    if docs is None:
        return []
    if isinstance(docs, (str, bytes)):
        raise ValueError("docs must be a list of (id, text) pairs, not a single string")
    if isinstance(docs, Mapping) or not isinstance(docs, Iterable):
        raise ValueError(f"docs must be a list of (id, text) pairs, mappings or Documents, got {type(docs).__name__}")
    out: list[Document] = []
    for i, d in enumerate(docs):
        if isinstance(d, Document):
            out.append(d)
        elif isinstance(d, Mapping):
            ids = d.get("token_ids")
            if "text" not in d and ids is None:
                raise ValueError(f"docs[{i}]: mapping has no 'text' key")
            text, title = d.get("text", ""), d.get("title")
            if not isinstance(text, str):
                raise ValueError(f"docs[{i}]: 'text' must be a string, got {type(text).__name__}")
            if title is not None and not isinstance(title, str):
                raise ValueError(f"docs[{i}]: 'title' must be a string, got {type(title).__name__}")
            did = next((d[k] for k in ("id", "doc_id") if d.get(k) not in (None, "")), f"doc-{i}")
            out.append(Document(check_doc_id(did, f"docs[{i}] id"), text, (title or "").strip(), ids,
                                d.get("sift_index")))
        elif isinstance(d, (tuple, list)) and len(d) == 2:
            out.append(Document(check_doc_id(d[0], f"docs[{i}] id"), d[1]))
        else:
            raise ValueError(f"docs[{i}]: expected (id, text), a mapping or a Document, got {type(d).__name__}")
    return out


@dataclass
class GenerationResult:
    """What one `FusionEngine.generate` call produced, with its costs.

    Times are seconds, measured on the host after device synchronisation.
    """

    text: str
    token_ids: list[int]
    strategy: str
    recompute_ratio: float
    # "stop" (end-of-turn token or stop string) | "length" | "cancelled" (a stream closed or dropped before its
    # end: decoding stopped early, `text` is what was decoded so far and `extra` has no "logprobs")
    finish_reason: str
    ttft_s: float  # call -> first token's logits (waiting for the engine, tokenize, lookup, misses, selection,
    # fused prefill)
    prefill_s: float  # fused prefill alone (selection included)
    decode_s: float  # every token after the first
    selection_s: float  # time the strategy spent choosing tokens
    miss_prefill_s: float  # time spent computing caches of documents that missed
    prompt_tokens: int
    doc_tokens: int
    question_tokens: int  # question + chat suffix, always recomputed
    recomputed_tokens: int  # document tokens recomputed by the strategy (question excluded)
    cache_hits: int
    cache_misses: int
    stale: int = 0  # documents whose id was known but whose content changed (recomputed)
    recomputed_positions: list[int] = field(default_factory=list)  # their prompt positions (empty for full)
    doc_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each document, prompt order
    extra: dict[str, Any] = field(default_factory=dict)
    queue_s: float = 0.0  # of ttft_s, the time spent waiting for the engine (other requests computing)

    def usage(self) -> dict[str, int]:
        """Token counts as the frameworks name them: prompt, completion, total, and cached (document tokens served
        from their caches, not recomputed)."""
        cached = max(0, self.doc_tokens - self.recomputed_tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.token_ids),
                "total_tokens": self.prompt_tokens + len(self.token_ids), "cached_tokens": cached}

    @property
    def recompute_fraction(self) -> float:
        """Recomputed document tokens over all document tokens (0 when there are no documents)."""
        return self.recomputed_tokens / self.doc_tokens if self.doc_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["recompute_fraction"] = self.recompute_fraction
        return d


@dataclass
class PrecomputeReport:
    """Result of `FusionEngine.precompute`."""

    hits: int
    misses: int
    tokens: int
    seconds: float


_DELTA, _DONE, _ERROR = "delta", "done", "error"


class GenerationStream:
    """Iterator over text deltas; `.result` holds the GenerationResult once exhausted.

    The first `next()` submits the request to the engine's scheduler, which computes it beside other requests
    (continuous batching) and pushes its deltas into a queue this reader drains, from any thread: a slow reader,
    or one that stopped reading, delays no other request. An error (e.g. a prompt over the context window, or
    EngineOverloaded when the engine's queue is full) is raised by `next()`, after the deltas before it.

    `close()`, and the stream being garbage-collected, set `cancel`: the request leaves the batch at the next
    decode step (finish_reason "cancelled") and its rows are freed. `close()` waits for that, keeps the
    GenerationResult in `.result` (None when closed before computing began); `next()` then raises StopIteration.

    Args:
        request: the engine's request (its `sink` is set here, its `cancel` is ours).
        submit: hands the request to the scheduler.
    """

    def __init__(self, request: Any, submit: Callable[[Any], None]) -> None:
        self._request: Any = request
        self._submit = submit
        self.result: GenerationResult | None = None
        self.cancel: threading.Event = request.cancel
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        request.sink = self._queue.put
        self._started = False
        self._finished = False  # DONE or ERROR taken from the queue
        self._done = False  # exhausted, failed or closed: next() raises StopIteration
        self._guard = threading.Lock()
        self._finalizer = weakref.finalize(self, self.cancel.set)  # the scheduler holds the request, not the stream

    def detach(self) -> Any:
        """Hands the (unstarted) request over to another front (the asyncio stream); this stream is spent."""
        self._finalizer.detach()
        self._done = True
        return self._request

    def __iter__(self) -> GenerationStream:
        return self

    def _start(self) -> None:
        with self._guard:
            if self._done:
                raise StopIteration
            if not self._started:
                self._started = True
                try:
                    self._submit(self._request)
                except BaseException:
                    self._done = self._finished = True
                    raise

    def __next__(self) -> str:
        self._start()
        kind, value = self._queue.get()
        if kind == _DELTA:
            return value
        self._done = True
        _settle(self, kind, value)
        if kind == _DONE:
            raise StopIteration
        raise value

    def wait(self) -> GenerationResult | None:
        """Runs the request to its end (deltas discarded) and returns `.result`; raises its error."""
        for _ in self:
            pass
        return self.result

    def close(self) -> None:
        """Cancels the request (if still running), waits until the scheduler let it go; idempotent."""
        self.cancel.set()
        with self._guard:
            self._done = True
            started = self._started
        while started and not self._finished:
            _settle(self, *self._queue.get())


class EngineOverloaded(RuntimeError):
    """The engine's request queue is full: retry after `retry_after_s` seconds (a server answers 429/503)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AsyncGenerationStream:
    """`async for delta in stream`: the asyncio twin of GenerationStream (same request, same scheduler); deltas
    arrive through the event loop, never blocking it. `.result` once exhausted; `await aclose()` cancels."""

    def __init__(self, request: Any, submit: Callable[[Any], None]) -> None:
        self._request: Any = request
        self._submit = submit
        self.result: GenerationResult | None = None
        self.cancel: threading.Event = request.cancel
        self._queue: Any = None
        self._started = self._finished = self._done = False
        weakref.finalize(self, self.cancel.set)

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    def _start(self) -> None:
        if self._started:
            return
        import asyncio

        loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        put, cancel = self._queue.put_nowait, self.cancel

        def sink(item: tuple[str, Any]) -> None:
            try:
                loop.call_soon_threadsafe(put, item)
            except RuntimeError:  # the loop is gone: nobody reads this request any more
                cancel.set()

        self._request.sink = sink
        self._started = True
        try:
            self._submit(self._request)
        except BaseException:
            self._done = self._finished = True
            raise

    async def __anext__(self) -> str:
        if self._done:
            raise StopAsyncIteration
        self._start()
        kind, value = await self._queue.get()
        if kind == _DELTA:
            return value
        self._done = True
        _settle(self, kind, value)
        if kind == _DONE:
            raise StopAsyncIteration
        raise value

    async def aclose(self) -> None:
        """Cancels the request and waits until the scheduler let it go; idempotent."""
        self.cancel.set()
        self._done = True
        while self._started and not self._finished:
            _settle(self, *await self._queue.get())


def _settle(stream: Any, kind: str, value: Any) -> None:
    """Records the end of a stream's request (DONE: its result; ERROR: nothing); deltas are ignored.

    The end is put back into the queue: whoever else waits on it (a second closer, a reader racing a closer)
    takes it too instead of waiting for an item that will never come."""
    if kind == _DELTA:
        return
    stream._queue.put_nowait((kind, value))
    stream._finished = True
    if kind == _DONE and stream.result is None:
        stream.result = value
