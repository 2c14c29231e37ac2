"""The paths LlamaIndex users actually take, on real framework classes: do they fuse, count tokens, trace?

Slow part (SmolLM2-135M fp32, the offline MiniLM embedder, a VectorStoreIndex over six HotpotQA passages
precomputed at ingestion by KVFusePrecompute): for each path (`as_query_engine(llm=FusionLLM)`, `Settings.llm`
then `index.as_query_engine()`, `as_chat_engine(chat_mode="context")`, `FusionQueryEngine`, `FusionLLM.complete`
with `documents=`) the retrieved nodes must be served from their caches (hits == retrieved nodes, no miss),
LlamaIndex's `TokenCountingHandler` must count exactly the engine's prompt and completion tokens, and the
instrumentation (LLM start/end events with the usage on the response) and the callback manager's LLM events must
fire. The last test prints the table `path | fuses (hits/total) | token counts right | traced` (and writes it to
$KVFUSE_PATHS_TABLE when set).

Fast part (the tiny random llama: text is noise, the plumbing is real): FusionLLM settings (unknown ones refused,
max_tokens, system_prompt through the chat template, multi-turn chat, context_window, generate_kwargs, seed),
the one-time "not fused" warning, and KVFusePrecompute's show_progress, num_workers and delete/forget.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document as LIDocument  # noqa: E402
from llama_index.core import PromptTemplate, Settings, VectorStoreIndex  # noqa: E402
from llama_index.core.callbacks import CallbackManager, CBEventType, TokenCountingHandler  # noqa: E402
from llama_index.core.ingestion import IngestionPipeline  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.instrumentation.events.llm import (  # noqa: E402
    LLMChatEndEvent,
    LLMChatStartEvent,
    LLMCompletionEndEvent,
    LLMCompletionStartEvent,
)
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent  # noqa: E402
from llama_index.core.llms import ChatMessage, MessageRole  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.schema import MetadataMode, TextNode  # noqa: E402

from kvfuse.engine.types import GenerationResult  # noqa: E402
from kvfuse.integrations.llama_index import FusionLLM, FusionQueryEngine, KVFusePrecompute  # noqa: E402
from kvfuse.integrations.llama_index import llm as llm_module  # noqa: E402

TOP_K = 2
MAX_TOKENS = 8
N_PASSAGES = 6
TEXTS = [  # for the tiny-engine tests
    "The Larkspur Observatory was built in 1887 on the slopes above the harbour town of Dunmore.",
    "Its first director, Amelia Voss, was born in Dunmore and measured double stars for forty years.",
    "The Quillon festival was founded in 1923 by Tomas Reyes; every spring the streets fill with lanterns.",
]


# --- recording what the framework reports ---------------------------------------------------------------------

class _Recorder(BaseEventHandler):
    """Every instrumentation event of the root dispatcher."""

    events: list = []

    @classmethod
    def class_name(cls) -> str:
        return "KVFuseTestRecorder"

    def handle(self, event, **kwargs) -> None:
        self.events.append(event)


@pytest.fixture(scope="module")
def recorder():
    rec = _Recorder(events=[])
    root = get_dispatcher()
    root.add_event_handler(rec)
    yield rec
    root.event_handlers.remove(rec)


@pytest.fixture(scope="module")
def path_table():
    """path -> row; written to $KVFUSE_PATHS_TABLE at the end of the module when that is set."""
    rows: dict[str, dict] = {}
    yield rows
    target = os.environ.get("KVFUSE_PATHS_TABLE")
    if target and rows:
        with open(target, "w", encoding="utf-8") as f:
            f.write(_table(rows) + "\n")


def _table(rows: dict[str, dict]) -> str:
    yes = {True: "yes", False: "NO"}
    lines = ["| path | fuses (hits/total) | token counts right | traced |", "|---|---|---|---|"]
    for path, r in rows.items():
        lines.append(f"| {path} | {yes[r['hits'] == r['total'] > 0]} ({r['hits']}/{r['total']}) | "
                     f"{yes[r['tokens_right']]} (prompt {r['prompt']}, completion {r['completion']}) | "
                     f"{yes[r['traced']]} |")
    return "\n".join(lines)


# --- the slow world: SmolLM2, MiniLM, a real index ------------------------------------------------------------

@pytest.fixture(scope="module")
def world(make_engine, hotpot, li_embed_model):
    """A fresh SmolLM2 engine, a callback manager with a TokenCountingHandler (installed as Settings' while the
    module runs, so the index and every engine built from it report to it) and an index whose six nodes were
    precomputed at ingestion."""
    engine = make_engine(dtype="fp32")
    counter = TokenCountingHandler()
    manager = CallbackManager([counter])
    old_manager, old_llm = Settings._callback_manager, Settings._llm
    Settings.callback_manager = manager
    passages = hotpot["passages"][:N_PASSAGES]
    docs = [LIDocument(text=p["text"], metadata={"title": p["title"]}) for p in passages]
    pre = KVFusePrecompute(engine)
    index = VectorStoreIndex.from_documents(docs, embed_model=li_embed_model,
                                            transformations=[SentenceSplitter(chunk_size=1024), pre])
    assert (pre.last_report.hits, pre.last_report.misses) == (0, N_PASSAGES)
    try:
        yield {"engine": engine, "counter": counter, "manager": manager, "index": index, "pre": pre}
    finally:
        Settings._callback_manager, Settings._llm = old_manager, old_llm
        engine.close()


QUESTION = "Which league features the Superliga and when was it established?"


def _measure(world, recorder, path_table, path: str, run) -> dict:
    """Runs one path and checks (and records) fusion, token counts and tracing. `run()` returns the source nodes
    the answer was built on."""
    counter, engine = world["counter"], world["engine"]
    counter.reset_counts()
    recorder.events.clear()
    before = engine.cache_stats()
    sources = run()
    after = engine.cache_stats()
    ends = [e for e in recorder.events if isinstance(e, (LLMChatEndEvent, LLMCompletionEndEvent))]
    starts = [e for e in recorder.events if isinstance(e, (LLMChatStartEvent, LLMCompletionStartEvent))]
    results = [e.response.additional_kwargs["generation_result"] for e in ends]
    assert results and all(isinstance(r, GenerationResult) for r in results)
    hits = sum(r.cache_hits for r in results)
    misses = sum(r.cache_misses for r in results)
    prompt = sum(r.usage()["prompt_tokens"] for r in results)
    completion = sum(r.usage()["completion_tokens"] for r in results)
    row = {
        "hits": hits, "total": len(sources), "misses": misses,
        "prompt": counter.prompt_llm_token_count, "completion": counter.completion_llm_token_count,
        "tokens_right": (counter.prompt_llm_token_count, counter.completion_llm_token_count) == (prompt, completion)
        and len(counter.llm_token_counts) == len(results),
        "traced": len(starts) == len(ends) == len(results)
        and any(isinstance(e, RetrievalEndEvent) for e in recorder.events)
        and all(e.response.raw["usage"]["prompt_tokens"] == r.prompt_tokens for e, r in zip(ends, results)),
    }
    path_table[path] = row
    # the engine's own counters agree with what the responses say
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (hits, misses)
    assert row["tokens_right"], (path, row, prompt, completion)
    assert row["traced"], (path, row)
    assert hits == len(sources) == TOP_K and misses == 0, (path, row)
    assert all(r.usage()["cached_tokens"] > 0 for r in results)
    return row


@pytest.mark.slow
def test_as_query_engine_with_fusion_llm(world, recorder, path_table):
    llm = FusionLLM(engine=world["engine"], max_tokens=MAX_TOKENS)
    qe = world["index"].as_query_engine(llm=llm, similarity_top_k=TOP_K)

    def run():
        response = qe.query(QUESTION)
        assert response.response.strip()
        return response.source_nodes

    _measure(world, recorder, path_table, "index.as_query_engine(llm=FusionLLM)", run)


@pytest.mark.slow
def test_settings_llm_then_as_query_engine(world, recorder, path_table):
    Settings.llm = FusionLLM(engine=world["engine"], max_tokens=MAX_TOKENS)
    try:
        qe = world["index"].as_query_engine(similarity_top_k=TOP_K)
        assert isinstance(qe._response_synthesizer._llm, FusionLLM)
        _measure(world, recorder, path_table, "Settings.llm = FusionLLM; index.as_query_engine()",
                 lambda: qe.query("Who is known as the king of banjo?").source_nodes)
    finally:
        Settings._llm = None


@pytest.mark.slow
def test_context_chat_engine(world, recorder, path_table):
    llm = FusionLLM(engine=world["engine"], max_tokens=MAX_TOKENS)
    chat_engine = world["index"].as_chat_engine(chat_mode="context", llm=llm, similarity_top_k=TOP_K)

    def run():
        response = chat_engine.chat("Tell me about Rafael de Souza Figueira.")
        assert response.response.strip()
        return response.source_nodes

    _measure(world, recorder, path_table, 'index.as_chat_engine(chat_mode="context")', run)


@pytest.mark.slow
def test_fusion_query_engine(world, recorder, path_table):
    qe = FusionQueryEngine.from_index(world["index"], engine=world["engine"], similarity_top_k=TOP_K,
                                      max_tokens=MAX_TOKENS, callback_manager=world["manager"])

    def run():
        response = qe.query(QUESTION)
        stats = response.metadata["kvfuse"]
        assert stats["cache_hits"] == TOP_K and "generation_result" not in stats
        return response.source_nodes

    _measure(world, recorder, path_table, "FusionQueryEngine.from_index(index, engine=...)", run)


@pytest.mark.slow
def test_complete_with_documents(world, recorder, path_table):
    llm = FusionLLM(engine=world["engine"], max_tokens=MAX_TOKENS, callback_manager=world["manager"])
    retriever = world["index"].as_retriever(similarity_top_k=TOP_K)

    def run():
        nodes = retriever.retrieve(QUESTION)
        out = llm.complete(QUESTION, documents=nodes)
        assert out.text == out.additional_kwargs["generation_result"].text
        return nodes

    _measure(world, recorder, path_table, "FusionLLM.complete(q, documents=retrieved nodes)", run)


@pytest.mark.slow
def test_stock_path_without_precompute_computes_and_says_so(world, recorder, path_table, li_embed_model, caplog):
    """The control: an index ingested without KVFusePrecompute over passages the engine has never seen. The stock
    path can't fuse (0 hits) and says so once, naming what would."""
    llm = FusionLLM(engine=world["engine"], max_tokens=MAX_TOKENS)
    texts = [
        "The Larkspur Observatory was built in 1887 on the slopes above the harbour town of Dunmore, where the "
        "sea fog lifts early and the nights are long and clear for most of the year. " * 4,
        "Its first director, Amelia Voss, was born in Dunmore and measured double stars for forty years, "
        "publishing her catalogue of eleven thousand pairs in 1931 shortly before she retired. " * 4,
    ]
    index = VectorStoreIndex.from_documents([LIDocument(text=t) for t in texts], embed_model=li_embed_model)
    qe = index.as_query_engine(llm=llm, similarity_top_k=TOP_K)
    llm_module._warned.discard("unfused")
    recorder.events.clear()
    with caplog.at_level(logging.WARNING, logger="kvfuse"):
        qe.query("Who was the first director of the observatory?")
        qe.query("When was the observatory built?")
    results = [e.response.additional_kwargs["generation_result"] for e in recorder.events
               if isinstance(e, LLMChatEndEvent)]
    assert len(results) == 2 and all(r.cache_hits == r.cache_misses == 0 and not r.doc_spans for r in results)
    warnings = [r for r in caplog.records if r.name == "kvfuse" and "fused no document" in r.getMessage()]
    assert len(warnings) == 1  # once, not per call
    assert "KVFusePrecompute" in warnings[0].getMessage() and "FusionQueryEngine" in warnings[0].getMessage()


