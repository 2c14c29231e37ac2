"""End to end with real parts: 30 HotpotQA passages, the offline MiniLM embedder, an in-memory vector index,
retrieval, and answers from SmolLM2-135M through every adapter. Each test starts from an empty cache.

Checked for each adapter: the first question computes the retrieved documents (misses), a second question
over the same documents finds them all (cache_hits == number of documents, misses 0), and the recomputed
token count is exactly what the strategy asked for (CacheBlend: round(ratio * document tokens)).
"""
from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("langchain_core")

from kvfuse.engine.fusion import DEFAULT_STRATEGY  # noqa: E402
from kvfuse.engine.fusion.base import budget_for  # noqa: E402

pytestmark = pytest.mark.slow

TOP_K = 3
RATIO = 0.15
MAX_NEW = 24


def _check_costs(stats: dict, engine, question: str, texts: list[str], *, hits: int, misses: int) -> None:
    assert (stats["cache_hits"], stats["cache_misses"]) == (hits, misses)
    layout = engine.layout(question, [(f"d{i}", t) for i, t in enumerate(texts)])
    assert stats["doc_tokens"] == layout.doc_tokens  # the engine saw exactly these texts
    assert stats["recomputed_tokens"] == budget_for(RATIO, layout.doc_tokens)
    assert stats["strategy"] == DEFAULT_STRATEGY and stats["ttft_s"] > 0


# --- LlamaIndex ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def li_documents(hotpot):
    from llama_index.core import Document

    return [Document(text=p["text"], metadata={"title": p["title"]}) for p in hotpot["passages"]]


def _li_index(documents, embed_model, transformations=()):
    from llama_index.core import VectorStoreIndex
    from llama_index.core.node_parser import SentenceSplitter

    return VectorStoreIndex.from_documents(documents, embed_model=embed_model,
                                           transformations=[SentenceSplitter(chunk_size=1024), *transformations])


def test_llama_index_query_engine(make_engine, hotpot, li_documents, li_embed_model, capsys):
    from llama_index.core.schema import MetadataMode

    from kvfuse.integrations.llama_index import FusionQueryEngine

    engine = make_engine()
    index = _li_index(li_documents, li_embed_model)
    assert len(index.docstore.docs) == 30
    qe = FusionQueryEngine(index.as_retriever(similarity_top_k=TOP_K), engine=engine, recompute_ratio=RATIO,
                           max_new_tokens=MAX_NEW)
    q = hotpot["questions"][0]
    first = qe.query(q["question"])
    texts = [n.node.get_content(metadata_mode=MetadataMode.NONE) for n in first.source_nodes]
    assert len(texts) == TOP_K and first.response.strip()
    _check_costs(first.metadata["kvfuse"], engine, q["question"], texts, hits=0, misses=TOP_K)
    assert {n.node.metadata["title"] for n in first.source_nodes} & {"Liga MX", "Rafael Carioca"}

    second = qe.query(q["question"])  # same retrieval, now from the caches
    _check_costs(second.metadata["kvfuse"], engine, q["question"], texts, hits=TOP_K, misses=0)
    other = "Which club does Rafael de Souza Pereira play for?"
    third = qe.synthesizer.synthesize(other, nodes=first.source_nodes)
    _check_costs(third.metadata["kvfuse"], engine, other, texts, hits=TOP_K, misses=0)
    with capsys.disabled():
        print(f"\n[llama-index] Q: {q['question']}\n  gold: {q['answers']}\n  answer: {first.response!r}"
              f"\n  first: {_fmt(first.metadata['kvfuse'])}\n  second: {_fmt(second.metadata['kvfuse'])}")


def test_llama_index_precompute_at_ingestion_and_reingestion(make_engine, hotpot, li_documents, li_embed_model,
                                                             capsys):
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.schema import MetadataMode

    from kvfuse.integrations.llama_index import FusionSynthesizer, KVFusePrecompute

    engine = make_engine()
    pre = KVFusePrecompute(engine)
    index1 = _li_index(li_documents, li_embed_model, [pre])
    assert (pre.last_report.hits, pre.last_report.misses) == (0, 30)
    pre2 = KVFusePrecompute(engine)
    index2 = _li_index(li_documents, li_embed_model, [pre2])  # a new ingestion: new node ids, same content
    assert set(index1.docstore.docs).isdisjoint(index2.docstore.docs)
    assert (pre2.last_report.hits, pre2.last_report.misses) == (30, 0)

    synth = FusionSynthesizer(engine=engine, recompute_ratio=RATIO, max_new_tokens=MAX_NEW, streaming=True)
    qe = RetrieverQueryEngine(index2.as_retriever(similarity_top_k=TOP_K), response_synthesizer=synth)
    q = hotpot["questions"][1]
    streamed = qe.query(q["question"])
    answer = "".join(streamed.response_gen)
    texts = [n.node.get_content(metadata_mode=MetadataMode.NONE) for n in streamed.source_nodes]
    _check_costs(streamed.metadata["kvfuse"], engine, q["question"], texts, hits=TOP_K, misses=0)
    with capsys.disabled():
        print(f"\n[llama-index, precomputed, streamed] Q: {q['question']}\n  gold: {q['answers']}"
              f"\n  answer: {answer!r}\n  costs: {_fmt(streamed.metadata['kvfuse'])}"
              f"\n  ingestion: {pre.last_report} / re-ingestion: {pre2.last_report}")


