"""LangChain adapters for kvfuse (needs the `langchain` extra: `pip install kvfuse[langchain]`).

- `ChatKVFuse`: a chat model (real multi-turn through the chat template). Documents the engine knows are found by
  content inside the messages, so the textbook `{"context": retriever | format_docs, ...} | prompt | ChatKVFuse`
  chain fuses; retrieved documents can also go in `documents=` (per call or `.bind(documents=...)`).
- `KVFusePrecompute`: a document transformer that precomputes (or registers) documents at ingestion.
- `FusionRunnable`: an LCEL Runnable from `{"question", "documents"}` (or a question, with `retriever=`) to
  `{"answer", "question", "documents", "kvfuse"}`.

Example:
    >>> chain = {"question": RunnablePassthrough(), "documents": retriever} | FusionRunnable(engine)
    >>> out = chain.invoke("Who ...?"); out["answer"], out["kvfuse"]["cache_hits"]

Importing this package is cheap; LangChain is imported when one of the names is first used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

__all__ = ["ChatKVFuse", "FusionRunnable", "KVFusePrecompute", "lc_documents_to_documents"]

_WHERE = {"ChatKVFuse": ".chat_models", "lc_documents_to_documents": ".chat_models", "FusionRunnable": ".runnable",
          "KVFusePrecompute": ".precompute"}

if TYPE_CHECKING:
    from .chat_models import ChatKVFuse, lc_documents_to_documents
    from .precompute import KVFusePrecompute
    from .runnable import FusionRunnable


__getattr__, __dir__ = lazy_exports(
    __name__, globals(), _WHERE, ("langchain_core", "pydantic"),
    "kvfuse's LangChain adapters need langchain-core: pip install 'kvfuse[langchain]'")