def test_zz_print_path_table(path_table, capsys):
    """Prints the table of the paths measured in this run (all of them fuse, count and trace)."""
    if not path_table:
        pytest.skip("no path was measured (the slow tests did not run)")
    with capsys.disabled():
        print("\n" + _table(path_table))
    assert all(r["hits"] == r["total"] > 0 and r["tokens_right"] and r["traced"] for r in path_table.values())


# --- FusionLLM settings (tiny engine) -------------------------------------------------------------------------

@pytest.fixture
def tiny(tiny_engine):
    return tiny_engine("llama")


def _chat_tokens(engine, messages) -> int:
    """Prompt tokens of a chat with no document: the whole rendered chat template."""
    return len(engine.prompts.encode_text(engine.prompts.render_chat(messages)))


def test_unknown_settings_are_refused(tiny):
    with pytest.raises(TypeError, match=r"unknown settings \['max_token'\]"):
        FusionLLM(engine=tiny, max_token=5)
    with pytest.raises(TypeError, match=r"unknown settings \['show_progres'\]"):
        KVFusePrecompute(tiny, show_progres=True)
    with pytest.raises(TypeError, match="both max_tokens and max_new_tokens"):
        FusionLLM(engine=tiny, max_tokens=5, max_new_tokens=6)
    with pytest.raises(TypeError, match="unexpected keyword"):
        FusionLLM(engine=tiny).complete("Q?", max_token=3)


