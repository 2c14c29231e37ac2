"""`ChatKVFuse`: a LangChain chat model backed by a kvfuse `FusionEngine`.

Retrieved documents travel in the `documents=` keyword (per call, or bound with `.bind(documents=...)`) and
are fused from their precomputed KV caches; the messages become the engine's question.
"""
from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document as LCDocument
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from kvfuse.engine.fusion import DEFAULT_STRATEGY
from kvfuse.engine.types import Document, GenerationResult, as_documents
from .._bridge import content_id, iterate_in_thread, result_stats

__all__ = ["ChatKVFuse", "lc_documents_to_documents", "messages_to_question"]

_ROLE = {"human": "User", "ai": "Assistant", "tool": "Tool", "function": "Tool"}


def lc_documents_to_documents(docs: Sequence[Any] | None) -> list[Document]:
    """Turns LangChain `Document`s (and anything `as_documents` takes) into engine documents.

    A LangChain document's id is `doc.id`, else `doc.metadata["id"]`, else a hash of its text; its text is
    `page_content` exactly. Ids are only handles: the engine finds caches by content.
    """
    out: list[Any] = []
    for d in docs or []:
        if isinstance(d, LCDocument):
            doc_id = d.id or d.metadata.get("id") or content_id(d.page_content)
            out.append(Document(str(doc_id), d.page_content))
        else:
            out.append(d)
    return as_documents(out)


def _text(message: BaseMessage) -> str:
    if isinstance(message.content, list):
        kinds = {b.get("type") for b in message.content if isinstance(b, dict)} - {"text", None}
        if kinds:
            raise ValueError(f"ChatKVFuse takes text only; got content blocks of type {sorted(kinds)}")
    return message.text


def messages_to_question(messages: Sequence[BaseMessage]) -> str:
    """Renders messages as one question for the engine's single user turn.

    A lone human message is used as it is. System messages come first, then earlier turns as a transcript
    (`User: ...` / `Assistant: ...`), then the last message.
    """
    system = [_text(m) for m in messages if m.type in ("system", "developer")]
    turns = [m for m in messages if m.type not in ("system", "developer")]
    if len(turns) == 1 and turns[0].type == "human" and not system:
        return _text(turns[0])
    parts = [s for s in system if s.strip()]
    if turns:
        *history, last = turns
        if history:
            parts.append("\n".join(f"{_ROLE.get(m.type, 'User')}: {_text(m)}" for m in history))
        parts.append(_text(last) if last.type == "human" else f"{_ROLE.get(last.type, 'User')}: {_text(last)}")
    question = "\n\n".join(parts)
    if not question.strip():
        raise ValueError("the messages hold no text to answer")
    return question


