"""kvfuse's own adapters over HTTP (`base_url=`): FusionLLM, ChatKVFuse and FusionRunnable against the real server
give the answers of the same adapters over an in-process engine on the same tiny model (greedy), sync, async and
streamed, with documents; usage counts cached tokens on a repeat; errors are clear."""
from __future__ import annotations

import asyncio

import pytest
from serving import DOCS, KEY

pytest.importorskip("llama_index.core")
pytest.importorskip("langchain_core")

from kvfuse.engine.types import EngineOverloaded  # noqa: E402
from kvfuse.integrations.langchain import ChatKVFuse, FusionRunnable  # noqa: E402
from kvfuse.integrations.llama_index import FusionLLM  # noqa: E402
from kvfuse.integrations.remote import RemoteEngine, RemoteError, RemoteOverloaded  # noqa: E402

PAIRS = [(d["id"], d["text"]) for d in DOCS]
QUESTION = "When was the observatory built, and by whom was it directed?"


@pytest.fixture(scope="module")
def remote(server):
    return {"base_url": f"{server.url}/v1", "api_key": KEY}


def test_fusion_llm_remote_equals_local(server, remote, local_engine):
    from llama_index.core.llms import ChatMessage

    local = FusionLLM(engine=local_engine, max_tokens=10)
    far = FusionLLM(**remote, max_tokens=10)
    assert far.model_name == server.model and far.metadata.context_window == local.metadata.context_window

    want = local.complete(QUESTION, documents=PAIRS).text
    got = far.complete(QUESTION, documents=PAIRS)
    assert got.text == want
    assert "".join(r.delta for r in far.stream_complete(QUESTION, documents=PAIRS)) == want
    again = far.complete(QUESTION, documents=PAIRS)
    assert again.raw["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    stats = again.additional_kwargs
    assert stats["cache_hits"] == 3 and stats["cache_misses"] == 0 and stats["strategy"] == got.additional_kwargs[
        "strategy"]
    assert stats["output_tokens"] == again.raw["usage"]["completion_tokens"] > 0 and stats["ttft_s"] > 0

    # a chat with a system turn: the documents are written into the last user turn the server engine's way
    msgs = [ChatMessage(role="system", content="Answer briefly."), ChatMessage(role="user", content=QUESTION)]
    want_chat = local.chat(msgs, documents=PAIRS).message.content
    assert far.chat(msgs, documents=PAIRS).message.content == want_chat

    async def run():
        a = await far.acomplete(QUESTION, documents=PAIRS)
        s = [r async for r in await far.astream_complete(QUESTION, documents=PAIRS)]
        c = await far.achat(msgs, documents=PAIRS)
        cs = [r async for r in await far.astream_chat(msgs, documents=PAIRS)]
        return a, s, c, cs

    a, s, c, cs = asyncio.run(run())
    assert a.text == "".join(r.delta for r in s) == want
    assert c.message.content == "".join(r.delta for r in cs) == want_chat
    assert s[-1].raw["usage"]["cached_tokens"] > 0 and cs[-1].additional_kwargs["extra"]["documents"] == [d for d, _ in PAIRS]


def test_chat_kvfuse_remote_equals_local(server, remote, local_engine):
    local = ChatKVFuse(engine=local_engine, max_tokens=10)
    far = ChatKVFuse(**remote, max_tokens=10)
    assert far.model_name == server.model
    question = [("system", "Answer briefly."), ("human", "Who founded the festival?")]

    want = local.invoke(QUESTION, documents=PAIRS).content
    assert far.invoke(QUESTION, documents=PAIRS).content == want
    want_chat = local.invoke(question, documents=PAIRS).content
    msg = far.invoke(question, documents=PAIRS)
    assert msg.content == want_chat
    assert msg.usage_metadata["input_token_details"]["cache_read"] > 0  # the documents were sent before
    assert msg.response_metadata["kvfuse"]["cache_hits"] == 3
    chunks = list(far.stream(QUESTION, documents=PAIRS))
    assert "".join(c.content for c in chunks) == want and chunks[-1].usage_metadata["output_tokens"] > 0

    runnable = FusionRunnable(**remote, max_tokens=10)

    async def run():
        one = await far.ainvoke(QUESTION, documents=PAIRS)
        parts = [c async for c in far.astream(question, documents=PAIRS)]
        out = await runnable.ainvoke({"question": QUESTION, "documents": PAIRS})
        both = await asyncio.gather(far.ainvoke(QUESTION, documents=PAIRS), far.ainvoke(question, documents=PAIRS))
        return one, parts, out, both

    one, parts, out, both = asyncio.run(run())
    assert one.content == out["answer"] == want
    assert "".join(c.content for c in parts) == want_chat
    assert [m.content for m in both] == [want, want_chat]
    assert out["kvfuse"]["cache_hits"] == 3
    # with a timeout the sync path streams (read on a helper thread); same answer
    assert far.invoke(QUESTION, documents=PAIRS, timeout=60).content == want


def test_remote_errors_are_clear(server, remote):
    far = FusionLLM(**remote, max_tokens=4)
    with pytest.raises(ValueError, match="unknown fusion strategy|strategy"):
        far.complete("Hi?", documents=PAIRS, strategy="no-such-strategy")
    engine = RemoteEngine(**remote)
    with pytest.raises(RemoteError, match="unknown document id 'nope'") as info:
        engine.generate("Hi?", ["nope"], max_new_tokens=2)
    assert info.value.status == 400 and info.value.code == "unknown_document"
    assert engine.generate("Hi?", ["lark"], max_new_tokens=2, temperature=0.0).cache_hits == 1  # known by id
    with pytest.raises(ValueError, match="strategy options"):
        engine.generate("Hi?", [], max_per_doc=2)
    with pytest.raises(RemoteError, match="serves"):
        FusionLLM(**remote, model="another-model")
    with pytest.raises(RemoteError, match="API key") as info:
        ChatKVFuse(base_url=remote["base_url"], api_key="wrong", model=server.model).invoke("Hi?")
    assert info.value.status == 401
    with pytest.raises(ConnectionError, match="cannot reach the kvfuse server at http://127.0.0.1:9/v1"):
        FusionLLM(base_url="http://127.0.0.1:9")
    with pytest.raises(ValueError, match="not both"):
        ChatKVFuse(base_url=remote["base_url"], engine=engine)
    assert issubclass(RemoteOverloaded, EngineOverloaded)


def test_remote_precompute_then_hits_and_cancel(server, remote):
    engine = RemoteEngine(**remote)
    doc = ("remote-pre", "The lighthouse of Carrow Point was lit for the first time in 1871 by keeper Ines Marlow.")
    report = engine.precompute([doc])
    assert report.misses + report.hits == 1
    chat = ChatKVFuse(engine=engine, max_tokens=6)
    msg = chat.invoke("Who lit the lighthouse?", documents=[doc])
    assert msg.response_metadata["kvfuse"]["cache_hits"] == 1

    async def first_then_close():
        stream = engine.astream("Tell me everything.", [doc], max_new_tokens=200, temperature=0.0)
        first = await anext(stream)
        await stream.aclose()
        return first, stream.result

    first, result = asyncio.run(first_then_close())
    assert first and result is None
    assert engine.forget(["remote-pre"]) == 1
