"""`KVFusePrecompute`: a LangChain document transformer that precomputes (or registers) documents at ingestion.

Put it where documents enter the vector store; the documents pass through unchanged:

    >>> store.add_documents(KVFusePrecompute(engine).transform_documents(docs))

Afterwards any prompt that contains one of these documents' `page_content` (the textbook LCEL chain's
`{context}`, a hand-written f-string, a multi-turn chat) is fused from the caches by `ChatKVFuse`.

With `strategy="sift"` no cache is computed: each document comes back as a copy carrying its selective index
(a few KB, base64) in `metadata["kvfuse_sift_index"]`, stored with it by the vector store; documents passed to
`ChatKVFuse` / the Runnable (`documents=`) bring their index along, so that tier needs no cache server.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from langchain_core.documents import BaseDocumentTransformer
from langchain_core.documents import Document as LCDocument

from kvfuse.engine.types import PrecomputeReport

from .._bridge import SIFT_METADATA_KEY, encode_index, is_index_strategy
from .chat_models import lc_documents_to_documents

__all__ = ["KVFusePrecompute"]


class KVFusePrecompute(BaseDocumentTransformer):
    """Precomputes the KV caches of documents passing through (`FusionEngine.precompute`), or only registers
    them (`compute=False`: `FusionEngine.register`, no computation now; each is computed on first use).

    Args:
        engine: a `FusionEngine`.
        compute: compute the caches now (default) or only register the documents.
        strategy: also compute this strategy's offline data (see `FusionEngine.precompute`); an index strategy
            (`"sift"`) returns copies of the documents carrying their selective index in their metadata.
        show_progress: a progress bar while computing.

    `last_report` holds the `PrecomputeReport` of the last call (None after registering only); `registered` the
    number of documents the last registration made searchable.
    """

    def __init__(self, engine: Any, *, compute: bool = True, strategy: str | None = None,
                 show_progress: bool = False) -> None:
        if engine is None:
            raise ValueError("KVFusePrecompute needs an engine")
        self.engine = engine
        self.compute = bool(compute)
        self.strategy = strategy
        self._indexes = is_index_strategy(strategy)  # a bad strategy fails here, before any document is seen
        if self._indexes and not self.compute:
            raise ValueError("KVFusePrecompute: an index strategy computes its indexes (compute=False registers "
                             "caches only)")
        self.show_progress = bool(show_progress)
        self.last_report: PrecomputeReport | None = None
        self.registered: int | None = None

    def transform_documents(self, documents: Sequence[LCDocument], **kwargs: Any) -> Sequence[LCDocument]:
        if kwargs:
            raise TypeError(f"KVFusePrecompute.transform_documents got unexpected keyword arguments {sorted(kwargs)}")
        docs = lc_documents_to_documents(list(documents))
        if self._indexes:
            self.last_report, blobs = self.engine.precompute_indexes(docs, self.strategy)
            return [LCDocument(page_content=d.page_content, metadata={**d.metadata, SIFT_METADATA_KEY: encode_index(b)},
                               id=d.id) for d, b in zip(documents, blobs)]
        if self.compute:
            self.last_report = self.engine.precompute(docs, strategy=self.strategy, show_progress=self.show_progress)
        else:
            self.last_report = None
            self.registered = self.engine.register(docs)
        return documents

    async def atransform_documents(self, documents: Sequence[LCDocument], **kwargs: Any) -> Sequence[LCDocument]:
        return await asyncio.to_thread(self.transform_documents, documents, **kwargs)
