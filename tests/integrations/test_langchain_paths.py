"""The paths LangChain users actually take, on real parts: SmolLM2-135M, the offline MiniLM embedder, an
InMemoryVectorStore retriever over HotpotQA passages precomputed at ingestion (`KVFusePrecompute`).

For each path: does it fuse (cache hits over retrieved documents), do LangChain's token counts
(`UsageMetadataCallbackHandler`, cache reads included) equal the engine's, is the answer traced as a chat-model
call (`astream_events(version="v2")` has `on_chat_model_stream`). The table of what was measured is printed at
the end of the module (and written to $KVFUSE_PATHS_TABLE when set). Then ChatKVFuse's settings (max_tokens, n,
model_kwargs, timeout, seed, unknown settings) and structured output (parsing on a scripted engine, then the real
model once).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("langchain_core")

from langchain_core.callbacks import UsageMetadataCallbackHandler  # noqa: E402
from langchain_core.documents import Document as LCDocument  # noqa: E402
from langchain_core.exceptions import OutputParserException  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnablePassthrough  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402
from typing_extensions import TypedDict  # noqa: E402

from kvfuse.engine.fusion.base import budget_for  # noqa: E402
from kvfuse.engine.types import GenerationResult, GenerationStream  # noqa: E402
from kvfuse.integrations.langchain import (ChatKVFuse, FusionRunnable, KVFusePrecompute,  # noqa: E402
                                           lc_documents_to_documents)
from kvfuse.integrations.langchain import chat_models  # noqa: E402
from kvfuse.integrations.langchain.chat_models import messages_to_chat  # noqa: E402

TOP_K = 2
RATIO = 0.15
MAX_NEW = 8
N_PASSAGES = 10  # the passages of the first sample question (what the vector store holds)

ROWS: dict[str, dict[str, str]] = {}  # path -> the table's cells
slow = pytest.mark.slow  # the tests on SmolLM2 (the structured-output parsing tests use a scripted engine)


def _row(path: str, **cells: str) -> None:
    ROWS.setdefault(path, {}).update(cells)


@pytest.fixture(scope="module", autouse=True)
def path_table(request):
    yield ROWS
    if not ROWS:
        return
    lines = ["| path | fuses (hits/total) | token counts right | traced |", "|---|---|---|---|"]
    for path, cells in ROWS.items():
        lines.append(f"| {path} | {cells.get('fuses', '-')} | {cells.get('tokens', '-')} | "
                     f"{cells.get('traced', '-')} |")
    table = "\n".join(lines)
    out = os.environ.get("KVFUSE_PATHS_TABLE")
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(table + "\n")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n\n" + table)


# --- real parts ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def passages(hotpot):
    return [LCDocument(p["text"], id=p["id"], metadata={"title": p["title"]}) for p in hotpot["passages"][:N_PASSAGES]]


@pytest.fixture(scope="module")
def rag(make_engine, passages, lc_embeddings):
    """(engine, retriever): a fresh SmolLM2 engine whose corpus was precomputed at ingestion (KVFusePrecompute
    in front of the vector store), and a top-k retriever over that store."""
    from langchain_core.vectorstores import InMemoryVectorStore

    eng = make_engine(dtype="fp32")
    pre = KVFusePrecompute(eng)
    store = InMemoryVectorStore(lc_embeddings)
    store.add_documents(list(pre.transform_documents(passages)))
    assert (pre.last_report.hits, pre.last_report.misses) == (0, N_PASSAGES)  # every passage computed once
    yield eng, store.as_retriever(search_kwargs={"k": TOP_K})
    eng.close()


@pytest.fixture(scope="module")
def engine(rag):
    return rag[0]


@pytest.fixture(scope="module")
def retriever(rag):
    return rag[1]


def _format_docs(docs) -> str:
    return "\n\n".join(d.page_content for d in docs)


PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Answer the question from the context, briefly."),
    ("human", "Context:\n{context}\n\nQuestion: {question}"),
])

Q1 = "Rafael de Souza Pereira is a defensive midfielder for what organization?"
Q2 = "Which league is the top level of the Mexican football league system?"


def _doc_tokens(engine, docs) -> int:
    """Token count of the documents as cached (body + the engine's document suffix), counted independently."""
    return sum(len(engine.prompts.encode_document(d)) for d in lc_documents_to_documents(docs))


def _check_fused(stats: dict, engine, docs) -> None:
    """All retrieved documents found in the prompt and served from their caches, the rest recomputed as asked."""
    assert (stats["cache_hits"], stats["cache_misses"]) == (len(docs), 0)
    assert stats["doc_tokens"] == _doc_tokens(engine, docs)
    assert stats["recomputed_tokens"] == budget_for(RATIO, stats["doc_tokens"])


def _check_usage(usage: dict, stats: dict) -> None:
    """LangChain's usage record equals the engine's counts (cache reads = document tokens not recomputed)."""
    assert usage["input_tokens"] == stats["prompt_tokens"]
    assert usage["output_tokens"] == stats["output_tokens"] > 0
    assert usage["total_tokens"] == stats["prompt_tokens"] + stats["output_tokens"]
    assert usage["input_token_details"]["cache_read"] == stats["doc_tokens"] - stats["recomputed_tokens"]


def _handler_total(handler: UsageMetadataCallbackHandler, model_name: str) -> dict:
    assert list(handler.usage_metadata) == [model_name]
    return handler.usage_metadata[model_name]


def _sum_usage(*usages: dict) -> dict:
    return {"input_tokens": sum(u["input_tokens"] for u in usages),
            "output_tokens": sum(u["output_tokens"] for u in usages),
            "total_tokens": sum(u["total_tokens"] for u in usages),
            "input_token_details": {"cache_read": sum(u["input_token_details"]["cache_read"] for u in usages)}}


def _events(runnable, value, handler, **kwargs):
    async def run():
        return [e async for e in runnable.astream_events(value, version="v2", config={"callbacks": [handler]},
                                                          **kwargs)]

    return asyncio.run(run())


def _streamed(events) -> tuple[str, dict]:
    """(text of the on_chat_model_stream events, usage of the chat model's end event)."""
    text = "".join(e["data"]["chunk"].text for e in events if e["event"] == "on_chat_model_stream")
    ends = [e for e in events if e["event"] == "on_chat_model_end"]
    assert len(ends) == 1
    return text, ends[0]["data"]["output"].usage_metadata


# --- the paths -------------------------------------------------------------------------------------------------

@slow
def test_textbook_lcel_chain_fuses_precomputed_documents(engine, retriever, caplog):
    chat = ChatKVFuse(engine=engine, recompute_ratio=RATIO, max_tokens=MAX_NEW)
    chain = {"context": retriever | _format_docs, "question": RunnablePassthrough()} | PROMPT | chat
    docs = retriever.invoke(Q1)
    assert len(docs) == TOP_K
    handler = UsageMetadataCallbackHandler()
    with caplog.at_level(logging.WARNING, logger="kvfuse"):
        msg = chain.invoke(Q1, config={"callbacks": [handler]})
    stats = msg.response_metadata["kvfuse"]
    _check_fused(stats, engine, docs)
    assert stats["extra"]["documents"] == [d.id for d in docs]  # found by content, in prompt order
    _check_usage(msg.usage_metadata, stats)
    assert _handler_total(handler, chat.model_name) == msg.usage_metadata
    assert msg.response_metadata["token_usage"]["cached_tokens"] == msg.usage_metadata["input_token_details"][
        "cache_read"]
    assert stats["ttft_s"] >= stats["queue_s"] >= 0
    assert not [r for r in caplog.records if "fused no document" in r.getMessage()]
    _row("textbook LCEL `{context: retriever \\| format_docs, question} \\| prompt \\| ChatKVFuse`",
         fuses=f"{stats['cache_hits']}/{TOP_K}")

    events = _events(chain, Q1, handler)
    text, usage = _streamed(events)
    assert text == msg.content  # the same fused request, streamed
    assert usage == msg.usage_metadata
    assert _handler_total(handler, chat.model_name) == _sum_usage(msg.usage_metadata, usage)
    _row("textbook LCEL `{context: retriever \\| format_docs, question} \\| prompt \\| ChatKVFuse`",
         tokens="yes (incl. cache_read)", traced="yes (on_chat_model_stream)")


@slow
def test_chat_model_with_documents_argument(engine, retriever):
    chat = ChatKVFuse(engine=engine, recompute_ratio=RATIO, max_tokens=MAX_NEW)
    docs = retriever.invoke(Q2)
    handler = UsageMetadataCallbackHandler()
    msg = chat.invoke(Q2, documents=docs, config={"callbacks": [handler]})
    stats = msg.response_metadata["kvfuse"]
    _check_fused(stats, engine, docs)
    assert stats["prompt_tokens"] == engine.layout(Q2, lc_documents_to_documents(docs)).n  # generate's RAG layout
    _check_usage(msg.usage_metadata, stats)
    assert _handler_total(handler, chat.model_name) == msg.usage_metadata
    path = "`ChatKVFuse.invoke(question, documents=docs)`"
    _row(path, fuses=f"{stats['cache_hits']}/{TOP_K}")

    events = _events(chat.bind(documents=docs), Q2, handler)
    text, usage = _streamed(events)
    assert text == msg.content and usage == msg.usage_metadata
    assert _handler_total(handler, chat.model_name) == _sum_usage(msg.usage_metadata, usage)
    _row(path, tokens="yes (incl. cache_read)", traced="yes (on_chat_model_stream)")


@slow
def test_fusion_runnable_is_traced_as_a_chat_model(engine, retriever):
    fusion = FusionRunnable(engine, recompute_ratio=RATIO, max_tokens=MAX_NEW)
    chain = {"question": RunnablePassthrough(), "documents": retriever} | fusion
    handler = UsageMetadataCallbackHandler()
    out = chain.invoke(Q1, config={"callbacks": [handler]})
    assert set(out) == {"answer", "question", "documents", "kvfuse"}  # the documented output is kept
    stats = out["kvfuse"]
    _check_fused(stats, engine, out["documents"])
    assert stats["output_tokens"] <= MAX_NEW
    usage = _handler_total(handler, engine.model_name)
    _check_usage(usage, stats)
    path = "`{question, documents: retriever} \\| FusionRunnable`"
    _row(path, fuses=f"{stats['cache_hits']}/{TOP_K}")

    events = _events(chain, Q1, handler)
    text, streamed_usage = _streamed(events)
    assert text == out["answer"]
    assert [e for e in events if e["event"] == "on_chain_stream" and e["name"] == "FusionRunnable"]
    assert _handler_total(handler, engine.model_name) == _sum_usage(usage, streamed_usage)
    _row(path, tokens="yes (incl. cache_read)", traced="yes (on_chat_model_stream)")


@slow
def test_multi_turn_chat_goes_through_the_chat_template_and_fuses(engine, retriever):
    chat = ChatKVFuse(engine=engine, recompute_ratio=RATIO, max_tokens=MAX_NEW)
    docs = retriever.invoke(Q1)
    messages = [SystemMessage("Answer from the context, briefly."),
                HumanMessage(f"Context:\n{_format_docs(docs)}\n\nQuestion: {Q1}"),
                AIMessage("Liga MX."),
                HumanMessage("Which club does he play for?")]
    handler = UsageMetadataCallbackHandler()
    msg = chat.invoke(messages, config={"callbacks": [handler]})
    stats = msg.response_metadata["kvfuse"]
    assert (stats["cache_hits"], stats["cache_misses"]) == (TOP_K, 0)
    assert stats["extra"]["documents"] == [d.id for d in docs]
    # the turns went through the chat template (not flattened into one question): the fused prompt has the
    # template's token count, up to tokenization at the document edges
    text = engine.tokenizer.apply_chat_template(messages_to_chat(messages), tokenize=False, add_generation_prompt=True)
    templated = len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert abs(stats["prompt_tokens"] - templated) <= 2 * TOP_K
    flattened = engine.layout("\n\n".join(m.text for m in messages), []).n  # what the old flattening sent
    assert abs(flattened - templated) > 2 * TOP_K
    _check_usage(msg.usage_metadata, stats)
    assert _handler_total(handler, chat.model_name) == msg.usage_metadata
    path = "multi-turn chat (system, human + context, ai, human) `\\| ChatKVFuse`"
    _row(path, fuses=f"{stats['cache_hits']}/{TOP_K}")

    events = _events(chat, messages, handler)
    streamed, usage = _streamed(events)
    assert streamed == msg.content and usage == msg.usage_metadata
    _row(path, tokens="yes (incl. cache_read)", traced="yes (on_chat_model_stream)")


@slow
def test_a_prompt_that_cannot_fuse_warns_once(engine, hotpot, caplog):
    chat_models._warned.clear()
    others = "\n\n".join(p["text"] for p in hotpot["passages"][10:15])  # never precomputed nor registered
    chat = ChatKVFuse(engine=engine, max_tokens=1)
    with caplog.at_level(logging.WARNING, logger="kvfuse"):
        first = chat.invoke(f"Context:\n{others}\n\nQuestion: where was the armory?")
        second = chat.invoke(f"Context:\n{others}\n\nQuestion: which musket?")
    for msg in (first, second):
        stats = msg.response_metadata["kvfuse"]
        assert stats["prompt_tokens"] >= chat_models.UNFUSED_WARNING_TOKENS
        assert (stats["cache_hits"], stats["cache_misses"], stats["doc_tokens"]) == (0, 0, 0)
        assert msg.usage_metadata["input_token_details"]["cache_read"] == 0
    warnings = [r for r in caplog.records if r.name == "kvfuse" and "fused no document" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "FusionRunnable" in warnings[0].getMessage() and "KVFusePrecompute" in warnings[0].getMessage()
    _row("stuffed prompt, documents never precomputed", fuses="0/5 (one-time warning on logger kvfuse)",
         tokens="yes (cache_read 0)")


@slow
def test_registered_documents_are_found_and_computed_on_first_use(engine, hotpot):
    docs = [LCDocument(p["text"], id=p["id"]) for p in hotpot["passages"][15:17]]  # not in the store
    pre = KVFusePrecompute(engine, compute=False)
    assert pre.transform_documents(docs) == docs and pre.registered == 2 and pre.last_report is None
    chat = ChatKVFuse(engine=engine, max_tokens=1, recompute_ratio=RATIO)
    chain = PROMPT | chat
    first = chain.invoke({"context": _format_docs(docs), "question": "Which musket?"})
    again = chain.invoke({"context": _format_docs(docs), "question": "Where was it made?"})
    s1, s2 = first.response_metadata["kvfuse"], again.response_metadata["kvfuse"]
    assert (s1["cache_hits"], s1["cache_misses"]) == (0, 2) and s1["doc_tokens"] == _doc_tokens(engine, docs)
    assert (s2["cache_hits"], s2["cache_misses"]) == (2, 0)
    assert engine.forget([d.id for d in docs]) == 2
    gone = chain.invoke({"context": _format_docs(docs), "question": "Which musket?"}).response_metadata["kvfuse"]
    assert (gone["cache_hits"], gone["doc_tokens"]) == (0, 0)  # forgotten: plain text again
    _row("`KVFusePrecompute(engine, compute=False)` (registered only), stuffed prompt",
         fuses=f"1st call 0/2 (found, computed), 2nd {s2['cache_hits']}/2")


# --- settings --------------------------------------------------------------------------------------------------

@slow
def test_unknown_and_misplaced_settings_are_rejected(engine):
    with pytest.raises(ValueError, match="unknown settings.*temprature"):
        ChatKVFuse(engine=engine, temprature=0.5)
    with pytest.raises(ValueError, match="model_kwargs.*temperature"):
        ChatKVFuse(engine=engine, model_kwargs={"temperature": 1.0})
    with pytest.raises(ValueError, match="bogus"):
        ChatKVFuse(engine=engine, model_kwargs={"bogus": 1})  # checked against the strategy's options
    with pytest.raises(ValueError, match="streaming=True needs n=1"):
        ChatKVFuse(engine=engine, n=2, streaming=True)
    with pytest.raises(ValueError):
        ChatKVFuse(engine=engine, n=0)
    with pytest.raises(ValueError):
        ChatKVFuse(engine=engine, timeout=0)
    chat = ChatKVFuse(engine=engine, max_tokens=2)
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['temprature'\\]"):
        chat.invoke("hi", temprature=0.3)
    with pytest.raises(TypeError, match="both max_tokens and max_new_tokens"):
        chat.invoke("hi", max_tokens=2, max_new_tokens=3)
    with pytest.raises(ValueError, match="unknown settings.*max_tokenz"):
        FusionRunnable(engine, max_tokenz=3)


@slow
def test_max_tokens_one_setting_two_spellings(engine):
    for chat, kwargs in ((ChatKVFuse(engine=engine, max_tokens=3), {}),
                         (ChatKVFuse(engine=engine, max_new_tokens=3), {}),
                         (ChatKVFuse(engine=engine, max_tokens=40), {"max_tokens": 3})):
        assert chat.max_tokens == (40 if kwargs else 3)
        msg = chat.invoke("Write a long story about a cat.", **kwargs)
        assert (msg.usage_metadata["output_tokens"], msg.response_metadata["finish_reason"]) == (3, "length")


@slow
def test_model_kwargs_reach_the_strategy(engine, passages):
    docs = passages[:2]
    plain = ChatKVFuse(engine=engine, strategy="epic", recompute_ratio=0.5, max_tokens=1)
    capped = ChatKVFuse(engine=engine, strategy="epic", recompute_ratio=0.5, max_tokens=1,
                        model_kwargs={"max_per_doc": 2})
    a = plain.invoke("Who?", documents=docs).response_metadata["kvfuse"]
    b = capped.invoke("Who?", documents=docs).response_metadata["kvfuse"]
    # the first document, cached right after the same prefix, is exact: never recomputed; the budget (half of all
    # document tokens) goes to the second, up to its length
    assert 4 < a["recomputed_tokens"] <= budget_for(0.5, a["doc_tokens"])
    assert b["recomputed_tokens"] == 2  # epic's cap: 2 tokens in the one recomputable document
    # another strategy per call: the model_kwargs (epic's) are not sent to it
    c = capped.invoke("Who?", documents=docs, strategy="cacheblend").response_metadata["kvfuse"]
    assert c["strategy"] == "cacheblend" and c["recomputed_tokens"] == a["recomputed_tokens"]


@slow
def test_seed_none_is_unseeded_and_a_seed_repeats(engine):
    prompt = "Tell me a story about a dragon."
    free = ChatKVFuse(engine=engine, temperature=1.0, max_tokens=MAX_NEW)
    texts = [free.invoke(prompt).content for _ in range(3)]
    assert len(set(texts)) > 1, texts
    fixed = ChatKVFuse(engine=engine, temperature=1.0, max_tokens=MAX_NEW, seed=1234)
    once, again = fixed.invoke(prompt), fixed.invoke(prompt)
    assert once.content == again.content and once.response_metadata["seed"] == 1234
    assert free.invoke(prompt, seed=1234).content == once.content  # a per-call seed


@slow
def test_n_generations(engine):
    chat = ChatKVFuse(engine=engine, temperature=1.0, max_tokens=4, seed=99, n=2)
    result = chat.generate([[HumanMessage("Name a colour.")]])
    gens = result.generations[0]
    assert len(gens) == 2
    assert [g.message.response_metadata["seed"] for g in gens] == [99, 100]
    single = ChatKVFuse(engine=engine, temperature=1.0, max_tokens=4, seed=100).invoke("Name a colour.")
    assert gens[1].message.content == single.content  # generation i is sampled with seed + i
    total = result.llm_output["token_usage"]
    assert total["completion_tokens"] == sum(g.message.usage_metadata["output_tokens"] for g in gens)
    assert chat.invoke("Name a colour.").content == gens[0].message.content  # invoke returns the first
    chunks = list(chat.stream("Name a colour."))  # n > 1 does not stream token by token: the first, whole
    assert len(chunks) == 1 and chunks[0].content == gens[0].message.content


@slow
def test_timeout_cancels_a_slow_call(engine, passages):
    chat = ChatKVFuse(engine=engine, max_tokens=MAX_NEW, timeout=0.02)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="timeout=0.02s"):
        chat.invoke("Tell me a story.", documents=passages[:3])
    with pytest.raises(TimeoutError, match="timeout=0.02s"):
        list(chat.stream("Tell me a story.", documents=passages[:3]))
    assert time.perf_counter() - t0 < 30

    # time waiting for a busy engine counts: hold the engine (as a running request does) past the deadline
    waiting = ChatKVFuse(engine=engine, max_tokens=2, timeout=0.5)
    with engine.scheduler.exclusive():
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError):
            waiting.invoke("hi")
        elapsed = time.perf_counter() - t0
        time.sleep(0.2)  # the cancelled request gives up waiting: it must not take the engine after this
    assert 0.5 <= elapsed < 0.5 + 2.0, elapsed  # raised at the deadline, not when the engine came free
    assert not engine.scheduler.lock.locked()
    after = ChatKVFuse(engine=engine, max_tokens=2, timeout=120).invoke("hi")
    assert after.usage_metadata["output_tokens"] > 0  # the engine serves the next request

    async def run():
        with pytest.raises(TimeoutError):
            await chat.ainvoke("Tell me a story.", documents=passages[:3])

    asyncio.run(run())