def test_llama_index_async_query_does_not_block_the_loop(make_engine, hotpot, li_documents, li_embed_model):
    from kvfuse.integrations.llama_index import FusionQueryEngine

    engine = make_engine()
    index = _li_index(li_documents, li_embed_model)
    qe = FusionQueryEngine(index.as_retriever(similarity_top_k=TOP_K), engine=engine, max_new_tokens=MAX_NEW)
    q = hotpot["questions"][2]["question"]

    async def run():
        gaps, last, done = [], time.perf_counter(), asyncio.Event()

        async def heartbeat():
            nonlocal last
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        t0 = time.perf_counter()
        response = await qe.aquery(q)
        elapsed = time.perf_counter() - t0
        done.set()
        await beat
        return response, elapsed, gaps

    response, elapsed, gaps = asyncio.run(run())
    assert response.metadata["kvfuse"]["cache_misses"] == TOP_K
    assert elapsed > 0.5  # a real generation ran while the loop kept ticking
    assert len(gaps) > 10 and max(gaps) < max(0.25, elapsed / 4)


# --- LangChain -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lc_retriever(hotpot, lc_embeddings):
    from langchain_core.documents import Document
    from langchain_core.vectorstores import InMemoryVectorStore

    store = InMemoryVectorStore(lc_embeddings)
    store.add_documents([Document(p["text"], id=p["id"], metadata={"title": p["title"]})
                         for p in hotpot["passages"]])
    return store.as_retriever(search_kwargs={"k": TOP_K})


def test_langchain_lcel_chain(make_engine, hotpot, lc_retriever, capsys):
    from langchain_core.runnables import RunnablePassthrough

    from kvfuse.integrations.langchain import FusionRunnable

    engine = make_engine()
    chain = {"question": RunnablePassthrough(), "documents": lc_retriever} | FusionRunnable(
        engine, recompute_ratio=RATIO, max_new_tokens=MAX_NEW)
    q = hotpot["questions"][1]
    first = chain.invoke(q["question"])
    texts = [d.page_content for d in first["documents"]]
    assert len(texts) == TOP_K and first["answer"].strip()
    assert {d.id for d in first["documents"]} <= {p["id"] for p in hotpot["passages"]}  # ids kept
    _check_costs(first["kvfuse"], engine, q["question"], texts, hits=0, misses=TOP_K)
    second = chain.invoke(q["question"])
    _check_costs(second["kvfuse"], engine, q["question"], texts, hits=TOP_K, misses=0)
    with capsys.disabled():
        print(f"\n[langchain LCEL] Q: {q['question']}\n  gold: {q['answers']}\n  answer: {first['answer']!r}"
              f"\n  first: {_fmt(first['kvfuse'])}\n  second: {_fmt(second['kvfuse'])}")


def test_langchain_chat_model_with_retrieved_documents(make_engine, hotpot, lc_retriever, capsys):
    from kvfuse.integrations.langchain import ChatKVFuse

    engine = make_engine()
    chat = ChatKVFuse(engine=engine, recompute_ratio=RATIO, max_tokens=MAX_NEW)
    q = hotpot["questions"][2]
    docs = lc_retriever.invoke(q["question"])
    texts = [d.page_content for d in docs]
    first = chat.invoke(q["question"], documents=docs)
    _check_costs(first.response_metadata["kvfuse"], engine, q["question"], texts, hits=0, misses=TOP_K)
    chunks = list(chat.bind(documents=docs).stream("How many members does the group have?"))
    streamed = chunks[0]
    for c in chunks[1:]:
        streamed += c
    _check_costs(streamed.response_metadata["kvfuse"], engine, "How many members does the group have?", texts,
                 hits=TOP_K, misses=0)
    assert streamed.usage_metadata["input_tokens"] == streamed.response_metadata["kvfuse"]["prompt_tokens"]
    with capsys.disabled():
        print(f"\n[langchain chat] Q: {q['question']}\n  gold: {q['answers']}\n  answer: {first.content!r}"
              f"\n  first: {_fmt(first.response_metadata['kvfuse'])}"
              f"\n  second (stream): {_fmt(streamed.response_metadata['kvfuse'])}")


def _fmt(stats: dict) -> str:
    return (f"hits={stats['cache_hits']} misses={stats['cache_misses']} recomputed={stats['recomputed_tokens']}"
            f"/{stats['doc_tokens']} ttft={stats['ttft_s']:.2f}s miss_prefill={stats['miss_prefill_s']:.2f}s "
            f"decode={stats['decode_s']:.2f}s out={stats['output_tokens']}")
