"""LlamaIndex adapters for kvfuse (needs the `llama-index` extra: `pip install kvfuse[llama-index]`).

- `FusionLLM`: a LlamaIndex (chat) LLM over a `FusionEngine`. Documents the engine knows are found inside the
  prompt and fused, so `index.as_query_engine(llm=...)`, `Settings.llm` and `as_chat_engine(chat_mode="context")`
  fuse; `documents=` passes them explicitly. `raw["usage"]` feeds LlamaIndex's `TokenCountingHandler`.
- `FusionQueryEngine`: any retriever + cache fusion; `Response.metadata["kvfuse"]` holds timings and cache hits.
- `FusionSynthesizer`: the response synthesizer behind it, usable in a `RetrieverQueryEngine`.
- `KVFusePrecompute`: an ingestion transform that precomputes (and registers) the caches of indexed nodes, and
  evicts them again (`delete_ref_doc`, `forget`).
- `kvfuse_cache_dir(persist_dir)`: where to point the engine's disk cache next to a persisted index.

Example:
    >>> engine = FusionEngine.from_pretrained("qwen2.5-coder-0.5b",
    ...                                       disk_cache_dir=kvfuse_cache_dir("./storage"))
    >>> index = VectorStoreIndex.from_documents(docs, transformations=[SentenceSplitter(),
    ...                                          KVFusePrecompute(engine)], embed_model=embed_model)
    >>> index.as_query_engine(llm=FusionLLM(engine, max_tokens=256)).query("Who ...?")   # fused
    >>> qe = FusionQueryEngine(index.as_retriever(similarity_top_k=3), engine=engine, max_tokens=48)
    >>> response = qe.query("Who ...?"); response.metadata["kvfuse"]["cache_hits"]

Importing this package is cheap; LlamaIndex is imported when one of the names is first used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

__all__ = ["FusionLLM", "FusionQueryEngine", "FusionSynthesizer", "KVFusePrecompute", "kvfuse_cache_dir",
           "messages_to_chat", "nodes_to_documents"]

_WHERE = {
    "FusionLLM": ".llm",
    "nodes_to_documents": ".llm",
    "messages_to_chat": ".llm",
    "FusionSynthesizer": ".synthesizer",
    "FusionQueryEngine": ".query_engine",
    "KVFusePrecompute": ".ingestion",
    "kvfuse_cache_dir": ".ingestion",
}

if TYPE_CHECKING:
    from .ingestion import KVFusePrecompute, kvfuse_cache_dir
    from .llm import FusionLLM, messages_to_chat, nodes_to_documents
    from .query_engine import FusionQueryEngine
    from .synthesizer import FusionSynthesizer


__getattr__, __dir__ = lazy_exports(
    __name__, globals(), _WHERE, ("llama_index",),
    "kvfuse's LlamaIndex adapters need llama-index-core: pip install 'kvfuse[llama-index]'")
