"""`KVFusePrecompute`: an ingestion transform that computes each node's KV cache while it is indexed.

Place it after the node parser (node text is final there) in an `IngestionPipeline` or in
`VectorStoreIndex.from_documents(..., transformations=[...])`. Nodes pass through unchanged, except with
`strategy="sift"`: then no K/V cache is computed, and each node gets its selective index (a few KB, base64) in
`node.metadata["kvfuse_sift_index"]`, a key excluded from the embedded text and from the LLM's view. The index is
stored with the node in the docstore and vector store, and `FusionQueryEngine` reads it from the retrieved nodes,
so that tier needs no cache server at all:

    index = VectorStoreIndex.from_documents(docs, transformations=[splitter, KVFusePrecompute(engine,
                                                                                              strategy="sift")])
    FusionQueryEngine.from_index(index, engine=engine, strategy="sift").query(...)

Each node's body (`node.get_content(metadata_mode=MetadataMode.NONE)`) is computed and registered with the
engine, so the stock paths fuse it: LlamaIndex's prompt templates contain that text, and the engine finds it
inside any prompt (`index.as_query_engine(llm=FusionLLM(...))`, `as_chat_engine(chat_mode="context")`), as
`FusionQueryEngine` does with the retrieved nodes.

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
from collections.abc import Iterable, Sequence
from typing import Any

from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent

from kvfuse.engine.types import PrecomputeReport

from .._bridge import SIFT_METADATA_KEY, encode_index, is_index_strategy
from .llm import _unpicklable, nodes_to_documents

__all__ = ["KVFusePrecompute", "kvfuse_cache_dir"]


def kvfuse_cache_dir(persist_dir: str | os.PathLike[str]) -> str:
    """Where kvfuse's disk cache lives next to a persisted LlamaIndex index: `<persist_dir>/kvfuse_cache`."""
    return os.path.join(os.fspath(persist_dir), "kvfuse_cache")