# --- structured output -----------------------------------------------------------------------------------------

class Person(BaseModel):
    name: str
    born: int = Field(description="year of birth")


class PersonDict(TypedDict):
    name: str
    born: int


PERSON_SCHEMA = {"title": "Person", "type": "object", "properties": {
    "name": {"type": "string"}, "born": {"type": "integer"}}, "required": ["name", "born"]}


class ScriptedEngine:
    """Answers every chat with a fixed text (the real GenerationResult / GenerationStream types): for the parsing
    logic of structured output. It records the messages it was given."""

    model_name = "scripted"

    def __init__(self, text: str, finish_reason: str = "stop") -> None:
        self.text, self.finish_reason, self.seen = text, finish_reason, []

    def _result(self) -> GenerationResult:
        ids = list(range(len(self.text.split())))
        return GenerationResult(text=self.text, token_ids=ids, strategy="cacheblend", recompute_ratio=0.15,
                                finish_reason=self.finish_reason, ttft_s=0.01, prefill_s=0.01, decode_s=0.01,
                                selection_s=0.0, miss_prefill_s=0.0, prompt_tokens=20, doc_tokens=0,
                                question_tokens=20, recomputed_tokens=0, cache_hits=0, cache_misses=0)

    def chat(self, messages, documents=(), **opts):
        self.seen.append(messages)
        return self._result()

    def stream_chat(self, messages, documents=(), **opts):
        self.seen.append(messages)

        request = SimpleNamespace(cancel=threading.Event(), sink=None)

        def submit(req):  # stands in for the scheduler: the whole answer at once
            req.sink(("delta", self.text))
            req.sink(("done", self._result()))

        return GenerationStream(request, submit)

    def astream_chat(self, messages, documents=(), **opts):
        from kvfuse.engine.types import AsyncGenerationStream

        self.seen.append(messages)
        request = SimpleNamespace(cancel=threading.Event(), sink=None)

        def submit(req):
            req.sink(("delta", self.text))
            req.sink(("done", self._result()))

        return AsyncGenerationStream(request, submit)