def test_max_tokens_is_honoured_under_both_names(tiny):
    llm = FusionLLM(engine=tiny, max_tokens=3)
    assert llm.metadata.num_output == 3
    out = llm.complete("Tell me everything about the sea.")
    assert out.raw["usage"]["completion_tokens"] == len(out.additional_kwargs["generation_result"].token_ids) <= 3
    assert FusionLLM(engine=tiny, max_new_tokens=4).max_tokens == 4
    two = llm.complete("Tell me everything about the sea.", max_new_tokens=2).additional_kwargs
    assert two["output_tokens"] <= 2
    assert FusionLLM(engine=tiny, generate_kwargs={"max_tokens": 2}).metadata.num_output == 2
    # greedy: a longer budget continues the same answer
    long = FusionLLM(engine=tiny, max_tokens=6).complete("Tell me everything about the sea.")
    gr = long.additional_kwargs["generation_result"]
    if gr.finish_reason == "length":
        assert len(gr.token_ids) == 6 and gr.token_ids[:3] == out.additional_kwargs["generation_result"].token_ids


def test_system_prompt_goes_through_the_chat_template_once(tiny):
    system = "You are Zorblax, a terse assistant."
    llm = FusionLLM(engine=tiny, system_prompt=system, max_tokens=2)
    expected = _chat_tokens(tiny, [{"role": "system", "content": system}, {"role": "user", "content": "Hi there"}])
    assert llm.complete("Hi there").raw["usage"]["prompt_tokens"] == expected
    default = _chat_tokens(tiny, [{"role": "user", "content": "Hi there"}])  # the template's own system message
    assert FusionLLM(engine=tiny, max_tokens=2).complete("Hi there").raw["usage"]["prompt_tokens"] == default
    assert expected != default
    # LlamaIndex's predict() adds the system prompt itself; it is not sent twice
    predicted = []
    llm.callback_manager = CallbackManager([_LLMEnds(predicted)])
    llm.predict(PromptTemplate("{greeting}"), greeting="Hi there")
    assert predicted[-1].raw["usage"]["prompt_tokens"] == expected


