"""`FusionQueryEngine`: retrieve with any LlamaIndex retriever, answer with kvfuse cache fusion."""
from __future__ import annotations

from typing import Any

from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import MetadataMode

from .llm import FusionLLM
from .synthesizer import FusionSynthesizer

__all__ = ["FusionQueryEngine"]


class FusionQueryEngine(RetrieverQueryEngine):
    """A `RetrieverQueryEngine` whose synthesizer is a `FusionSynthesizer`.

    `query()` / `aquery()` return a `Response` (or `StreamingResponse` / `AsyncStreamingResponse` with
    `streaming=True`) whose `source_nodes` are the retrieved nodes and whose `metadata["kvfuse"]` holds the
    timings, recomputed tokens and cache hits/misses of the answer (see `FusionSynthesizer`).

    Args:
        retriever: any LlamaIndex retriever (`index.as_retriever(similarity_top_k=...)`, BM25, fusion ...).
        llm: a `FusionLLM`; or give `engine=` and generation defaults instead.
        engine: a `FusionEngine` (used when `llm` is None).
        node_postprocessors: applied after retrieval, as in `RetrieverQueryEngine`.
        streaming: stream the answer.
        callback_manager: LlamaIndex callback manager.
        metadata_mode: the metadata shown as each node's title (the body is the cached part).
        **generation_kwargs: FusionLLM settings (strategy, recompute_ratio, max_tokens, temperature, ...).
    """

    def __init__(
        self,
        retriever: BaseRetriever,
        llm: FusionLLM | None = None,
        *,
        engine: Any = None,
        node_postprocessors: list[BaseNodePostprocessor] | None = None,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
        metadata_mode: MetadataMode = MetadataMode.LLM,
        **generation_kwargs: Any,
    ) -> None:
        synthesizer = FusionSynthesizer(llm, engine=engine, streaming=streaming, callback_manager=callback_manager,
                                        metadata_mode=metadata_mode, **generation_kwargs)
        super().__init__(retriever=retriever, response_synthesizer=synthesizer,
                         node_postprocessors=node_postprocessors, callback_manager=callback_manager)

    @classmethod
    def from_index(cls, index: Any, llm: FusionLLM | None = None, *, similarity_top_k: int = 3,
                   **kwargs: Any) -> FusionQueryEngine:
        """Builds the engine over `index.as_retriever(similarity_top_k=...)`; `kwargs` go to `__init__`."""
        return cls(index.as_retriever(similarity_top_k=similarity_top_k), llm, **kwargs)

    @property
    def synthesizer(self) -> FusionSynthesizer:
        return self._response_synthesizer  # type: ignore[return-value]

    @property
    def llm(self) -> FusionLLM:
        return self.synthesizer.llm
