"""LangChain adapters for kvfuse (needs the `langchain` extra: `pip install kvfuse[langchain]`).

- `ChatKVFuse`: a chat model; retrieved documents go in `documents=` (per call or `.bind(documents=...)`).
- `FusionRunnable`: an LCEL Runnable from `{"question", "documents"}` (or a question, with `retriever=`) to
  `{"answer", "question", "documents", "kvfuse"}`.

Example:
    >>> chain = {"question": RunnablePassthrough(), "documents": retriever} | FusionRunnable(engine)
    >>> out = chain.invoke("Who ...?"); out["answer"], out["kvfuse"]["cache_hits"]

Importing this package is cheap; LangChain is imported when one of the names is first used.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["ChatKVFuse", "FusionRunnable", "lc_documents_to_documents"]

_WHERE = {"ChatKVFuse": ".chat_models", "lc_documents_to_documents": ".chat_models", "FusionRunnable": ".runnable"}

if TYPE_CHECKING:
    from .chat_models import ChatKVFuse, lc_documents_to_documents
    from .runnable import FusionRunnable


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(_WHERE[name], __name__)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("langchain_core", "pydantic"):
            raise ImportError("kvfuse's LangChain adapters need langchain-core: "
                              "pip install 'kvfuse[langchain]'") from exc
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
