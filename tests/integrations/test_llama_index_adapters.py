"""LlamaIndex adapters on a real FusionEngine (tiny random llama: fast; text is noise, the plumbing is real)."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document as LIDocument  # noqa: E402
from llama_index.core import StorageContext, VectorStoreIndex, load_index_from_storage  # noqa: E402
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse  # noqa: E402
from llama_index.core.ingestion import IngestionPipeline  # noqa: E402
from llama_index.core.llms import ChatMessage, MessageRole  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode  # noqa: E402

from kvfuse.engine.api import FusionEngine  # noqa: E402
from kvfuse.engine.fusion.base import budget_for  # noqa: E402
from kvfuse.engine.types import GenerationResult  # noqa: E402
from kvfuse.integrations.llama_index import (  # noqa: E402
    FusionLLM,
    FusionQueryEngine,
    FusionSynthesizer,
    KVFusePrecompute,
    kvfuse_cache_dir,
    nodes_to_documents,
)

TEXTS = [
    "The Larkspur Observatory was built in 1887 on the slopes above the harbour town of Dunmore.",
    "Its first director, Amelia Voss, was born in Dunmore and measured double stars for forty years.",
    "The Quillon festival was founded in 1923 by Tomas Reyes; every spring the streets fill with lanterns.",
]


@pytest.fixture
def tiny_engine(tiny_model, tmp_path):
    engine = FusionEngine.from_pretrained(str(tiny_model("llama")), device="cpu", dtype="fp32", disk_cache=False)
    yield engine
    engine.close()


def _nodes(texts=TEXTS):
    return [NodeWithScore(node=TextNode(text=t, metadata={"n": i}), score=1.0) for i, t in enumerate(texts)]


def _documents(texts=TEXTS):
    return [LIDocument(text=t, metadata={"title": f"passage {i}"}) for i, t in enumerate(texts)]


def test_metadata_comes_from_the_engine(tiny_engine):
    llm = FusionLLM(engine=tiny_engine, max_new_tokens=7)
    meta = llm.metadata
    assert meta.context_window == tiny_engine.context_window
    assert meta.model_name == tiny_engine.model_name
    assert meta.num_output == 7 and meta.is_chat_model and not meta.is_function_calling_model


def test_complete_fuses_documents_and_reports_costs(tiny_engine):
    llm = FusionLLM(engine=tiny_engine, max_new_tokens=6, recompute_ratio=0.25)
    first = llm.complete("When was the observatory built?", documents=_nodes())
    result = first.additional_kwargs["generation_result"]
    assert isinstance(result, GenerationResult) and first.text == result.text
    assert first.raw["usage"]["prompt_tokens"] == result.prompt_tokens
    assert first.raw["usage"]["completion_tokens"] == len(result.token_ids)
    assert first.additional_kwargs["cache_misses"] == 3 and first.additional_kwargs["cache_hits"] == 0
    second = llm.complete("Who founded the festival?", documents=_nodes())
    stats = second.additional_kwargs
    assert (stats["cache_hits"], stats["cache_misses"]) == (3, 0)
    assert stats["recomputed_tokens"] == budget_for(0.25, stats["doc_tokens"])
    assert stats["output_tokens"] == len(stats["generation_result"].token_ids)
    assert second.raw["usage"]["cached_tokens"] == stats["doc_tokens"] - stats["recomputed_tokens"] > 0


def test_per_call_options_and_unknown_keywords(tiny_engine):
    llm = FusionLLM(engine=tiny_engine, max_new_tokens=4)
    out = llm.complete("Q?", documents=_nodes(), strategy="full", max_new_tokens=3)
    assert out.additional_kwargs["strategy"] == "full"
    assert out.additional_kwargs["recomputed_tokens"] == out.additional_kwargs["doc_tokens"]
    assert out.additional_kwargs["output_tokens"] <= 3
    with pytest.raises(TypeError, match="unexpected keyword"):
        llm.complete("Q?", documetns=_nodes())


def test_stream_complete_equals_complete(tiny_engine):
    llm = FusionLLM(engine=tiny_engine, max_new_tokens=8)
    full = llm.complete("When was it built?", documents=_nodes())
    items = list(llm.stream_complete("When was it built?", documents=_nodes()))
    assert "".join(i.delta for i in items) == full.text == items[-1].text
    assert items[-1].delta == "" and items[-1].additional_kwargs["cache_hits"] == 3
    assert all(not i.additional_kwargs for i in items[:-1])


def test_chat_variants(tiny_engine):
    llm = FusionLLM(engine=tiny_engine, max_new_tokens=5)
    messages = [ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
                ChatMessage(role=MessageRole.USER, content="When was it built?")]
    reply = llm.chat(messages, documents=_nodes())
    assert reply.message.role == MessageRole.ASSISTANT
    assert reply.additional_kwargs["doc_tokens"] > 0
    streamed = list(llm.stream_chat(messages, documents=_nodes()))
    assert "".join(r.delta for r in streamed) == reply.message.content == streamed[-1].message.content


def test_async_variants_match_sync(tiny_engine):
    llm = FusionLLM(engine=tiny_engine, max_new_tokens=6)
    messages = [ChatMessage(role=MessageRole.USER, content="When was it built?")]
    sync_text = llm.complete("When was it built?", documents=_nodes()).text

    async def run():
        a = await llm.acomplete("When was it built?", documents=_nodes())
        s = [r async for r in await llm.astream_complete("When was it built?", documents=_nodes())]
        c = await llm.achat(messages, documents=_nodes())
        cs = [r async for r in await llm.astream_chat(messages, documents=_nodes())]
        return a, s, c, cs

    a, s, c, cs = asyncio.run(run())
    assert a.text == sync_text == "".join(r.delta for r in s) == c.message.content
    assert "".join(r.delta for r in cs) == sync_text
    assert s[-1].additional_kwargs["cache_hits"] == 3


def test_async_stream_stops_early_and_releases_the_engine(tiny_engine):
    llm = FusionLLM(engine=tiny_engine, max_new_tokens=32)

    async def first_two():
        gen = await llm.astream_complete("Tell me everything.", documents=_nodes())
        out = []
        async for r in gen:
            out.append(r)
            if len(out) == 2:
                break
        await gen.aclose()
        return out

    assert len(asyncio.run(first_two())) == 2
    # the engine is free again: a plain call on this thread completes
    assert llm.complete("Again?", max_new_tokens=2).raw["finish_reason"] in ("stop", "length")


def test_nodes_to_documents_caches_the_body_under_the_llm_view():
    node = TextNode(text="body", metadata={"title": "T", "secret": "x"}, excluded_llm_metadata_keys=["secret"])
    (doc,) = nodes_to_documents([NodeWithScore(node=node, score=0.5)])
    assert doc.id == node.node_id
    assert doc.text == node.get_content(metadata_mode=MetadataMode.NONE) == "body"  # the cached part
    assert f"{doc.title}\n{doc.text}" == node.get_content(metadata_mode=MetadataMode.LLM)  # what the LLM sees
    assert "T" in doc.title and "secret" not in doc.title
    bare, = nodes_to_documents([TextNode(text="just text")])
    assert (bare.text, bare.title) == ("just text", "")
    assert nodes_to_documents([TextNode(text="  ")]) == []  # an empty body is left out
    pair, = nodes_to_documents([("x", "text")])
    assert (pair.id, pair.text) == ("x", "text")


def test_synthesizer_in_retriever_query_engine(tiny_engine, li_embed_model):
    index = VectorStoreIndex.from_documents(_documents(), embed_model=li_embed_model)
    synth = FusionSynthesizer(engine=tiny_engine, max_new_tokens=5)
    qe = RetrieverQueryEngine(index.as_retriever(similarity_top_k=2), response_synthesizer=synth)
    first = qe.query("When was the Larkspur Observatory built?")
    assert isinstance(first, Response) and len(first.source_nodes) == 2
    assert first.metadata["kvfuse"]["cache_misses"] == 2
    for n in first.source_nodes:  # LlamaIndex's own metadata entries are kept
        assert first.metadata[n.node.node_id] == n.node.metadata
    second = qe.query("When was the Larkspur Observatory built?")
    assert (second.metadata["kvfuse"]["cache_hits"], second.metadata["kvfuse"]["cache_misses"]) == (2, 0)
    assert "memory_entries" in second.metadata["kvfuse"]["engine_cache"]


def test_synthesizer_without_nodes_does_not_call_the_engine(tiny_engine):
    synth = FusionSynthesizer(engine=tiny_engine)
    before = tiny_engine.cache_stats()
    out = synth.synthesize("anything?", nodes=[])
    assert str(out) == "Empty Response" and tiny_engine.cache_stats() == before


def test_synthesizer_rejects_other_llms_and_templates(tiny_engine):
    from llama_index.core.llms import MockLLM

    with pytest.raises(TypeError):
        FusionSynthesizer(llm=MockLLM())
    synth = FusionSynthesizer(engine=tiny_engine)
    assert synth.get_prompts() == {}
    with pytest.raises(ValueError):
        synth.update_prompts({"text_qa_template": None})


def test_get_response_from_bare_chunks_hits_by_content(tiny_engine):
    synth = FusionSynthesizer(engine=tiny_engine, max_new_tokens=3)
    synth.get_response("Q?", TEXTS)
    llm = synth.llm
    nodes = [TextNode(text=t) for t in TEXTS]  # other ids (node uuids), same content
    again = llm.complete("Q?", documents=nodes)
    assert (again.additional_kwargs["cache_hits"], again.additional_kwargs["cache_misses"]) == (3, 0)


def test_streaming_query_engine_fills_metadata_after_the_stream(tiny_engine, li_embed_model):
    index = VectorStoreIndex.from_documents(_documents(), embed_model=li_embed_model)
    qe = FusionQueryEngine(index.as_retriever(similarity_top_k=3), engine=tiny_engine, max_new_tokens=6,
                           streaming=True)
    plain = FusionQueryEngine(index.as_retriever(similarity_top_k=3), engine=tiny_engine, max_new_tokens=6)
    expected = plain.query("Who founded the festival?").response
    streamed = qe.query("Who founded the festival?")
    assert isinstance(streamed, StreamingResponse) and streamed.metadata["kvfuse"] == {}
    assert str(streamed) == expected
    assert streamed.metadata["kvfuse"]["cache_hits"] == 3

    async def run():
        r = await qe.aquery("Who founded the festival?")
        assert isinstance(r, AsyncStreamingResponse)
        text = "".join([t async for t in r.async_response_gen()])
        return text, r.metadata

    text, meta = asyncio.run(run())
    assert text == expected and meta["kvfuse"]["cache_misses"] == 0


def test_reingestion_with_new_node_ids_hits_by_content(tiny_engine, li_embed_model):
    def ingest():
        pre = KVFusePrecompute(tiny_engine)
        pipeline = IngestionPipeline(transformations=[SentenceSplitter(chunk_size=512), pre, li_embed_model],
                                     disable_cache=True)
        nodes = pipeline.run(documents=_documents())
        return nodes, pre.last_report

    nodes1, report1 = ingest()
    nodes2, report2 = ingest()
    assert {n.node_id for n in nodes1}.isdisjoint({n.node_id for n in nodes2})  # fresh uuids
    assert (report1.hits, report1.misses) == (0, 3)
    assert (report2.hits, report2.misses) == (3, 0)
    index = VectorStoreIndex(nodes2, embed_model=li_embed_model)
    qe = FusionQueryEngine.from_index(index, engine=tiny_engine, similarity_top_k=3, max_new_tokens=4)
    out = qe.query("Who was the first director?")
    assert (out.metadata["kvfuse"]["cache_hits"], out.metadata["kvfuse"]["cache_misses"]) == (3, 0)


def test_precompute_inside_from_documents_and_pipeline_cache_key(tiny_engine, li_embed_model):
    pre = KVFusePrecompute(tiny_engine, batch_size=2)
    VectorStoreIndex.from_documents(_documents(), transformations=[SentenceSplitter(), pre],
                                    embed_model=li_embed_model)
    assert pre.last_report.misses == 3 and pre.last_report.tokens > 0
    assert pre.to_dict()["model_name"] == tiny_engine.model_name  # part of IngestionPipeline's cache key


def test_caches_persist_with_the_index(tiny_model, li_embed_model, tmp_path):
    persist_dir = tmp_path / "storage"
    model_dir = str(tiny_model("llama"))
    engine = FusionEngine.from_pretrained(model_dir, device="cpu", dtype="fp32",
                                          disk_cache_dir=kvfuse_cache_dir(persist_dir))
    index = VectorStoreIndex.from_documents(_documents(), transformations=[SentenceSplitter(),
                                                                          KVFusePrecompute(engine)],
                                            embed_model=li_embed_model)
    index.storage_context.persist(persist_dir=str(persist_dir))
    engine.close()
    del engine

    # a later session: the index and a fresh engine (empty memory tier) over the same folder
    engine = FusionEngine.from_pretrained(model_dir, device="cpu", dtype="fp32",
                                          disk_cache_dir=kvfuse_cache_dir(persist_dir))
    try:
        index = load_index_from_storage(StorageContext.from_defaults(persist_dir=str(persist_dir)),
                                        embed_model=li_embed_model)
        qe = FusionQueryEngine.from_index(index, engine=engine, similarity_top_k=3, max_new_tokens=4)
        out = qe.query("Who founded the festival?")
        assert (out.metadata["kvfuse"]["cache_hits"], out.metadata["kvfuse"]["cache_misses"]) == (3, 0)
        assert engine.cache_stats()["disk_hits"] == 3
    finally:
        engine.close()


def test_llm_needs_an_engine():
    with pytest.raises(ValueError):
        FusionLLM(engine=None)


def test_from_pretrained_builds_the_engine(tiny_model):
    llm = FusionLLM.from_pretrained(str(tiny_model("llama")), max_new_tokens=2,
                                    engine_options={"device": "cpu", "dtype": "fp32", "disk_cache": False})
    assert isinstance(llm.engine, FusionEngine) and llm.max_tokens == 2
    assert llm.complete("a?").additional_kwargs["output_tokens"] <= 2
    llm.engine.close()


def test_bad_strategy_fails_at_call_time(tiny_engine):
    llm = FusionLLM(engine=tiny_engine)
    with pytest.raises(ValueError):
        llm.stream_complete("a?", strategy="no-such-strategy")


def test_strategy_auto_through_the_llm(tiny_engine):
    """strategy="auto" with a fidelity target (a generation option in generate_kwargs): the engine's front picks."""
    from kvfuse.engine.auto import Front, FrontPoint

    tiny_engine.front = Front(tiny_engine.model_name, "", (FrontPoint("cacheblend", 0.2, 0.6, None, {"cpu": 0.4}),
                                                           FrontPoint("epic", 0.2, 0.5, None, {"cpu": 0.3})),
                              ("cacheblend", 0.2))
    llm = FusionLLM(engine=tiny_engine, max_new_tokens=3, strategy="auto", generate_kwargs={"target_fidelity": 0.55})
    stats = llm.complete("When was the observatory built?", documents=_nodes()).additional_kwargs
    assert (stats["strategy"], stats["generation_result"].extra["auto"]["ratio"]) == ("cacheblend", 0.2)
    with pytest.raises(ValueError, match="target_fidelity"):
        FusionLLM(engine=tiny_engine, strategy="auto", generate_kwargs={"target_fidelity": 2.0})