class KVFusePrecompute(TransformComponent):
    """Precomputes (and registers with the engine) the KV cache of every node's body.

    The cached text is the node's body, the text LlamaIndex's prompt templates contain (see `nodes_to_documents`),
    so the caches hit at query time from `FusionQueryEngine`, from `FusionLLM` on the stock query and chat
    engines, and even when a later ingestion gives the nodes new ids.

    `IngestionPipeline` caches transform outputs and skips this transform on a repeated run of the same
    nodes; caches missing at query time are computed then, so that only costs time. To force the work, run
    the pipeline with `disable_cache=True`.

    Parallel ingestion: the transform holds the engine, which can't be pickled into worker processes, so
    `IngestionPipeline.run(num_workers=2)` fails at once with a `TypeError` saying so. Run the parallel pipeline
    without it and this transform in a single-process pipeline (or call it) on the nodes it returns.

    Deleting: `delete_ref_doc(index, ref_doc_id)` deletes a source document from the index and evicts its nodes'
    caches; `forget(ref_doc_ids, index=...)` evicts only (call it before `index.delete_ref_doc`, which drops the
    node ids it needs, unless the nodes were ingested through this transform in this process).

    Args:
        engine: the `FusionEngine` whose store receives the caches.
        metadata_mode: the metadata view the node titles come from (only for `nodes_to_documents`; titles are
            not cached, so it does not change what is computed).
        batch_size: nodes per `engine.precompute` call (the engine is free for queries between two calls).
        show_progress: a tqdm bar over the nodes (`IngestionPipeline.run(show_progress=...)` does not reach
            transforms, so set it here).
        strategy: also compute this strategy's offline data (`FusionEngine.precompute`); an index strategy
            (`"sift"`, or a sift spec string) computes each node's selective index instead of its cache and writes
            it into the node's metadata (see the module docstring).
        model_name: recorded in the pipeline's cache key (defaults to the engine's model name).
        Unknown settings raise `TypeError`.
    """

    model_config = ConfigDict(extra="forbid")

    model_name: str = Field(default="", description="Model the caches belong to (part of the pipeline cache key).")
    metadata_mode: MetadataMode = Field(default=MetadataMode.LLM, description="Metadata view of the node titles.")
    batch_size: int = Field(default=16, gt=0, description="Nodes per engine.precompute call.")
    show_progress: bool = Field(default=False, description="Show a progress bar over the nodes.")
    strategy: str | None = Field(default=None, description="Strategy whose offline data is computed too ('sift': "
                                                           "indexes into node metadata instead of caches).")

    _engine: Any = PrivateAttr()
    _report: PrecomputeReport | None = PrivateAttr(default=None)
    _ref_docs: dict[str, set[str]] = PrivateAttr(default_factory=dict)  # source document id -> node ids

    def __init__(self, engine: Any = None, **kwargs: Any) -> None:
        if engine is None:
            raise ValueError("KVFusePrecompute needs an engine")
        unknown = sorted(k for k in kwargs if k not in type(self).model_fields)
        if unknown:
            raise TypeError(f"KVFusePrecompute got unknown settings {unknown}; it takes model_name, metadata_mode, "
                            "batch_size, show_progress, strategy")
        kwargs.setdefault("model_name", str(getattr(engine, "model_name", "")))
        super().__init__(**kwargs)
        self._engine = engine
        is_index_strategy(self.strategy)  # a bad strategy fails here, before any node is seen

    @classmethod
    def class_name(cls) -> str:
        return "KVFusePrecompute"

    __getstate__ = _unpicklable

    @property
    def engine(self) -> Any:
        return self._engine

    @property
    def last_report(self) -> PrecomputeReport | None:
        """Totals of the last call (hits, misses, tokens, seconds), or None before the first call."""
        return self._report

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        start = time.perf_counter()
        show = bool(kwargs.get("show_progress", self.show_progress))
        pairs = [(n, d) for n in nodes for d in nodes_to_documents([n], self.metadata_mode)]
        indexes = is_index_strategy(self.strategy)
        hits = misses = tokens = 0
        bar = _bar(len(pairs), show)
        try:
            for i in range(0, len(pairs), self.batch_size):
                batch = pairs[i:i + self.batch_size]
                batch_docs = [d for _, d in batch]
                if indexes:  # one pass: computed where missing, serialised into the nodes' metadata
                    report, blobs = self._engine.precompute_indexes(batch_docs, self.strategy)
                    for (node, _), blob in zip(batch, blobs):
                        _attach_index(node, blob)
                else:
                    report = self._engine.precompute(batch_docs, strategy=self.strategy)
                hits, misses, tokens = hits + report.hits, misses + report.misses, tokens + report.tokens
                for node, doc in batch:
                    self._ref_docs.setdefault(node.ref_doc_id or node.node_id, set()).add(doc.id)
                if bar is not None:
                    bar.update(len(batch))
        finally:
            if bar is not None:
                bar.close()
        self._report = PrecomputeReport(hits=hits, misses=misses, tokens=tokens,
                                        seconds=time.perf_counter() - start)
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        return await asyncio.to_thread(self.__call__, nodes, **kwargs)

    # --- deleting -------------------------------------------------------------------------------------------

    def node_ids(self, ref_doc_ids: str | Iterable[str], index: Any = None) -> list[str]:
        """The node ids of these source documents: those ingested through this transform, and those the index's
        docstore lists (`index.docstore.get_ref_doc_info`, while the document is still in the index)."""
        refs = [ref_doc_ids] if isinstance(ref_doc_ids, str) else list(ref_doc_ids)
        docstore = getattr(index, "docstore", index)
        ids: set[str] = set()
        for ref in refs:
            ids |= self._ref_docs.get(ref, set())
            info = docstore.get_ref_doc_info(ref) if docstore is not None else None
            if info is not None:
                ids |= set(info.node_ids)
        return sorted(ids)

    def forget(self, ref_doc_ids: str | Iterable[str], index: Any = None) -> int:
        """Evicts the caches (memory, disk, registration) of the nodes of these source documents; returns how many
        the engine knew. `index` (or its docstore) finds nodes not ingested through this transform: pass it
        before `index.delete_ref_doc`, or use `delete_ref_doc`, which does both in order."""
        refs = [ref_doc_ids] if isinstance(ref_doc_ids, str) else list(ref_doc_ids)
        ids = self.node_ids(refs, index)
        for ref in refs:
            self._ref_docs.pop(ref, None)
        return int(self._engine.forget(ids)) if ids else 0

    def delete_ref_doc(self, index: Any, ref_doc_id: str, **delete_kwargs: Any) -> int:
        """`index.delete_ref_doc(ref_doc_id, **delete_kwargs)`, then evicts the caches of the deleted nodes;
        returns how many the engine knew."""
        ids = self.node_ids(ref_doc_id, index)
        index.delete_ref_doc(ref_doc_id, **delete_kwargs)
        self._ref_docs.pop(ref_doc_id, None)
        return int(self._engine.forget(ids)) if ids else 0


def _attach_index(node: BaseNode, blob: bytes) -> None:
    """Writes a sift index into the node's metadata, out of the embedded text and of the LLM's view."""
    node.metadata[SIFT_METADATA_KEY] = encode_index(blob)
    for keys in (node.excluded_embed_metadata_keys, node.excluded_llm_metadata_keys):
        if SIFT_METADATA_KEY not in keys:
            keys.append(SIFT_METADATA_KEY)


def _bar(total: int, show: bool) -> Any:
    if not show or not total:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="kvfuse precompute", unit="node")