class ChatKVFuse(BaseChatModel):
    """LangChain chat model over kvfuse cache fusion.

    Give it an engine (`ChatKVFuse(engine=FusionEngine.from_pretrained(...))`) or a model name / path
    (`ChatKVFuse(model="qwen2.5-coder-0.5b")`, loaded on first use with `device`, `dtype`, `cache_dir` and
    `engine_options`).

    Documents: `chat.invoke(question, documents=docs)` or `chat.bind(documents=docs)`; LangChain `Document`s
    (id = `doc.id`, else `metadata["id"]`, else a content hash), `(id, text)` pairs, mappings or kvfuse
    `Document`s. Per-call keywords `strategy`, `recompute_ratio`, `max_tokens`, `temperature`, `top_p`,
    `seed` override the defaults; `stop` is the standard LangChain argument.

    The returned `AIMessage` has `usage_metadata` (input = prompt tokens, output = generated tokens) and
    `response_metadata` with `model_name`, `finish_reason` and `kvfuse` (timings, recomputed tokens, cache
    hits/misses: see `result_stats`). Streams put all of that on the last chunk.

    Text only: no tool calling, structured output or image/audio input.
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model_name: str = Field(default="", alias="model", description="Model name or path (engine's if empty).")
    engine: Any = Field(default=None, exclude=True, description="A kvfuse FusionEngine (loaded lazily if None).")
    device: str | None = Field(default=None, description="Device for a lazily loaded engine.")
    dtype: Any = Field(default=None, description="dtype for a lazily loaded engine (torch.bfloat16 or its name).")
    cache_dir: str | None = Field(default=None, description="Cache folder for a lazily loaded engine.")
    engine_options: dict[str, Any] = Field(default_factory=dict,
                                           description="More FusionEngine.from_pretrained keywords (lazy load).")
    strategy: str = Field(default=DEFAULT_STRATEGY, description="Fusion strategy name.")
    recompute_ratio: float = Field(default=0.15, ge=0.0, le=1.0, description="Fraction of doc tokens recomputed.")
    max_tokens: int = Field(default=64, gt=0, alias="max_new_tokens", description="Tokens to generate at most.")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int | None = Field(default=None, description="Sampling seed.")
    stop: list[str] | None = Field(default=None, alias="stop_sequences", description="Default stop strings.")
    streaming: bool = Field(default=False, description="Stream internally on invoke() (token callbacks).")

    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @model_validator(mode="after")
    def _need_model(self) -> ChatKVFuse:
        if self.engine is None and not self.model_name:
            raise ValueError("ChatKVFuse needs engine= or model=")
        if not self.model_name:
            self.model_name = str(self.engine.model_name)
        return self

    @property
    def _llm_type(self) -> str:
        return "kvfuse"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "strategy": self.strategy, "recompute_ratio": self.recompute_ratio,
                "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "kvfuse"
        params["ls_model_name"] = str(kwargs.get("model") or self.model_name)
        params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        params["ls_max_tokens"] = kwargs.get("max_tokens", self.max_tokens)
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # --- engine -----------------------------------------------------------------------------------------

    def get_engine(self) -> Any:
        """The engine, loading it on first use when only `model` was given."""
        if self.engine is None:
            with self._lock:
                if self.engine is None:
                    from kvfuse.engine.api import FusionEngine

                    self.engine = FusionEngine.from_pretrained(self.model_name, device=self.device,
                                                               dtype=self.dtype, cache_dir=self.cache_dir,
                                                               **self.engine_options)
        return self.engine

    def _request(self, messages: list[BaseMessage], stop: list[str] | None,
                 kwargs: dict[str, Any]) -> tuple[str, list[Document], dict[str, Any]]:
        kwargs = dict(kwargs)
        model = kwargs.pop("model", None)
        if model and model != self.model_name:
            raise ValueError(f"ChatKVFuse serves {self.model_name!r}; a per-call model ({model!r}) is not "
                             "supported: build another ChatKVFuse")
        docs = lc_documents_to_documents(kwargs.pop("documents", None))
        opts = {"strategy": kwargs.pop("strategy", self.strategy),
                "recompute_ratio": kwargs.pop("recompute_ratio", self.recompute_ratio),
                "max_new_tokens": kwargs.pop("max_tokens", kwargs.pop("max_new_tokens", self.max_tokens)),
                "temperature": kwargs.pop("temperature", self.temperature),
                "top_p": kwargs.pop("top_p", self.top_p),
                "seed": kwargs.pop("seed", self.seed),
                "stop": list(stop) if stop else (list(self.stop) if self.stop else None)}
        if kwargs:
            raise TypeError(f"ChatKVFuse got unexpected keyword arguments {sorted(kwargs)}")
        return messages_to_question(messages), docs, opts

    def _metadata(self, result: GenerationResult | None) -> tuple[UsageMetadata, dict[str, Any]]:
        stats = result_stats(result)
        n_in, n_out = int(stats.get("prompt_tokens", 0)), int(stats.get("output_tokens", 0))
        usage = UsageMetadata(input_tokens=n_in, output_tokens=n_out, total_tokens=n_in + n_out)
        meta = {"model_name": self.model_name, "finish_reason": stats.get("finish_reason"), "kvfuse": stats}
        return usage, meta

    # --- LangChain hooks --------------------------------------------------------------------------------

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        question, docs, opts = self._request(messages, stop, kwargs)
        result = self.get_engine().generate(question, docs, **opts)
        usage, meta = self._metadata(result)
        message = AIMessage(content=result.text, usage_metadata=usage, response_metadata=meta)
        return ChatResult(generations=[ChatGeneration(message=message, generation_info={"kvfuse": meta["kvfuse"]})])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        question, docs, opts = self._request(messages, stop, kwargs)
        stream = self.get_engine().stream(question, docs, **opts)
        try:
            for delta in stream:
                if not delta:
                    continue
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
                if run_manager:
                    run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        finally:
            stream.close()
        usage, meta = self._metadata(stream.result)
        yield ChatGenerationChunk(message=AIMessageChunk(content="", usage_metadata=usage, response_metadata=meta,
                                                         chunk_position="last"))

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        self._request(messages, stop, kwargs)  # raise bad arguments here, not on the worker thread
        chunks = iterate_in_thread(lambda: self._stream(messages, stop=stop, **kwargs))
        async for chunk in chunks:
            if run_manager and chunk.message.content:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
