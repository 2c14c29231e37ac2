"""`FusionSynthesizer`: a response synthesizer that hands the retrieved nodes to kvfuse as documents.

Stock synthesizers stuff node texts into a prompt template and drop the node ids (with `FusionLLM` and
precomputed nodes that still fuses: the engine finds the node bodies inside the prompt); this one passes every
node as its own document (`nodes_to_documents`: the body, cached, under its metadata header as the LLM sees it)
to the engine's own RAG layout, so each node's KV cache is reused whether or not it was precomputed, and the
strategies that reorder documents can. Use it in a `RetrieverQueryEngine` (postprocessors, streaming and
callbacks keep working), or use `FusionQueryEngine`, which builds exactly that.
"""
from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers.base import BaseSynthesizer, QueryTextType
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle
from llama_index.core.types import RESPONSE_TEXT_TYPE

from kvfuse.engine.types import Document

from .._bridge import content_id
from .llm import FusionLLM, nodes_to_documents

__all__ = ["FusionSynthesizer"]

dispatcher = instrument.get_dispatcher(__name__)

#: Key of the kvfuse record in `Response.metadata` (the other keys are node ids, as LlamaIndex sets them).
METADATA_KEY = "kvfuse"


class FusionSynthesizer(BaseSynthesizer):
    """Answers with kvfuse, one cached document per retrieved node.

    `Response.metadata` keeps LlamaIndex's `{node_id: node.metadata}` entries and adds
    `metadata["kvfuse"]`: the generation's costs (`ttft_s`, `prefill_s`, `decode_s`, `prompt_tokens`,
    `doc_tokens`, `recomputed_tokens`, `cache_hits`, `cache_misses`, `stale`, `strategy`, ...) plus
    `engine_cache`, the engine's `cache_stats()` after the call. For streaming responses the same dict object
    is filled in once the stream has been consumed.

    Args:
        llm: the `FusionLLM` to answer with (its settings apply: strategy, ratio, max_tokens, system_prompt, ...).
        engine: alternatively a `FusionEngine`; a `FusionLLM` is built around it with `generation_kwargs`.
        streaming: return `StreamingResponse` / `AsyncStreamingResponse`.
        callback_manager: LlamaIndex callback manager.
        metadata_mode: the metadata shown as each node's title (LLM by default, as stock synthesizers show it).
        empty_response: the answer when no node was retrieved (the engine is not called).
        **generation_kwargs: FusionLLM defaults, only with `engine=`.
    """

    def __init__(
        self,
        llm: FusionLLM | None = None,
        *,
        engine: Any = None,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
        metadata_mode: MetadataMode = MetadataMode.LLM,
        empty_response: str | None = None,
        **generation_kwargs: Any,
    ) -> None:
        if llm is None:
            llm = FusionLLM(engine=engine, **generation_kwargs)
        elif engine is not None or generation_kwargs:
            raise ValueError("pass either llm= or engine= (with generation defaults), not both")
        if not isinstance(llm, FusionLLM):
            raise TypeError(f"FusionSynthesizer needs a FusionLLM, got {type(llm).__name__}")
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming,
                         empty_response=empty_response)
        self._metadata_mode = metadata_mode

    @property
    def llm(self) -> FusionLLM:
        return self._llm  # type: ignore[return-value]

    def _get_prompts(self) -> PromptDictType:
        return {}  # the engine owns the prompt layout; there is no template to swap

    def _update_prompts(self, prompts: PromptDictType) -> None:
        if prompts:
            raise ValueError("FusionSynthesizer has no prompt templates: the engine lays out the prompt")

    # --- building responses -----------------------------------------------------------------------------

    def _metadata(self, source_nodes: Sequence[NodeWithScore]) -> dict[str, Any]:
        meta: dict[str, Any] = {n.node.node_id: n.node.metadata for n in source_nodes}
        meta[METADATA_KEY] = {}
        return meta

    def _fill(self, meta: dict[str, Any], stats: dict[str, Any]) -> None:
        record = {k: v for k, v in stats.items() if k != "generation_result"}
        cache_stats = getattr(self.llm.engine, "cache_stats", None)
        if callable(cache_stats):
            record["engine_cache"] = cache_stats()
        meta[METADATA_KEY].update(record)

    def _answer(self, query: str, docs: list[Document], source_nodes: list[NodeWithScore],
                kwargs: dict[str, Any]) -> RESPONSE_TYPE:
        meta = self._metadata(source_nodes)
        if not self._streaming:
            out = self.llm.complete(query, formatted=True, documents=docs, **kwargs)
            self._fill(meta, out.additional_kwargs)
            return Response(out.text, source_nodes=source_nodes, metadata=meta)
        responses = self.llm.stream_complete(query, formatted=True, documents=docs, **kwargs)

        def deltas() -> Generator[str, None, None]:
            for r in responses:
                if r.delta:
                    yield r.delta
                if r.additional_kwargs:
                    self._fill(meta, r.additional_kwargs)

        return StreamingResponse(deltas(), source_nodes=source_nodes, metadata=meta)

    async def _aanswer(self, query: str, docs: list[Document], source_nodes: list[NodeWithScore],
                       kwargs: dict[str, Any]) -> RESPONSE_TYPE:
        meta = self._metadata(source_nodes)
        if not self._streaming:
            out = await self.llm.acomplete(query, formatted=True, documents=docs, **kwargs)
            self._fill(meta, out.additional_kwargs)
            return Response(out.text, source_nodes=source_nodes, metadata=meta)
        responses = await self.llm.astream_complete(query, formatted=True, documents=docs, **kwargs)

        async def deltas() -> AsyncGenerator[str, None]:
            async for r in responses:
                if r.delta:
                    yield r.delta
                if r.additional_kwargs:
                    self._fill(meta, r.additional_kwargs)

        return AsyncStreamingResponse(deltas(), source_nodes=source_nodes, metadata=meta)

    def _empty(self, asynchronous: bool) -> RESPONSE_TYPE:
        if not self._streaming:
            return Response(self._empty_response, metadata={METADATA_KEY: {}})
        if asynchronous:
            return AsyncStreamingResponse(self._empty_response_agenerator(), metadata={METADATA_KEY: {}})
        return StreamingResponse(self._empty_response_generator(), metadata={METADATA_KEY: {}})

    # --- BaseSynthesizer API ----------------------------------------------------------------------------

    @dispatcher.span
    def synthesize(self, query: QueryTextType, nodes: list[NodeWithScore],
                   additional_source_nodes: Sequence[NodeWithScore] | None = None,
                   **response_kwargs: Any) -> RESPONSE_TYPE:
        """Answers `query` from `nodes` (each one a cached document); see the class docstring for metadata."""
        dispatcher.event(SynthesizeStartEvent(query=query))
        bundle = QueryBundle(query_str=query) if isinstance(query, str) else query
        with self._callback_manager.event(CBEventType.SYNTHESIZE,
                                          payload={EventPayload.QUERY_STR: bundle.query_str}) as event:
            if not nodes:
                response = self._empty(asynchronous=False)
            else:
                source_nodes = list(nodes) + list(additional_source_nodes or [])
                docs = nodes_to_documents(nodes, self._metadata_mode)
                response = self._answer(bundle.query_str, docs, source_nodes, response_kwargs)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=bundle, response=response))
        return response

    @dispatcher.span
    async def asynthesize(self, query: QueryTextType, nodes: list[NodeWithScore],
                          additional_source_nodes: Sequence[NodeWithScore] | None = None,
                          **response_kwargs: Any) -> RESPONSE_TYPE:
        """Async `synthesize`: awaits the engine's async front (concurrent queries are decoded together)."""
        dispatcher.event(SynthesizeStartEvent(query=query))
        bundle = QueryBundle(query_str=query) if isinstance(query, str) else query
        with self._callback_manager.event(CBEventType.SYNTHESIZE,
                                          payload={EventPayload.QUERY_STR: bundle.query_str}) as event:
            if not nodes:
                response = self._empty(asynchronous=True)
            else:
                source_nodes = list(nodes) + list(additional_source_nodes or [])
                docs = nodes_to_documents(nodes, self._metadata_mode)
                response = await self._aanswer(bundle.query_str, docs, source_nodes, response_kwargs)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=bundle, response=response))
        return response

    def get_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        """Answers from bare text chunks (no node ids: each chunk's handle is a hash of its text)."""
        docs = [Document(content_id(t), t) for t in text_chunks if t.strip()]
        if not self._streaming:
            return self.llm.complete(query_str, formatted=True, documents=docs, **response_kwargs).text
        responses = self.llm.stream_complete(query_str, formatted=True, documents=docs, **response_kwargs)
        return (r.delta for r in responses if r.delta)

    async def aget_response(self, query_str: str, text_chunks: Sequence[str],
                            **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        """Async `get_response`."""
        docs = [Document(content_id(t), t) for t in text_chunks if t.strip()]
        if not self._streaming:
            out = await self.llm.acomplete(query_str, formatted=True, documents=docs, **response_kwargs)
            return out.text
        responses = await self.llm.astream_complete(query_str, formatted=True, documents=docs, **response_kwargs)

        async def deltas() -> AsyncGenerator[str, None]:
            async for r in responses:
                if r.delta:
                    yield r.delta

        return deltas()
