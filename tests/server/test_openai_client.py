"""The official openai client against the real server: answers equal the engine's, streams equal non-streams,
documents are fused and served from cache."""
from __future__ import annotations

import asyncio

import pytest
from serving import DOCS, KEY

openai = pytest.importorskip("openai", reason="the openai client is part of the dev extra")

QUESTION = "When was the Larkspur Observatory built?"


def _rag_messages() -> list[dict]:
    """The stock RAG prompt: retrieved bodies pasted into the user turn."""
    context = "".join(f"{d['text']}\n\n" for d in DOCS[:2])
    return [{"role": "system", "content": "Answer from the context."},
            {"role": "user", "content": f"Context:\n{context}Question: {QUESTION}"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]


def test_chat_equals_the_engine_in_process(client, server, local_engine):
    messages = _rag_messages()
    docs = [{"id": d["id"], "text": d["text"]} for d in DOCS[:2]]
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=12, temperature=0,
                                       extra_body={"documents": docs})
    want = local_engine.chat(messages, docs, max_new_tokens=12, temperature=0.0)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == want.prompt_tokens
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.prompt_tokens_details.cached_tokens == want.usage()["cached_tokens"] > 0
    assert r.model_extra["kvfuse"]["documents"] == ["lark", "voss"]


def test_completions_equal_generate(client, server, local_engine):
    docs = [{"id": d["id"], "text": d["text"]} for d in DOCS]
    r = client.completions.create(model=server.model, prompt=QUESTION, max_tokens=10, temperature=0,
                                  extra_body={"documents": docs, "strategy": "cacheblend", "recompute_ratio": 0.3})
    want = local_engine.generate(QUESTION, docs, max_new_tokens=10, temperature=0.0, strategy="cacheblend",
                                 recompute_ratio=0.3)
    assert r.choices[0].text == want.text
    assert r.usage.prompt_tokens == want.prompt_tokens
    assert r.model_extra["kvfuse"]["strategy"] == "cacheblend"


def test_stream_concatenation_equals_the_plain_answer(client, server):
    kw = dict(model=server.model, messages=_rag_messages(), max_tokens=14, temperature=0, seed=3)
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens_details.cached_tokens


def test_completions_stream_equals_plain(client, server):
    kw = dict(model=server.model, prompt="Who directed the observatory?", max_tokens=9, temperature=0)
    plain = client.completions.create(**kw)
    text = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert text == plain.choices[0].text


def test_documents_given_alone_are_fused_and_cached_the_second_time(client, server):
    docs = [{"id": "q-alone", "title": "Festival", "text": DOCS[2]["text"] + " (alone)"}]
    kw = dict(model=server.model, messages=[{"role": "user", "content": "Who founded the festival?"}],
              max_tokens=4, temperature=0)
    first = client.chat.completions.create(**kw, extra_body={"documents": docs})
    assert first.model_extra["kvfuse"]["documents"] == ["q-alone"]
    assert first.model_extra["kvfuse"]["cache_misses"] == 1
    second = client.chat.completions.create(**kw, extra_body={"documents": ["q-alone"]})  # by id now
    assert second.model_extra["kvfuse"]["cache_hits"] == 1 and second.model_extra["kvfuse"]["cache_misses"] == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].message.content == first.choices[0].message.content


def test_async_client_stream_and_plain(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        kw = dict(model=server.model, messages=_rag_messages(), max_tokens=8, temperature=0)
        plain, stream = await asyncio.gather(client.chat.completions.create(**kw),
                                             client.chat.completions.create(**kw, stream=True))
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await client.close()
        return plain.choices[0].message.content, text

    plain, streamed = asyncio.run(main())
    assert streamed == plain


def test_sampling_with_a_seed_is_reproducible(client, server):
    kw = dict(model=server.model, messages=[{"role": "user", "content": "Say something."}], max_tokens=8,
              temperature=1.0, top_p=0.9, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b
