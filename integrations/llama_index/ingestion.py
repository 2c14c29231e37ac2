"""`KVFusePrecompute`: an ingestion transform that computes each node's KV cache while it is indexed.

Place it after the node parser (node text is final there) in an `IngestionPipeline` or in
`VectorStoreIndex.from_documents(..., transformations=[...])`. Nodes pass through unchanged (no metadata is
added: that would change what the LLM sees, hence the cache key).

Persisting caches with an index: point the engine's disk tier (the `disk_cache_dir` engine option) into the
index's persist folder, so the index and its caches travel together:

    engine = FusionEngine.from_pretrained(name, disk_cache_dir=kvfuse_cache_dir(persist_dir))
    index = VectorStoreIndex.from_documents(docs, transformations=[splitter, KVFusePrecompute(engine)], ...)
    index.storage_context.persist(persist_dir)
    # later, in another process
    engine = FusionEngine.from_pretrained(name, disk_cache_dir=kvfuse_cache_dir(persist_dir))
    index = load_index_from_storage(StorageContext.from_defaults(persist_dir=persist_dir), embed_model=...)
    FusionQueryEngine.from_index(index, engine=engine).query(...)   # caches hit from disk

(The engine's `cache_dir` option is different: it also holds converted model weights, shared by all indexes.)
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent

from kvfuse.engine.types import PrecomputeReport

from .llm import nodes_to_documents

__all__ = ["KVFusePrecompute", "kvfuse_cache_dir"]


def kvfuse_cache_dir(persist_dir: str | os.PathLike[str]) -> str:
    """Where kvfuse's disk cache lives next to a persisted LlamaIndex index: `<persist_dir>/kvfuse_cache`."""
    return os.path.join(os.fspath(persist_dir), "kvfuse_cache")


class KVFusePrecompute(TransformComponent):
    """Precomputes the KV cache of every node, keyed by the text the LLM will see.

    The text is `node.get_content(metadata_mode)` (LLM mode by default), exactly what `FusionQueryEngine`
    and `FusionSynthesizer` pass at query time, so the caches hit at query time even when a later
    ingestion gives the nodes new ids.

    `IngestionPipeline` caches transform outputs and skips this transform on a repeated run of the same
    nodes; caches missing at query time are computed then, so that only costs time. To force the work, run
    the pipeline with `disable_cache=True`.

    Args:
        engine: the `FusionEngine` whose store receives the caches.
        metadata_mode: must match the synthesizer's (default LLM).
        batch_size: nodes per `engine.precompute` call.
        model_name: recorded in the pipeline's cache key (defaults to the engine's model name).
    """

    model_name: str = Field(default="", description="Model the caches belong to (part of the pipeline cache key).")
    metadata_mode: MetadataMode = Field(default=MetadataMode.LLM, description="Node text the caches are built on.")
    batch_size: int = Field(default=16, gt=0, description="Nodes per engine.precompute call.")

    _engine: Any = PrivateAttr()
    _report: PrecomputeReport | None = PrivateAttr(default=None)

    def __init__(self, engine: Any, **kwargs: Any) -> None:
        if engine is None:
            raise ValueError("KVFusePrecompute needs an engine")
        kwargs.setdefault("model_name", str(getattr(engine, "model_name", "")))
        super().__init__(**kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "KVFusePrecompute"

    @property
    def engine(self) -> Any:
        return self._engine

    @property
    def last_report(self) -> PrecomputeReport | None:
        """Totals of the last call (hits, misses, tokens, seconds), or None before the first call."""
        return self._report

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        start = time.perf_counter()
        with_text = [n for n in nodes if n.get_content(metadata_mode=self.metadata_mode).strip()]
        hits = misses = tokens = 0
        for i in range(0, len(with_text), self.batch_size):
            report = self._engine.precompute(nodes_to_documents(with_text[i:i + self.batch_size],
                                                                self.metadata_mode))
            hits, misses, tokens = hits + report.hits, misses + report.misses, tokens + report.tokens
        self._report = PrecomputeReport(hits=hits, misses=misses, tokens=tokens,
                                        seconds=time.perf_counter() - start)
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        return await asyncio.to_thread(self.__call__, nodes, **kwargs)
