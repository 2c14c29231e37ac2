"""LangChain adapters on a real FusionEngine (tiny random llama: fast; text is noise, the plumbing is real)."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("langchain_core")

from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.runnables import RunnableLambda, RunnablePassthrough  # noqa: E402

from kvfuse.engine.api import FusionEngine  # noqa: E402
from kvfuse.engine.fusion.base import budget_for  # noqa: E402
from kvfuse.integrations.langchain import ChatKVFuse, FusionRunnable, lc_documents_to_documents  # noqa: E402
from kvfuse.integrations.langchain.chat_models import messages_to_chat  # noqa: E402
from kvfuse.integrations._bridge import content_id  # noqa: E402

DOCS = [
    Document("The Larkspur Observatory was built in 1887 above the harbour town of Dunmore.", id="obs"),
    Document("Its first director, Amelia Voss, was born in Dunmore.", metadata={"id": "dir"}),
    Document("The Quillon festival was founded in 1923 by Tomas Reyes."),
]


@pytest.fixture
def tiny_engine(tiny_model):
    engine = FusionEngine.from_pretrained(str(tiny_model("llama")), device="cpu", dtype="fp32", disk_cache=False)
    yield engine
    engine.close()


def test_document_ids_come_from_id_then_metadata_then_content():
    docs = lc_documents_to_documents(DOCS + [("pair", "text")])
    assert [d.id for d in docs] == ["obs", "dir", content_id(DOCS[2].page_content), "pair"]
    assert [d.text for d in docs[:3]] == [d.page_content for d in DOCS]


def test_messages_to_chat_keeps_the_turns():
    assert messages_to_chat([HumanMessage("hi")]) == [{"role": "user", "content": "hi"}]
    turns = messages_to_chat([SystemMessage("Be brief."), HumanMessage("hello"), AIMessage("hey"),
                              HumanMessage("how are you")])
    assert turns == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
                     {"role": "assistant", "content": "hey"}, {"role": "user", "content": "how are you"}]
    with pytest.raises(ValueError, match="text only"):
        messages_to_chat([HumanMessage(content=[{"type": "image", "url": "http://x/y.png"}])])
    with pytest.raises(ValueError, match="no tool calling"):
        messages_to_chat([HumanMessage("q"), ToolMessage("42", tool_call_id="t1")])


def test_invoke_with_documents_reports_usage_and_costs(tiny_engine):
    chat = ChatKVFuse(engine=tiny_engine, max_tokens=5, recompute_ratio=0.3)
    assert chat.model_name == tiny_engine.model_name and chat._llm_type == "kvfuse"
    first = chat.invoke("When was it built?", documents=DOCS)
    assert first.response_metadata["kvfuse"]["cache_misses"] == 3
    second = chat.bind(documents=DOCS).invoke("Who founded the festival?")
    stats = second.response_metadata["kvfuse"]
    assert (stats["cache_hits"], stats["cache_misses"]) == (3, 0)
    assert stats["recomputed_tokens"] == budget_for(0.3, stats["doc_tokens"])
    usage = second.usage_metadata
    assert usage["input_tokens"] == stats["prompt_tokens"] and usage["output_tokens"] == stats["output_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert second.response_metadata["model_name"] == tiny_engine.model_name


def test_stream_equals_invoke_and_ends_with_usage(tiny_engine):
    chat = ChatKVFuse(engine=tiny_engine, max_tokens=8)
    text = chat.invoke("When was it built?", documents=DOCS).content
    chunks = list(chat.stream("When was it built?", documents=DOCS))
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    assert full.content == text
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata["output_tokens"] > 0
    assert sum(1 for c in chunks if c.usage_metadata) == 1
    assert full.response_metadata["kvfuse"]["cache_hits"] == 3


def test_async_and_batch(tiny_engine):
    chat = ChatKVFuse(engine=tiny_engine, max_tokens=6)
    expected = [chat.invoke(q, documents=DOCS).content for q in ("a?", "b?")]
    assert [m.content for m in chat.batch(["a?", "b?"], documents=DOCS)] == expected

    async def run():
        one = await chat.ainvoke("a?", documents=DOCS)
        many = await chat.abatch(["a?", "b?"], documents=DOCS)
        chunks = [c async for c in chat.astream("a?", documents=DOCS)]
        return one, many, chunks

    one, many, chunks = asyncio.run(run())
    assert one.content == expected[0] and [m.content for m in many] == expected
    assert "".join(c.content for c in chunks) == expected[0] and chunks[-1].chunk_position == "last"


def test_token_callbacks_fire_when_streaming(tiny_engine):
    class Tokens(BaseCallbackHandler):
        def __init__(self):
            self.tokens = []

        def on_llm_new_token(self, token, **kwargs):
            self.tokens.append(token)

    handler = Tokens()
    chat = ChatKVFuse(engine=tiny_engine, max_tokens=6, streaming=True)
    out = chat.invoke("a?", documents=DOCS, config={"callbacks": [handler]})
    assert "".join(handler.tokens) == out.content and out.usage_metadata["output_tokens"] > 0


def test_bad_arguments(tiny_engine):
    chat = ChatKVFuse(engine=tiny_engine)
    with pytest.raises(ValueError, match="per-call model"):
        chat.invoke("a?", model="another-model")
    with pytest.raises(TypeError, match="unexpected keyword"):
        chat.invoke("a?", documnets=DOCS)
    with pytest.raises(ValueError, match="engine=, model= or base_url="):
        ChatKVFuse()


def test_fusion_runnable_in_lcel(tiny_engine):
    retriever = RunnableLambda(lambda q: DOCS[:2])
    chain = {"question": RunnablePassthrough(), "documents": retriever} | FusionRunnable(tiny_engine,
                                                                                          max_new_tokens=5)
    first = chain.invoke("When was it built?")
    assert set(first) == {"answer", "question", "documents", "kvfuse"}
    assert first["documents"] == DOCS[:2] and first["question"] == "When was it built?"
    assert first["kvfuse"]["cache_misses"] == 2
    second = chain.invoke("Who was the director?")
    assert (second["kvfuse"]["cache_hits"], second["kvfuse"]["cache_misses"]) == (2, 0)


def test_fusion_runnable_with_retriever_streams_and_runs_async(tiny_engine):
    runnable = FusionRunnable(tiny_engine, retriever=RunnableLambda(lambda q: DOCS), max_new_tokens=6)
    out = runnable.invoke("When was it built?")
    chunks = list(runnable.stream("When was it built?"))
    assert set(chunks[0]) == {"question", "documents"} and set(chunks[-1]) == {"kvfuse"}
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total["answer"] == out["answer"] and total["kvfuse"]["cache_hits"] == 3

    async def run():
        a = await runnable.ainvoke({"question": "When was it built?"})
        s = [c async for c in runnable.astream("When was it built?")]
        return a, s

    a, s = asyncio.run(run())
    assert a["answer"] == out["answer"]
    assert "".join(c.get("answer", "") for c in s) == out["answer"]
    # explicit documents win over the retriever; per-call options override defaults
    explicit = runnable.invoke({"question": "q?", "documents": [("x", "Some other text.")]})
    assert explicit["kvfuse"]["cache_misses"] == 1 and explicit["documents"] == [("x", "Some other text.")]
    full = runnable.invoke("q?", strategy="full")
    assert full["kvfuse"]["strategy"] == "full"
    assert full["kvfuse"]["recomputed_tokens"] == full["kvfuse"]["doc_tokens"] > 0


def test_fusion_runnable_input_errors(tiny_engine):
    runnable = FusionRunnable(tiny_engine)
    with pytest.raises(ValueError, match="question"):
        runnable.invoke({"documents": []})
    with pytest.raises(TypeError):
        runnable.invoke(42)
    with pytest.raises(TypeError, match="unexpected keyword"):
        runnable.invoke("q?", max_tokenz=3)
    with pytest.raises(TypeError, match="both max_tokens and max_new_tokens"):
        runnable.invoke("q?", max_tokens=3, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_tokenz"):
        FusionRunnable(tiny_engine, max_tokenz=3)


def test_fusion_runnable_honours_max_tokens(tiny_engine):
    for runnable, kwargs in ((FusionRunnable(tiny_engine, max_tokens=3), {}),
                             (FusionRunnable(tiny_engine, max_new_tokens=50), {"max_tokens": 3})):
        out = runnable.invoke({"question": "q?", "documents": DOCS[:1]}, **kwargs)
        assert (out["kvfuse"]["output_tokens"], out["kvfuse"]["finish_reason"]) == (3, "length")


def test_engine_loads_lazily_from_a_model_name(tiny_model):
    chat = ChatKVFuse(model=str(tiny_model("llama")), device="cpu", dtype="fp32",
                      engine_options={"disk_cache": False}, max_tokens=3)
    assert chat.engine is None  # construction is cheap (the standard suite times it)
    out = chat.invoke("a?", documents=DOCS[:1])
    assert isinstance(chat.engine, FusionEngine) and chat.get_engine() is chat.engine
    assert out.response_metadata["kvfuse"]["cache_misses"] == 1
    chat.engine.close()


def test_sift_indexes_ride_in_document_metadata_through_a_vector_store(tiny_model):
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.vectorstores import InMemoryVectorStore

    from kvfuse.integrations._bridge import SIFT_METADATA_KEY
    from kvfuse.integrations.langchain import KVFusePrecompute

    path = str(tiny_model("llama"))
    ingest = FusionEngine.from_pretrained(path, device="cpu", dtype="fp32", disk_cache=False)
    serve = FusionEngine.from_pretrained(path, device="cpu", dtype="fp32", disk_cache=False)
    try:
        with pytest.raises(ValueError, match="index strategy"):
            KVFusePrecompute(ingest, strategy="sift", compute=False)
        pre = KVFusePrecompute(ingest, strategy="sift:block=4:min_tokens=0:max_density=1.0")
        out = pre.transform_documents(DOCS)
        assert all(SIFT_METADATA_KEY not in d.metadata for d in DOCS)  # the inputs are left as they were
        assert [d.page_content for d in out] == [d.page_content for d in DOCS] and pre.last_report.misses == 3
        store = InMemoryVectorStore(DeterministicFakeEmbedding(size=8))
        store.add_documents(out)
        found = store.similarity_search("Who founded the festival?", k=3)
        chat = ChatKVFuse(engine=serve, strategy="sift:block=4:min_tokens=0:max_density=1.0", max_tokens=2)
        sift = chat.invoke("Who founded the festival?", documents=found).response_metadata["kvfuse"]["extra"]["sift"]
        assert (sift["index_carried"], sift["index_computed"], sift["index_rejected"]) == (3, 0, 0)
        found[1].metadata[SIFT_METADATA_KEY] = "not base64!"
        found[2].metadata[SIFT_METADATA_KEY] = found[0].metadata[SIFT_METADATA_KEY]  # another document's index
        sift = chat.invoke("Who founded the festival?", documents=found).response_metadata["kvfuse"]["extra"]["sift"]
        assert (sift["index_carried"], sift["index_rejected"]) == (1, 2)
    finally:
        ingest.close()
        serve.close()


def test_strategy_auto_through_the_chat_model(tiny_engine):
    """ChatKVFuse(strategy="auto"): the front's default point, or the fastest meeting a target from model_kwargs."""
    from kvfuse.engine.auto import Front, FrontPoint

    tiny_engine.front = Front(tiny_engine.model_name, "", (FrontPoint("cacheblend", 0.2, 0.6, None, {"cpu": 0.4}),
                                                           FrontPoint("epic", 0.2, 0.5, None, {"cpu": 0.3})),
                              ("cacheblend", 0.2))
    default = ChatKVFuse(engine=tiny_engine, max_tokens=3, strategy="auto").invoke("When?", documents=DOCS)
    assert default.response_metadata["kvfuse"]["strategy"] == "cacheblend"
    fast = ChatKVFuse(engine=tiny_engine, max_tokens=3, strategy="auto", model_kwargs={"target_fidelity": 0.45})
    assert fast.invoke("When?", documents=DOCS).response_metadata["kvfuse"]["strategy"] == "epic"
    with pytest.raises(ValueError):
        ChatKVFuse(engine=tiny_engine, strategy="auto", model_kwargs={"gradual": True})


