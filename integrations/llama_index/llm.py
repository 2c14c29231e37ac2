"""`FusionLLM`: a LlamaIndex LLM backed by a kvfuse `FusionEngine`.

The prompt (or the chat transcript) becomes the engine's *question*; retrieved documents travel separately in
a `documents=` keyword so the engine can reuse their caches. The engine applies the model's chat template
itself, so no LlamaIndex prompt formatting is layered on top.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore

from kvfuse.engine.fusion import DEFAULT_STRATEGY
from kvfuse.engine.types import Document, as_documents

from .._bridge import GENERATION_OPTIONS, content_id, iterate_in_thread, result_stats

__all__ = ["FusionLLM", "nodes_to_documents", "messages_to_question"]


def nodes_to_documents(nodes: Sequence[Any], metadata_mode: MetadataMode = MetadataMode.LLM) -> list[Document]:
    """Turns retrieved nodes into engine documents: `(node.node_id, node.get_content(metadata_mode))`.

    The text is exactly what a stock LlamaIndex synthesizer would show the LLM (metadata lines included), so a
    cache precomputed at ingestion by `KVFusePrecompute` with the same `metadata_mode` matches it token for
    token. Node ids are only handles: the engine finds caches by content, so the fresh ids of a re-ingestion
    still hit. Anything else accepted by `as_documents` (pairs, mappings, Documents) passes through.

    Args:
        nodes: `NodeWithScore`, `BaseNode`, `(id, text)` pairs, mappings or `Document`s.
        metadata_mode: which metadata the text includes (LLM by default, as the synthesizers do).

    Raises:
        ValueError: on an item of an unknown type.
    """
    out: list[Any] = []
    for item in nodes:
        node = item.node if isinstance(item, NodeWithScore) else item
        if isinstance(node, BaseNode):
            text = node.get_content(metadata_mode=metadata_mode)
            out.append(Document(node.node_id or content_id(text), text))
        else:
            out.append(item)
    return as_documents(out)


def messages_to_question(messages: Sequence[ChatMessage]) -> str:
    """Renders chat messages as one question for the engine's single user turn.

    A lone user message is used as it is. System messages come first, then earlier turns as a transcript
    (`User: ...` / `Assistant: ...`), then the last user message.
    """
    system = [m.content or "" for m in messages if m.role in (MessageRole.SYSTEM, MessageRole.DEVELOPER)]
    turns = [m for m in messages if m.role not in (MessageRole.SYSTEM, MessageRole.DEVELOPER)]
    if len(turns) == 1 and turns[0].role == MessageRole.USER and not system:
        return turns[0].content or ""
    lines = [s for s in system if s.strip()]
    if turns:
        *history, last = turns
        transcript = [f"{'Assistant' if m.role == MessageRole.ASSISTANT else 'User'}: {m.content or ''}"
                      for m in history]
        if transcript:
            lines.append("\n".join(transcript))
        lines.append(last.content or "" if last.role == MessageRole.USER
                     else f"{'Assistant' if last.role == MessageRole.ASSISTANT else 'User'}: {last.content or ''}")
    return "\n\n".join(lines)


class FusionLLM(CustomLLM):
    """A LlamaIndex LLM that answers through kvfuse's cache fusion.

    Pass retrieved documents with the `documents=` keyword of `complete`/`chat` (and their stream and async
    variants): `NodeWithScore`, nodes, `(id, text)` pairs or `Document`s. Without documents it answers the
    prompt alone. Per-call keywords `strategy`, `recompute_ratio`, `max_new_tokens`, `temperature`, `top_p`,
    `seed`, `stop` override the defaults; any other keyword raises `TypeError`.

    Each `CompletionResponse`/`ChatResponse` carries the engine's costs (timings, recomputed tokens, cache
    hits and misses) in `additional_kwargs`, and the `GenerationResult` itself in `raw`. Streams end with one
    extra item whose `delta` is `""` and whose `additional_kwargs` hold those costs.

    Async methods run the engine on a worker thread, so they never block the event loop.

    Args:
        engine: a `kvfuse.engine.api.FusionEngine` (anything with its `generate`/`stream` API).
        strategy, recompute_ratio, max_new_tokens, temperature, top_p, seed, stop: generation defaults.
    """

    strategy: str = Field(default=DEFAULT_STRATEGY, description="Fusion strategy name (see kvfuse.engine.fusion).")
    recompute_ratio: float = Field(default=0.15, ge=0.0, le=1.0,
                                   description="Fraction of document tokens to recompute.")
    max_new_tokens: int = Field(default=64, gt=0, description="Tokens to generate at most.")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int | None = Field(default=None, description="Sampling seed (None: not seeded).")
    stop: list[str] | None = Field(default=None, description="Strings that end the answer.")

    _engine: Any = PrivateAttr()

    def __init__(self, engine: Any, **kwargs: Any) -> None:
        if engine is None:
            raise ValueError("FusionLLM needs an engine: FusionLLM(engine=FusionEngine.from_pretrained(...))")
        super().__init__(**kwargs)
        self._engine = engine

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, engine_options: dict[str, Any] | None = None,
                        **kwargs: Any) -> FusionLLM:
        """Loads a `FusionEngine` and wraps it.

        Args:
            name_or_path: registry name, GGUF path or Hugging Face folder.
            engine_options: keywords of `FusionEngine.from_pretrained` (device, dtype, cache_dir, disk_cache_dir...).
            **kwargs: the generation defaults (strategy, recompute_ratio, max_new_tokens, ...).
        """
        from kvfuse.engine.api import FusionEngine

        return cls(engine=FusionEngine.from_pretrained(name_or_path, **(engine_options or {})), **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "kvfuse_fusion_llm"

    @property
    def engine(self) -> Any:
        """The wrapped `FusionEngine`."""
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=int(self._engine.context_window),
            num_output=self.max_new_tokens,
            is_chat_model=True,
            is_function_calling_model=False,
            model_name=str(self._engine.model_name),
        )

    # --- the one place that talks to the engine ---------------------------------------------------------

    def _options(self, kwargs: dict[str, Any]) -> tuple[list[Document], dict[str, Any]]:
        kwargs = dict(kwargs)
        docs = nodes_to_documents(kwargs.pop("documents", None) or [])
        unknown = sorted(k for k in kwargs if k not in GENERATION_OPTIONS)
        if unknown:
            raise TypeError(f"FusionLLM got unexpected keyword arguments {unknown}; "
                            f"accepted: documents, {', '.join(GENERATION_OPTIONS)}")
        opts = {k: getattr(self, k) for k in GENERATION_OPTIONS}
        opts.update(kwargs)
        return docs, opts

    def _question(self, prompt: str, formatted: bool) -> str:
        return prompt if formatted else self.completion_to_prompt(prompt)

    def _chat_question(self, messages: Sequence[ChatMessage]) -> str:
        if self.messages_to_prompt is not generic_messages_to_prompt:  # the user supplied a formatter
            return self.messages_to_prompt(messages)
        return messages_to_question(messages)

    def _run(self, question: str, kwargs: dict[str, Any]) -> CompletionResponse:
        docs, opts = self._options(kwargs)
        result = self._engine.generate(question, docs, **opts)
        return CompletionResponse(text=result.text, additional_kwargs=result_stats(result), raw=result)

    def _run_stream(self, question: str, kwargs: dict[str, Any]) -> Iterator[CompletionResponse]:
        docs, opts = self._options(kwargs)
        stream = self._engine.stream(question, docs, **opts)  # validates now; computes on the first next()
        return self._drain(stream)

    @staticmethod
    def _drain(stream: Any) -> Iterator[CompletionResponse]:
        text = ""
        try:
            for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
        finally:
            stream.close()
        yield CompletionResponse(text=text, delta="", additional_kwargs=result_stats(stream.result),
                                 raw=stream.result)

    # --- completion -------------------------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._run(self._question(prompt, formatted), kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._run_stream(self._question(prompt, formatted), kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self._run, self._question(prompt, formatted), kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        question = self._question(prompt, formatted)
        self._options(kwargs)  # fail here, not inside the worker thread
        return iterate_in_thread(lambda: self._run_stream(question, kwargs))

    # --- chat -------------------------------------------------------------------------------------------

    @staticmethod
    def _to_chat(response: CompletionResponse) -> ChatResponse:
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=response.text),
                            delta=response.delta, raw=response.raw,
                            additional_kwargs=response.additional_kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._to_chat(self._run(self._chat_question(messages), kwargs))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        responses = self._run_stream(self._chat_question(messages), kwargs)
        return (self._to_chat(r) for r in responses)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        response = await asyncio.to_thread(self._run, self._chat_question(messages), kwargs)
        return self._to_chat(response)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        question = self._chat_question(messages)
        self._options(kwargs)

        async def gen() -> ChatResponseAsyncGen:
            async for response in iterate_in_thread(lambda: self._run_stream(question, kwargs)):
                yield self._to_chat(response)

        return gen()