class _LLMEnds(TokenCountingHandler):
    """Collects the responses of LLM events (a real callback handler, subclassed only to keep them)."""

    def __init__(self, sink: list) -> None:
        super().__init__()
        self._sink = sink

    def on_event_end(self, event_type, payload=None, event_id="", **kwargs) -> None:
        super().on_event_end(event_type, payload, event_id, **kwargs)
        if event_type == CBEventType.LLM and payload:
            self._sink.append(payload.get("response") or payload.get("completion"))


def test_chat_is_multi_turn(tiny):
    llm = FusionLLM(engine=tiny, max_tokens=2)
    messages = [ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
                ChatMessage(role=MessageRole.USER, content="What is the capital of France?"),
                ChatMessage(role=MessageRole.ASSISTANT, content="Paris."),
                ChatMessage(role=MessageRole.USER, content="And of Spain?")]
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Spain?"}]
    assert llm_module.messages_to_chat(messages) == turns
    reply = llm.chat(messages)
    assert reply.raw["usage"]["prompt_tokens"] == _chat_tokens(tiny, turns)
    with pytest.raises(ValueError, match="tool calling"):
        llm.chat([ChatMessage(role=MessageRole.TOOL, content="42")])


def test_documents_beside_a_system_prompt_or_history_are_written_into_the_user_turn(tiny):
    nodes = [TextNode(text=t, metadata={"title": f"passage {i}"}) for i, t in enumerate(TEXTS)]
    llm = FusionLLM(engine=tiny, system_prompt="Answer from the passages.", max_tokens=1)
    first = llm.complete("Who founded the festival?", documents=nodes).additional_kwargs
    assert (first["cache_hits"], first["cache_misses"]) == (0, 3)
    assert first["generation_result"].extra["documents"] == [n.node_id for n in nodes]  # fused through chat
    history = [ChatMessage(role=MessageRole.USER, content="Hello."),
               ChatMessage(role=MessageRole.ASSISTANT, content="Hi."),
               ChatMessage(role=MessageRole.USER, content="Who was the first director?")]
    again = llm.chat(history, documents=nodes).additional_kwargs
    assert (again["cache_hits"], again["cache_misses"]) == (3, 0)
    with pytest.raises(ValueError, match="needs a user message"):
        llm.chat([ChatMessage(role=MessageRole.ASSISTANT, content="Hi.")], documents=nodes)


