"""`FusionRunnable`: question + retrieved documents in, answer with kvfuse's costs out (an LCEL Runnable).

Input, either
  * `{"question": str, "documents": [Document | (id, text) | ...]}`, e.g. from
    `{"question": RunnablePassthrough(), "documents": retriever} | FusionRunnable(engine)`; or
  * a question string, when the runnable was built with `retriever=` (it retrieves itself; a dict without
    `"documents"` is retrieved for too). Without a retriever a bare string is answered with no documents.

Output, a dict:
  * `"answer"`: the generated text;
  * `"question"`: the question;
  * `"documents"`: the documents used, as given (LangChain `Document`s stay `Document`s);
  * `"kvfuse"`: the costs: `ttft_s`, `prefill_s`, `decode_s`, `prompt_tokens`, `doc_tokens`,
    `recomputed_tokens`, `cache_hits`, `cache_misses`, `stale`, `strategy`, `finish_reason`, ... (see
    `result_stats`).

`stream()` yields addable dict chunks: first `{"question", "documents"}`, then `{"answer": delta}` pieces,
last `{"kvfuse": ...}`; adding them up gives the `invoke()` output.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, Union

from langchain_core.callbacks import AsyncCallbackManagerForChainRun, CallbackManagerForChainRun
from langchain_core.runnables import Runnable, RunnableConfig, RunnableSerializable
from langchain_core.runnables.config import patch_config
from langchain_core.runnables.utils import AddableDict
from pydantic import ConfigDict, Field

from kvfuse.engine.fusion import DEFAULT_STRATEGY

from .._bridge import GENERATION_OPTIONS, iterate_in_thread, result_stats

from .chat_models import lc_documents_to_documents

__all__ = ["FusionRunnable"]

FusionInput = Union[str, Mapping[str, Any]]


class FusionRunnable(RunnableSerializable[FusionInput, dict[str, Any]]):
    """Answers a question over documents with kvfuse cache fusion (see the module docstring for I/O).

    Args:
        engine: a `FusionEngine`.
        retriever: optional; any Runnable from a question string to documents (a LangChain retriever).
        strategy, recompute_ratio, max_new_tokens, temperature, top_p, seed, stop: generation defaults;
            `invoke(..., strategy=...)` etc. override them per call.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: Any = Field(exclude=True, description="A kvfuse FusionEngine.")
    retriever: Runnable | None = Field(default=None, exclude=True, description="Question -> documents.")
    strategy: str = DEFAULT_STRATEGY
    recompute_ratio: float = Field(default=0.15, ge=0.0, le=1.0)
    max_new_tokens: int = Field(default=64, gt=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | None = None

    def __init__(self, engine: Any = None, **kwargs: Any) -> None:
        if engine is None:
            raise ValueError("FusionRunnable needs an engine: FusionRunnable(FusionEngine.from_pretrained(...))")
        super().__init__(engine=engine, **kwargs)

    # --- input handling ---------------------------------------------------------------------------------

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(k for k in kwargs if k not in GENERATION_OPTIONS)
        if unknown:
            raise TypeError(f"FusionRunnable got unexpected keyword arguments {unknown}")
        return {**{k: getattr(self, k) for k in GENERATION_OPTIONS}, **kwargs}

    def _split(self, value: FusionInput) -> tuple[str, Any]:
        """(question, documents or None when they must be retrieved)."""
        if isinstance(value, str):
            return value, None if self.retriever is not None else []
        if isinstance(value, Mapping):
            if "question" not in value:
                raise ValueError(f"FusionRunnable input needs a 'question' key, got keys {sorted(value)}")
            docs = value.get("documents")
            if docs is None and self.retriever is None:
                docs = []
            return str(value["question"]), docs
        raise TypeError(f"FusionRunnable takes a question string or a dict, got {type(value).__name__}")

    def _retrieve(self, question: str, docs: Any, run_manager: CallbackManagerForChainRun,
                  config: RunnableConfig) -> list[Any]:
        if docs is not None:
            return list(docs)
        return list(self.retriever.invoke(question, patch_config(config, callbacks=run_manager.get_child())))

    async def _aretrieve(self, question: str, docs: Any, run_manager: AsyncCallbackManagerForChainRun,
                         config: RunnableConfig) -> list[Any]:
        if docs is not None:
            return list(docs)
        found = await self.retriever.ainvoke(question, patch_config(config, callbacks=run_manager.get_child()))
        return list(found)

    # --- invoke -----------------------------------------------------------------------------------------

    def invoke(self, input: FusionInput, config: RunnableConfig | None = None, **kwargs: Any) -> dict[str, Any]:
        return self._call_with_config(self._invoke, input, config, run_type="chain", opts=self._options(kwargs))

    def _invoke(self, value: FusionInput, run_manager: CallbackManagerForChainRun, config: RunnableConfig,
                opts: dict[str, Any]) -> dict[str, Any]:
        question, docs = self._split(value)
        docs = self._retrieve(question, docs, run_manager, config)
        result = self.engine.generate(question, lc_documents_to_documents(docs), **opts)
        return {"answer": result.text, "question": question, "documents": docs, "kvfuse": result_stats(result)}

    async def ainvoke(self, input: FusionInput, config: RunnableConfig | None = None,
                      **kwargs: Any) -> dict[str, Any]:
        return await self._acall_with_config(self._ainvoke, input, config, run_type="chain",
                                             opts=self._options(kwargs))

    async def _ainvoke(self, value: FusionInput, run_manager: AsyncCallbackManagerForChainRun,
                       config: RunnableConfig, opts: dict[str, Any]) -> dict[str, Any]:
        question, docs = self._split(value)
        docs = await self._aretrieve(question, docs, run_manager, config)
        result = await asyncio.to_thread(self.engine.generate, question, lc_documents_to_documents(docs), **opts)
        return {"answer": result.text, "question": question, "documents": docs, "kvfuse": result_stats(result)}

    # --- stream -----------------------------------------------------------------------------------------

    def _chunks(self, question: str, docs: list[Any], opts: dict[str, Any]) -> Iterator[AddableDict]:
        stream = self.engine.stream(question, lc_documents_to_documents(docs), **opts)
        try:
            for delta in stream:
                if delta:
                    yield AddableDict(answer=delta)
        finally:
            stream.close()
        yield AddableDict(kvfuse=result_stats(stream.result))

    def stream(self, input: FusionInput, config: RunnableConfig | None = None,
               **kwargs: Any) -> Iterator[dict[str, Any]]:
        yield from self._transform_stream_with_config(iter([input]), self._transform, config, run_type="chain",
                                                      opts=self._options(kwargs))

    def _transform(self, values: Iterator[FusionInput], run_manager: CallbackManagerForChainRun,
                   config: RunnableConfig, opts: dict[str, Any]) -> Iterator[AddableDict]:
        for value in values:
            question, docs = self._split(value)
            docs = self._retrieve(question, docs, run_manager, config)
            yield AddableDict(question=question, documents=docs)
            yield from self._chunks(question, docs, opts)

    async def astream(self, input: FusionInput, config: RunnableConfig | None = None,
                      **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        async def one() -> AsyncIterator[FusionInput]:
            yield input

        async for chunk in self._atransform_stream_with_config(one(), self._atransform, config, run_type="chain",
                                                               opts=self._options(kwargs)):
            yield chunk

    async def _atransform(self, values: AsyncIterator[FusionInput], run_manager: AsyncCallbackManagerForChainRun,
                          config: RunnableConfig, opts: dict[str, Any]) -> AsyncIterator[AddableDict]:
        async for value in values:
            question, docs = self._split(value)
            docs = await self._aretrieve(question, docs, run_manager, config)
            yield AddableDict(question=question, documents=docs)
            async for chunk in iterate_in_thread(lambda: self._chunks(question, docs, opts)):
                yield chunk
