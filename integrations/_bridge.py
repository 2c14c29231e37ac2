"""Framework-free plumbing shared by the LlamaIndex and LangChain adapters: documents, stats, async streams.

Nothing here imports LlamaIndex or LangChain, so it can be tested and reused without either installed.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvfuse.engine.types import GenerationResult

__all__ = ["content_id", "result_stats", "adeltas", "arun", "GENERATION_OPTIONS", "SIFT_METADATA_KEY",
           "encode_index", "decode_index", "is_index_strategy"]

#: The metadata key under which a node / LangChain Document carries its sift index (base64 of
#: `FusionEngine.sift_index_bytes`); the integrations keep it out of the embedded and the LLM's text.
SIFT_METADATA_KEY = "kvfuse_sift_index"

#: Per-call options forwarded to `FusionEngine.generate` / `.stream` (everything else is rejected).
GENERATION_OPTIONS = ("strategy", "recompute_ratio", "max_new_tokens", "temperature", "top_p", "seed", "stop",
                      "guard_margin", "guard_tokens", "guard_at")


def content_id(text: str) -> str:
    """A stable handle for a document that has no id of its own: `"sha256:"` + 32 hex chars of its text.

    The engine keys its caches by content anyway; this only gives equal texts equal handles.
    """
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def encode_index(data: bytes) -> str:
    """A sift index as metadata: ASCII base64 (JSON-safe, as every docstore and vector store needs)."""
    return base64.b64encode(data).decode("ascii")


def decode_index(value: Any) -> bytes | None:
    """The index bytes a metadata value carries; None when there is none. A value that is not valid base64 comes
    back as empty bytes, so the engine counts it as a rejected index (the document is prefilled densely)."""
    if value is None:
        return None
    try:
        return base64.b64decode(value, validate=True) if isinstance(value, (str, bytes)) else b""
    except (binascii.Error, ValueError):
        return b""


def is_index_strategy(strategy: Any) -> bool:
    """True when `strategy` (a name, a spec string or a Strategy) keeps selective indexes instead of K/V caches."""
    if strategy is None:
        return False
    from kvfuse.engine.fusion import make_strategy

    return bool(getattr(make_strategy(strategy), "sparse_index", False))


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
    stats.pop("token_ids", None)
    stats["output_tokens"] = int(result.usage()["completion_tokens"])
    return stats


async def adeltas(stream: Any, timeout: float | None = None,
                  on_timeout: Callable[[int], BaseException] | None = None) -> AsyncIterator[str]:
    """The text deltas of an engine's async stream (`engine.astream(...)` / `astream_chat(...)`, or a remote
    engine's), awaited on the event loop: no thread per request. The stream is always closed (`aclose()`) when
    this ends, however it ends: exhausted, an error, the consumer stopping early (close this generator, e.g. with
    `contextlib.aclosing`), the task being cancelled, or the deadline; closing cancels the request, which
    leaves the engine's batch at its next decode step.

    Args:
        stream: an async iterator of text deltas with `aclose()`; `.result` holds the result once exhausted.
        timeout: seconds from now for the whole answer (None: no limit). Past it the request is cancelled and
            `on_timeout(deltas received)` is raised (a plain TimeoutError without it).
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    received = 0
    try:
        while True:
            try:
                if deadline is None:
                    delta = await anext(stream)
                else:
                    async with asyncio.timeout_at(deadline):
                        delta = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if deadline is not None and loop.time() >= deadline:
                    raise (on_timeout(received) if on_timeout else TimeoutError(
                        f"no complete answer within {timeout:g}s")) from None
                raise
            received += 1
            yield delta
    finally:
        await stream.aclose()


async def arun(stream: Any, timeout: float | None = None,
               on_timeout: Callable[[int], BaseException] | None = None) -> Any:
    """Runs an async engine stream to its end (deltas discarded) and returns its `.result`; closes it however
    the call ends, so a cancelled or timed-out task cancels the engine request (see `adeltas`)."""
    deltas = adeltas(stream, timeout, on_timeout)
    try:
        async for _ in deltas:
            pass
    finally:
        await deltas.aclose()
    return stream.result