@pytest.mark.parametrize("schema, expected", [
    (Person, Person(name="Ada", born=1815)),
    (PersonDict, {"name": "Ada", "born": 1815}),
    (PERSON_SCHEMA, {"name": "Ada", "born": 1815}),
], ids=["pydantic", "typeddict", "json_schema"])
def test_structured_output_parses_and_validates(schema, expected):
    fake = ScriptedEngine('Sure! ```json\n{"name": "Ada", "born": 1815}\n```')
    structured = ChatKVFuse(engine=fake).with_structured_output(schema)
    assert structured.invoke("Who wrote the first program?") == expected
    instruction = fake.seen[-1][-1]["content"]
    assert instruction.startswith("Who wrote the first program?") and '"born"' in instruction  # schema shown
    assert list(structured.stream("Who?")) == [expected]
    assert asyncio.run(structured.ainvoke("Who?")) == expected
    raw = ChatKVFuse(engine=fake).with_structured_output(schema, include_raw=True).invoke("Who?")
    assert raw["parsed"] == expected and raw["parsing_error"] is None and isinstance(raw["raw"], AIMessage)


@pytest.mark.parametrize("text, finish, match", [
    ("I don't know.", "stop", "did not answer with JSON"),
    ('{"name": "Ada", "born": "eighteen-fifteen"}', "stop", "does not match"),
    ('{"name": "Ada"}', "stop", "does not match"),
    ('{"name": "Ada", "bo', "length", "raise max_tokens"),
])
def test_structured_output_errors_are_clear(text, finish, match):
    for schema in (Person, PersonDict, PERSON_SCHEMA):
        chat = ChatKVFuse(engine=ScriptedEngine(text, finish))
        with pytest.raises(OutputParserException, match=match):
            chat.with_structured_output(schema).invoke("Who?")
        raw = chat.with_structured_output(schema, include_raw=True).invoke("Who?")
        assert raw["parsed"] is None and isinstance(raw["parsing_error"], OutputParserException)
        assert raw["raw"].content == text
    with pytest.raises(ValueError, match="method"):
        ChatKVFuse(engine=ScriptedEngine("{}")).with_structured_output(Person, method="xml")


