"""Framework-free plumbing shared by the LlamaIndex and LangChain adapters: documents, stats, threads.

Nothing here imports LlamaIndex or LangChain, so it can be tested and reused without either installed.
"""
from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

from kvfuse.engine.types import GenerationResult

__all__ = ["content_id", "result_stats", "iterate_in_thread", "GENERATION_OPTIONS"]

T = TypeVar("T")

#: Per-call options forwarded to `FusionEngine.generate` / `.stream` (everything else is rejected).
GENERATION_OPTIONS = ("strategy", "recompute_ratio", "max_new_tokens", "temperature", "top_p", "seed", "stop")


def content_id(text: str) -> str:
    """A stable handle for a document that has no id of its own: `"sha256:"` + 32 hex chars of its text.

    The engine keys its caches by content anyway; this only gives equal texts equal handles.
    """
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def result_stats(result: GenerationResult | None) -> dict[str, Any]:
    """The JSON-friendly cost record of one generation (`GenerationResult.as_dict()` without token ids).

    Keys: strategy, recompute_ratio, finish_reason, ttft_s, prefill_s, decode_s, selection_s, miss_prefill_s,
    prompt_tokens, doc_tokens, question_tokens, recomputed_tokens, recompute_fraction, cache_hits,
    cache_misses, stale, extra, and output_tokens (the number of generated tokens). Empty without a result.
    """
    if result is None:
        return {}
    stats = result.as_dict()
    stats.pop("text", None)
    stats["output_tokens"] = len(stats.pop("token_ids", None) or [])
    return stats


_ITEM, _DONE, _ERROR = object(), object(), object()


async def iterate_in_thread(make_iterator: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Runs a blocking iterator in one worker thread and yields its items without blocking the event loop.

    The whole iteration happens on a single thread (torch's grad/inference mode is thread-local, so a stream
    must not hop between pool threads). If the consumer stops early, the worker stops after the item it is
    computing and closes the iterator.

    Args:
        make_iterator: called on the worker thread; returns the iterator to drain.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[object, Any]] = asyncio.Queue()
    cancelled = threading.Event()

    def post(kind: object, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            cancelled.set()

    def work() -> None:
        try:
            iterator = make_iterator()
            try:
                for item in iterator:
                    if cancelled.is_set():
                        break
                    post(_ITEM, item)
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
        except BaseException as exc:  # handed to the consumer, re-raised there
            post(_ERROR, exc)
        else:
            post(_DONE, None)

    thread = threading.Thread(target=work, name="kvfuse-stream", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = await queue.get()
            if kind is _DONE:
                return
            if kind is _ERROR:
                raise value
            yield value
    finally:
        cancelled.set()
