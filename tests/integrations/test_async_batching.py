"""The adapters' async paths await the engine's asyncio fronts: concurrent calls are decoded together (the
scheduler's batch), give the sync answers, and a cancelled task or a timeout cancels its engine request."""
from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("langchain_core")

from kvfuse.engine.api import FusionEngine  # noqa: E402
from kvfuse.integrations.langchain import ChatKVFuse, FusionRunnable  # noqa: E402
from kvfuse.integrations.llama_index import FusionLLM  # noqa: E402

DOCS = [("lark", "The Larkspur Observatory was built in 1887 on the slopes above the harbour town of Dunmore."),
        ("voss", "Its first director, Amelia Voss, was born in Dunmore and measured double stars for forty years."),
        ("quillon", "The Quillon festival was founded in 1923 by Tomas Reyes; every spring the streets fill up.")]
QUESTIONS = ["When was it built?", "Who was the director?", "Who founded the festival?", "Where is Dunmore?"]


@pytest.fixture
def engine(tiny_model):
    eng = FusionEngine.from_pretrained(str(tiny_model("llama")), device="cpu", dtype="fp32", disk_cache=False)
    yield eng
    eng.close()


async def _idle(engine, done: int, timeout: float = 10.0) -> dict:
    """The engine's stats once nothing runs or waits and `done` requests have ended (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.serving_stats()
        idle = stats["running"] == 0 and stats["queued"] == 0 and stats["requests_done"] >= done
        if idle or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.01)


def test_concurrent_acomplete_and_achat_are_batched_and_equal_sync(engine):
    llm = FusionLLM(engine=engine, max_tokens=12)
    sync = [llm.complete(q, documents=DOCS).text for q in QUESTIONS]
    assert engine.serving_stats()["peak_batch_size"] == 1

    async def run():
        done = await asyncio.gather(*(llm.acomplete(q, documents=DOCS) for q in QUESTIONS))
        return [r.text for r in done], done[0]

    texts, first = asyncio.run(run())
    assert texts == sync
    assert engine.serving_stats()["peak_batch_size"] > 1
    assert first.raw["usage"]["cached_tokens"] > 0 and first.additional_kwargs["cache_hits"] == 3


def test_concurrent_langchain_ainvoke_and_runnable_are_batched(engine):
    chat = ChatKVFuse(engine=engine, max_tokens=12)
    sync = [chat.invoke(q, documents=DOCS).content for q in QUESTIONS]
    runnable = FusionRunnable(engine, max_tokens=12)

    async def run():
        msgs = await asyncio.gather(*(chat.ainvoke(q, documents=DOCS) for q in QUESTIONS))
        outs = await asyncio.gather(*(runnable.ainvoke({"question": q, "documents": DOCS}) for q in QUESTIONS))
        return [m.content for m in msgs], [o["answer"] for o in outs]

    chats, answers = asyncio.run(run())
    assert chats == sync and answers == sync
    assert engine.serving_stats()["peak_batch_size"] > 1


def test_cancelled_acomplete_cancels_the_engine_request(engine):
    llm = FusionLLM(engine=engine, max_tokens=400)

    async def run():
        task = asyncio.create_task(llm.acomplete("Tell me everything.", documents=DOCS))
        while engine.serving_stats()["decode_steps"] < 2:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await _idle(engine, 1)

    stats = asyncio.run(run())
    assert stats["running"] == 0 and stats["queued"] == 0 and stats["requests_done"] == 1
    assert stats["decode_steps"] < 300  # it left the batch long before max_tokens


def test_cancelled_astream_and_langchain_timeout_cancel_the_request(engine):
    llm = FusionLLM(engine=engine, max_tokens=400)
    chat = ChatKVFuse(engine=engine, max_tokens=400)

    async def consume():
        async for _ in await llm.astream_complete("Tell me everything.", documents=DOCS):
            pass

    async def run():
        task = asyncio.create_task(consume())
        while engine.serving_stats()["decode_steps"] < 2:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        first = await _idle(engine, 1)
        with pytest.raises(TimeoutError, match="timeout=0.2s"):
            await chat.ainvoke("Tell me everything.", documents=DOCS, timeout=0.2)
        with pytest.raises(TimeoutError):
            async for _ in chat.astream("Tell me everything.", documents=DOCS, timeout=0.2):
                pass
        return first, await _idle(engine, 3)

    first, last = asyncio.run(run())
    assert first["running"] == 0 and first["requests_done"] == 1
    assert last["running"] == 0 and last["queued"] == 0 and last["requests_done"] == 3
    assert last["decode_steps"] < 600


def test_langchain_async_stream_equals_sync_and_records_usage(engine):
    chat = ChatKVFuse(engine=engine, max_tokens=10)
    sync = chat.invoke("Who was the director?", documents=DOCS)

    async def run():
        chunks = [c async for c in chat.astream("Who was the director?", documents=DOCS)]
        return chunks

    chunks = asyncio.run(run())
    assert "".join(c.content for c in chunks) == sync.content
    assert chunks[-1].usage_metadata["input_token_details"]["cache_read"] > 0