def test_the_guard_is_a_setting_and_a_per_call_option(tiny_engine):
    """guard_margin reaches the engine from the settings and per call: above every margin the answer is full
    prefill's, and the costs say the guard handed it over."""
    full = FusionLLM(engine=tiny_engine, max_new_tokens=4).complete("Q?", documents=_nodes(), strategy="full")
    guarded = FusionLLM(engine=tiny_engine, max_new_tokens=4, strategy="reuse", guard_margin=1e9)
    out = guarded.complete("Q?", documents=_nodes())
    assert out.text == full.text and out.additional_kwargs["strategy"] == "full"
    assert out.additional_kwargs["extra"]["guard"]["requested"] == "reuse"
    plain = FusionLLM(engine=tiny_engine, max_new_tokens=4, strategy="reuse")
    assert plain.complete("Q?", documents=_nodes(), guard_margin=1e9).additional_kwargs["strategy"] == "full"
    assert plain.complete("Q?", documents=_nodes()).additional_kwargs["strategy"] == "reuse"
    once = plain.complete("Q?", documents=_nodes(), guard_margin=1e9, guard_tokens=1)
    assert once.additional_kwargs["extra"]["guard"]["escalated_at"] == 0
    probed = FusionLLM(engine=tiny_engine, max_new_tokens=4, strategy="infoflow", guard_margin=1e9, guard_at="probe")
    out = probed.complete("Q?", documents=_nodes())
    assert out.text == full.text and out.additional_kwargs["extra"]["guard"]["at"] == "probe"
    per_call = FusionLLM(engine=tiny_engine, max_new_tokens=4, strategy="prophetkv").complete(
        "Q?", documents=_nodes(), guard_margin=1e9, guard_at="probe")
    assert per_call.additional_kwargs["extra"]["guard"]["at"] == "probe"
    with pytest.raises(ValueError):
        FusionLLM(engine=tiny_engine, guard_at="before")
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            FusionLLM(engine=tiny_engine, guard_margin=bad)