def test_context_window_is_reported_and_capped(tiny):
    assert FusionLLM(engine=tiny).metadata.context_window == tiny.context_window
    assert FusionLLM(engine=tiny, context_window=512).metadata.context_window == 512
    with pytest.raises(ValueError, match="over the engine's context window"):
        FusionLLM(engine=tiny, context_window=tiny.context_window + 1)
    assert FusionLLM(engine=tiny, model_name="my-model").metadata.model_name == "my-model"
    assert FusionLLM(engine=tiny).metadata.model_name == tiny.model_name


def test_generate_kwargs_are_checked_and_used(tiny):
    llm = FusionLLM(engine=tiny, generate_kwargs={"temperature": 1.0, "seed": 3, "depth": 0.5, "max_tokens": 4})
    a = llm.complete("Tell me a story.").text
    assert a == llm.complete("Tell me a story.").text  # seeded through generate_kwargs
    for bad, match in [({"temprature": 1.0}, "temprature"), ({"temperature": -1}, "temperature"),
                       ({"depth": "deep"}, "depth")]:
        with pytest.raises(ValueError, match=match):
            FusionLLM(engine=tiny, generate_kwargs=bad)
    with pytest.raises(ValueError, match="set twice"):
        FusionLLM(engine=tiny, temperature=0.5, generate_kwargs={"temperature": 0.7})
    # strategy options follow their strategy: another strategy per call does not get them
    assert llm.complete("Q?", strategy="full").additional_kwargs["strategy"] == "full"


def test_seed_none_is_unseeded_and_a_seed_repeats(tiny):
    prompt = "Tell me a story about the sea."
    free = FusionLLM(engine=tiny, temperature=1.0, max_tokens=8)
    texts = [free.complete(prompt).additional_kwargs["generation_result"].token_ids for _ in range(3)]
    assert len({tuple(t) for t in texts}) > 1, texts
    fixed = FusionLLM(engine=tiny, temperature=1.0, max_tokens=8, seed=11)
    seeded = [fixed.complete(prompt).additional_kwargs["generation_result"].token_ids for _ in range(3)]
    assert seeded[0] == seeded[1] == seeded[2]


def test_token_counting_handler_counts_engine_tokens(tiny):
    counter = TokenCountingHandler()
    llm = FusionLLM(engine=tiny, max_tokens=4, callback_manager=CallbackManager([counter]))
    out = llm.complete("When was it built?", documents=[TextNode(text="The observatory was built in 1887 on "
                                                                   "the slopes above the harbour.")])
    streamed = list(llm.stream_chat([ChatMessage(role=MessageRole.USER, content="And who ran it?")]))
    first, last = out.additional_kwargs["generation_result"], streamed[-1].additional_kwargs["generation_result"]
    assert counter.prompt_llm_token_count == first.prompt_tokens + last.prompt_tokens
    assert counter.completion_llm_token_count == len(first.token_ids) + len(last.token_ids)
    assert out.raw["usage"]["prompt_tokens_details"]["cached_tokens"] == out.raw["usage"]["cached_tokens"]