class Answer(BaseModel):
    answer: str


class Impossible(BaseModel):
    year: int = Field(ge=3000, le=3001)
    confidence: float = Field(ge=0.5)
    sources: list[str] = Field(min_length=3)


@slow
def test_structured_output_on_the_real_model(engine, retriever, capsys):
    docs = retriever.invoke(Q1)
    chat = ChatKVFuse(engine=engine, recompute_ratio=RATIO, max_tokens=24)
    prompt = f"Context:\n{_format_docs(docs)}\n\nQuestion: {Q1}"
    out = chat.with_structured_output(Answer, include_raw=True).invoke(prompt)
    stats = out["raw"].response_metadata["kvfuse"]
    assert (stats["cache_hits"], stats["cache_misses"]) == (TOP_K, 0)  # the context still fuses
    if out["parsing_error"] is None:  # SmolLM2-135M may or may not write valid JSON: either is a clear outcome
        assert isinstance(out["parsed"], Answer) and out["parsed"].answer.strip()
        outcome = "valid `Answer`"
    else:
        assert isinstance(out["parsing_error"], OutputParserException) and out["parsed"] is None
        assert "ChatKVFuse structured output" in str(out["parsing_error"])
        outcome = "clear OutputParserException"
    with pytest.raises(OutputParserException, match="ChatKVFuse structured output") as failed:
        chat.with_structured_output(Impossible).invoke(prompt)
    with capsys.disabled():
        print(f"\n[structured output, SmolLM2] Answer: {out['raw'].content!r} -> {outcome}"
              f"\n  Impossible: {str(failed.value).splitlines()[0][:200]}")
    _row(f"`with_structured_output(Answer)` on a stuffed prompt (SmolLM2: {outcome})",
         fuses=f"{stats['cache_hits']}/{TOP_K}", tokens="-", traced="-")