def test_the_guard_is_a_setting_and_a_per_call_option(tiny_engine):
    """guard_margin reaches the engine from ChatKVFuse's settings, per call, and through FusionRunnable."""
    full = ChatKVFuse(engine=tiny_engine, max_tokens=4, strategy="full").invoke("Q?", documents=DOCS)
    guarded = ChatKVFuse(engine=tiny_engine, max_tokens=4, strategy="reuse", guard_margin=1e9)
    msg = guarded.invoke("Q?", documents=DOCS)
    assert msg.text == full.text and msg.response_metadata["kvfuse"]["strategy"] == "full"
    assert msg.response_metadata["kvfuse"]["extra"]["guard"]["requested"] == "reuse"
    plain = ChatKVFuse(engine=tiny_engine, max_tokens=4, strategy="reuse")
    assert plain.invoke("Q?", documents=DOCS, guard_margin=1e9).response_metadata["kvfuse"]["strategy"] == "full"
    chain = FusionRunnable(tiny_engine, strategy="reuse", max_new_tokens=4)
    out = chain.invoke({"question": "Q?", "documents": DOCS}, guard_margin=1e9)
    assert out["kvfuse"]["strategy"] == "full" and out["kvfuse"]["extra"]["guard"]["escalated_at"] == 0
    assert chain.invoke({"question": "Q?", "documents": DOCS})["kvfuse"]["strategy"] == "reuse"
    once = chain.invoke({"question": "Q?", "documents": DOCS}, guard_margin=1e9, guard_tokens=1)
    assert once["kvfuse"]["extra"]["guard"]["escalated_at"] == 0
    probed = ChatKVFuse(engine=tiny_engine, max_tokens=4, strategy="infoflow", guard_margin=1e9, guard_at="probe")
    msg = probed.invoke("Q?", documents=DOCS)
    assert msg.text == full.text and msg.response_metadata["kvfuse"]["extra"]["guard"]["at"] == "probe"
    infoflow = FusionRunnable(tiny_engine, strategy="infoflow", max_new_tokens=4)
    out = infoflow.invoke({"question": "Q?", "documents": DOCS}, guard_margin=1e9, guard_at="probe")
    assert out["kvfuse"]["strategy"] == "full" and out["kvfuse"]["extra"]["guard"]["at"] == "probe"
    with pytest.raises(ValueError):
        ChatKVFuse(engine=tiny_engine, guard_at="before")
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            ChatKVFuse(engine=tiny_engine, guard_margin=bad)
        with pytest.raises(ValueError):
            FusionRunnable(tiny_engine, guard_margin=bad)
