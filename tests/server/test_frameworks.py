"""LlamaIndex's OpenAILike and LangChain's ChatOpenAI, unchanged, against the real server: their answers equal
the openai client's, streaming included, and documents in extra_body are fused."""
from __future__ import annotations

import asyncio

import pytest
from serving import DOCS, KEY

MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": f"{DOCS[0]['text']}\n\nWhen was the observatory built?"}]


@pytest.fixture(scope="module")
def reference(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=10, temperature=0)
    return r.choices[0].message.content


def test_llama_index_openai_like(server, reference):
    pytest.importorskip("llama_index.llms.openai_like", reason="llama-index-llms-openai-like is in the dev extra")
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=server.model, api_base=f"{server.url}/v1", api_key=KEY, is_chat_model=True,
                     context_window=4096, max_tokens=10, temperature=0, max_retries=0)
    msgs = [ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]
    assert llm.chat(msgs).message.content == reference
    assert "".join(r.delta for r in llm.stream_chat(msgs)) == reference
    assert asyncio.run(llm.achat(msgs)).message.content == reference

    # the completion path goes to /v1/completions: the prompt is the question over the documents
    llm_c = OpenAILike(model=server.model, api_base=f"{server.url}/v1", api_key=KEY, is_chat_model=False,
                       max_tokens=6, temperature=0, max_retries=0,
                       additional_kwargs={"extra_body": {"documents": [DOCS[1]]}})
    done = llm_c.complete("Who was the first director?")
    ext = done.raw.model_extra["kvfuse"]
    assert done.text and ext["cache_hits"] + ext["cache_misses"] == 1


def test_langchain_chat_openai(server, reference):
    pytest.importorskip("langchain_openai", reason="langchain-openai is in the dev extra")
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=server.model, base_url=f"{server.url}/v1", api_key=KEY, max_tokens=10, temperature=0,
                     max_retries=0, stream_usage=True)
    pairs = [(m["role"], m["content"]) for m in MESSAGES]
    msg = llm.invoke(pairs)
    assert msg.content == reference
    assert msg.usage_metadata["input_tokens"] > 0
    chunks = list(llm.stream(pairs))
    assert "".join(c.content for c in chunks) == reference
    assert asyncio.run(llm.ainvoke(pairs)).content == reference

    with_docs = llm.bind(extra_body={"documents": [DOCS[2]]})
    a = with_docs.invoke([("user", "Who founded the festival?")])
    b = with_docs.invoke([("user", "Who founded the festival?")])
    assert b.usage_metadata["input_token_details"]["cache_read"] > 0
    assert a.content == b.content