def test_unfused_long_prompt_warns_once(tiny, caplog):
    llm = FusionLLM(engine=tiny, max_tokens=1)
    long_prompt = "Context: " + "the lanterns of Quillon are lit every spring evening. " * 25 + "\nQuestion: when?"
    assert len(long_prompt) > llm_module.UNFUSED_WARNING_CHARS
    llm_module._warned.discard("unfused")
    with caplog.at_level(logging.WARNING, logger="kvfuse"):
        llm.complete("short one?")  # short: no warning
        assert not caplog.records
        llm.complete(long_prompt)
        llm.complete(long_prompt)
    messages = [r.getMessage() for r in caplog.records if r.name == "kvfuse"]
    assert len(messages) == 1 and "KVFusePrecompute" in messages[0] and "FusionQueryEngine" in messages[0]
    # a registered document inside a long prompt fuses: no warning needed (and none given)
    body = "The Quillon festival was founded in 1923 by Tomas Reyes; every spring the streets fill with lanterns."
    tiny.register([("quillon", body)])
    out = llm.complete("Context:\n" + body + "\n\n" + "Please answer briefly. " * 45 + "\nWho founded it?")
    assert out.additional_kwargs["generation_result"].extra["documents"] == ["quillon"]


# --- KVFusePrecompute: progress, workers, deleting (tiny engine) ------------------------------------------------

def _li_docs():
    return [LIDocument(text=t, metadata={"title": f"passage {i}"}, doc_id=f"src-{i}") for i, t in enumerate(TEXTS)]


def test_show_progress_draws_a_bar(tiny, capsys):
    KVFusePrecompute(tiny, show_progress=True)([TextNode(text=t) for t in TEXTS])
    err = capsys.readouterr().err
    assert "kvfuse precompute" in err and "3/3" in err
    KVFusePrecompute(tiny)([TextNode(text=t + " Again.") for t in TEXTS])
    assert "kvfuse precompute" not in capsys.readouterr().err


def test_precompute_registers_node_bodies_found_in_stock_prompts(tiny):
    pre = KVFusePrecompute(tiny)
    nodes = [TextNode(text=t, metadata={"title": f"passage {i}"}) for i, t in enumerate(TEXTS)]
    pre(nodes)
    assert (pre.last_report.misses, len(tiny.registry)) == (3, 3)
    llm = FusionLLM(engine=tiny, max_tokens=1)
    # the text LlamaIndex's templates put in prompts: metadata header + body
    context = "\n\n".join(n.get_content(metadata_mode=MetadataMode.LLM) for n in nodes)
    out = llm.complete(f"Context information is below.\n---------------------\n{context}\n---------------------\n"
                       "Query: who founded the festival?\nAnswer: ")
    stats = out.additional_kwargs
    assert (stats["cache_hits"], stats["cache_misses"]) == (3, 0)
    assert stats["generation_result"].extra["documents"] == [n.node_id for n in nodes]


def test_num_workers_fails_at_once_with_a_clear_error(tiny):
    pre = KVFusePrecompute(tiny)
    with pytest.raises(TypeError, match="can't be sent to another process"):
        pickle.dumps(pre)
    with pytest.raises(TypeError, match="can't be sent to another process"):
        pickle.dumps(FusionLLM(engine=tiny))
    pipeline = IngestionPipeline(transformations=[SentenceSplitter(), pre], disable_cache=True)
    with pytest.raises(TypeError, match="num_workers"):
        pipeline.run(documents=_li_docs(), num_workers=2)
    with pytest.raises(TypeError, match="num_workers"):
        asyncio.run(pipeline.arun(documents=_li_docs(), num_workers=2))
    assert pre.last_report is None  # nothing ran half-way
    nodes = pipeline.run(documents=_li_docs())  # the single-process run works
    assert len(nodes) == 3 and pre.last_report.misses == 3


def test_delete_ref_doc_evicts_the_caches(tiny, li_embed_model):
    pre = KVFusePrecompute(tiny)
    index = VectorStoreIndex.from_documents(_li_docs(), embed_model=li_embed_model,
                                            transformations=[SentenceSplitter(), pre])
    entries = tiny.cache_stats()["memory_entries"]
    node_ids = pre.node_ids("src-0", index)
    assert len(node_ids) == 1 and node_ids[0] in index.docstore.docs
    assert pre.delete_ref_doc(index, "src-0", delete_from_docstore=True) == 1
    assert node_ids[0] not in index.docstore.docs and node_ids[0] not in tiny.registry
    assert tiny.cache_stats()["memory_entries"] == entries - 1
    # the deleted body is no longer found in a prompt; the others still are
    llm = FusionLLM(engine=tiny, max_tokens=1)
    found = llm.complete("Context:\n" + "\n\n".join(TEXTS) + "\n\nQuestion: who?").additional_kwargs
    assert found["cache_hits"] == 2 and len(found["generation_result"].extra["documents"]) == 2
    # forget(), by source document id, with the docstore telling the node ids
    other = [n for n in index.docstore.docs.values() if n.ref_doc_id == "src-1"][0]
    fresh = KVFusePrecompute(tiny)  # knows nothing of this ingestion: the index tells it
    assert fresh.forget("src-1", index=index) == 1 and other.node_id not in tiny.registry
    assert fresh.forget("src-1", index=index) == 0  # already gone


# these prompts are tiny: the sparse kernel runs whatever it saves (sift attends densely below its bounds)
SIFT4, SIFT8 = "sift:block=4:min_tokens=0:max_density=1.0", "sift:block=8:min_tokens=0:max_density=1.0"


def test_sift_indexes_ride_in_node_metadata_through_a_persisted_index(tiny_engine, tmp_path):
    from llama_index.core import StorageContext, load_index_from_storage
    from llama_index.core.embeddings import MockEmbedding

    from kvfuse.integrations._bridge import SIFT_METADATA_KEY

    ingest = tiny_engine("llama")
    nodes = [TextNode(text=t, metadata={"title": f"passage {i}"}) for i, t in enumerate(TEXTS)]
    views = [(n.get_content(metadata_mode=MetadataMode.LLM), n.get_content(metadata_mode=MetadataMode.EMBED))
             for n in nodes]
    pre = KVFusePrecompute(ingest, strategy=SIFT4)
    pre(nodes)
    assert pre.last_report.misses == 3 and ingest.cache_stats()["memory_entries"] <= 1  # indexes, no K/V entries
    for n, (llm_view, embed_view) in zip(nodes, views):
        assert len(n.metadata[SIFT_METADATA_KEY]) > 100
        # out of what the LLM and the embedder see
        assert (n.get_content(metadata_mode=MetadataMode.LLM), n.get_content(metadata_mode=MetadataMode.EMBED)) == (
            llm_view, embed_view)
    embed = MockEmbedding(embed_dim=8)
    VectorStoreIndex(nodes, embed_model=embed).storage_context.persist(str(tmp_path))
    index = load_index_from_storage(StorageContext.from_defaults(persist_dir=str(tmp_path)), embed_model=embed)

    serve = tiny_engine("llama")  # another process's engine: no index store, no cache
    qe = FusionQueryEngine.from_index(index, engine=serve, similarity_top_k=3, strategy=SIFT4, max_tokens=2)
    sift = qe.query("Who founded the festival?").metadata["kvfuse"]["extra"]["sift"]
    assert (sift["index_carried"], sift["index_computed"], sift["index_rejected"]) == (3, 0, 0)
    assert len(serve.sift_indexes) == 0

    # an index damaged in the store, or made with other settings, is refused; the request still answers
    node_id = nodes[0].node_id
    stored = index.docstore.get_node(node_id)
    stored.metadata[SIFT_METADATA_KEY] = "A" + stored.metadata[SIFT_METADATA_KEY][1:]
    index.docstore.add_documents([stored], allow_update=True)
    index.vector_store.data.metadata_dict.pop(node_id, None)
    got = FusionQueryEngine.from_index(index, engine=serve, similarity_top_k=3, strategy=SIFT4,
                                       max_tokens=2).query("Who founded the festival?")
    assert got.metadata["kvfuse"]["extra"]["sift"]["index_rejected"] == 1
    other = FusionQueryEngine.from_index(index, engine=serve, similarity_top_k=3, strategy=SIFT8,
                                         max_tokens=2).query("Who founded the festival?")
    assert other.metadata["kvfuse"]["extra"]["sift"]["index_rejected"] == 3
