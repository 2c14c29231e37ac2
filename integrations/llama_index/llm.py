"""`FusionLLM`: a LlamaIndex LLM backed by a kvfuse `FusionEngine`.

Chat messages go to `FusionEngine.chat` as they are (system / user / assistant turns through the model's chat
template); `complete(prompt)` is one user turn. Documents the engine knows (precomputed by `KVFusePrecompute`,
registered, or used before) are found by content inside those texts and served from their caches, so the stock
LlamaIndex paths fuse with no special class: `index.as_query_engine(llm=FusionLLM(...))`, `Settings.llm =
FusionLLM(...)`, `index.as_chat_engine(chat_mode="context", llm=...)`. Retrieved documents can also travel in the
`documents=` keyword.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

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
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore
from pydantic import AliasChoices, TypeAdapter, ValidationError

from kvfuse.engine.fusion import DEFAULT_STRATEGY
from kvfuse.engine.types import Document, GenerationResult, as_documents

from .._bridge import SIFT_METADATA_KEY, decode_index, adeltas, arun, content_id, result_stats

__all__ = ["FusionLLM", "nodes_to_documents", "messages_to_chat", "UNFUSED_WARNING_CHARS"]

logger = logging.getLogger("kvfuse")

#: A prompt of at least this many characters that fused no document (and had no `documents=`) gets the one-time
#: "not fused" warning.
UNFUSED_WARNING_CHARS = 1000
_warned: set[str] = set()  # one-time warnings already given (tests may clear it)

#: Per-call generation keywords (besides `documents`); `max_new_tokens` is accepted as another name of `max_tokens`.
CALL_OPTIONS = ("strategy", "recompute_ratio", "max_tokens", "temperature", "top_p", "seed", "stop", "guard_margin",
                "guard_tokens", "guard_at")
_ALIASES = {"max_new_tokens": "max_tokens"}
_ROLES = {MessageRole.SYSTEM: "system", MessageRole.DEVELOPER: "system", MessageRole.USER: "user",
          MessageRole.ASSISTANT: "assistant", MessageRole.CHATBOT: "assistant", MessageRole.MODEL: "assistant"}
_MEDIA_BLOCKS = {"ImageBlock", "AudioBlock", "VideoBlock", "DocumentBlock"}


def _node_document(node: BaseNode, metadata_mode: MetadataMode) -> Document | None:
    """The engine document of one node: its body as the text (the cache key), the metadata header as the title."""
    body = node.get_content(metadata_mode=MetadataMode.NONE).strip()
    if not body:
        return None
    node_id = node.node_id or content_id(body)
    index = decode_index((node.metadata or {}).get(SIFT_METADATA_KEY))  # a sift index carried with the node
    view = node.get_content(metadata_mode=metadata_mode).strip()
    if view == body:
        return Document(node_id, body, sift_index=index)
    if view.endswith(body):  # LlamaIndex's "{metadata_str}\n\n{content}": title + "\n" + body == the LLM's view
        head = view[:-len(body)]
        return Document(node_id, body, head[:-1] if head.endswith("\n") else head, sift_index=index)
    return Document(node_id, view, sift_index=index)  # a custom text_template: the whole view is the document


def nodes_to_documents(nodes: Sequence[Any], metadata_mode: MetadataMode = MetadataMode.LLM) -> list[Document]:
    """Turns nodes into engine documents: `Document(node.node_id, body, title=metadata header)`.

    The body (`node.get_content(metadata_mode=MetadataMode.NONE)`, stripped) is the document's text and its
    cache key: it is the text LlamaIndex's prompt templates contain, so once precomputed or registered it is found
    inside any stuffed prompt, and the same passage hits the same cache from every entry point. The metadata
    header of the `metadata_mode` view (LLM by default, as the synthesizers show it) becomes the title, computed
    in front of the body (never cached), so `title + "\\n" + body` is exactly what a stock synthesizer shows the
    LLM. (A node whose custom `text_template` does not end with the body keeps its whole view as the text.)

    Node ids are only handles: the engine finds caches by content, so the fresh ids of a re-ingestion still hit.
    Nodes with an empty body are left out. Anything else accepted by `as_documents` (pairs, mappings,
    Documents) passes through.

    Args:
        nodes: `NodeWithScore`, `BaseNode`, `(id, text)` pairs, mappings or `Document`s.
        metadata_mode: which metadata the title shows (LLM by default, as the synthesizers do).

    Raises:
        ValueError: on an item of an unknown type.
    """
    out: list[Any] = []
    for item in nodes:
        node = item.node if isinstance(item, NodeWithScore) else item
        if isinstance(node, BaseNode):
            doc = _node_document(node, metadata_mode)
            if doc is not None:
                out.append(doc)
        else:
            out.append(item)
    return as_documents(out)


def _text(message: ChatMessage) -> str:
    media = sorted({type(b).__name__ for b in message.blocks} & _MEDIA_BLOCKS)
    if media:
        raise ValueError(f"FusionLLM takes text only; a {message.role.value} message has {', '.join(media)}")
    return message.content or ""


def messages_to_chat(messages: Sequence[ChatMessage], system_prompt: str | None = None) -> list[dict[str, str]]:
    """LlamaIndex messages as the engine's chat turns: `[{"role": "system" | "user" | "assistant", "content"}]`.

    System and developer messages are system turns, user messages user turns, assistant (chatbot, model)
    messages assistant turns. The leading system messages are merged into one system turn (chat templates
    expect at most one, first), with `system_prompt` in front unless one of them already is it (LlamaIndex's
    `predict` has added it). Tool and function messages are refused (FusionLLM has no tool calling), as are
    image/audio/video/document blocks.
    """
    turns: list[dict[str, str]] = []
    for m in messages:
        role = _ROLES.get(m.role)
        if role is None:
            raise ValueError(f"FusionLLM has no tool calling: it can't take a {m.role.value!r} message")
        turns.append({"role": role, "content": _text(m)})
    lead = 0
    while lead < len(turns) and turns[lead]["role"] == "system":
        lead += 1
    system = [t["content"] for t in turns[:lead]]
    if system_prompt and system_prompt not in system:
        system.insert(0, system_prompt)
    system = [s for s in system if s.strip()]
    head = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return head + turns[lead:]


def _unpicklable(self: Any) -> Any:
    raise TypeError(
        f"{type(self).__name__} holds a FusionEngine (a loaded model, its caches and locks), which can't be sent to "
        "another process. IngestionPipeline(num_workers > 1) pickles its transformations into worker processes: "
        "run the pipeline with num_workers=None (the engine computes one request at a time anyway), or run "
        "KVFusePrecompute in a second, single-process pipeline over the nodes the parallel one returns.")


@dataclass
class _Request:
    """One engine call: `question` (engine.generate's RAG prompt) or `messages` (engine.chat)."""

    messages: list[dict[str, str]] | None
    question: str | None
    docs: list[Document]
    opts: dict[str, Any]

    @property
    def chars(self) -> int:
        if self.question is not None:
            return len(self.question)
        return sum(len(m["content"]) for m in self.messages or [])


class FusionLLM(CustomLLM):
    """A LlamaIndex LLM that answers through kvfuse's cache fusion.

    Messages go through the model's chat template as real turns (`chat`), a completion prompt is one user turn
    (`complete`). Documents the engine knows are found inside them by content and fused from their caches: precompute
    the corpus with `KVFusePrecompute` at ingestion and the stock `index.as_query_engine(llm=...)`,
    `Settings.llm = ...` and `index.as_chat_engine(chat_mode="context", llm=...)` all fuse the retrieved nodes.

    `documents=` (on `complete`/`chat`, their stream and async variants) passes retrieved documents explicitly:
    `NodeWithScore`, nodes, `(id, text)` pairs or `Document`s. Those not written in the prompt already are laid
    out the engine's way: a lone prompt goes to `FusionEngine.generate` (cached instruction prefix, document
    reordering for the strategies that do it); with a system prompt or earlier turns they are written into the last
    user turn. Per-call keywords `strategy`, `recompute_ratio`, `max_tokens` (or `max_new_tokens`), `temperature`,
    `top_p`, `seed`, `stop`, `guard_margin`, `guard_tokens` override the settings; any other keyword raises
    `TypeError`.

    Each `CompletionResponse`/`ChatResponse` has `raw = {"model", "finish_reason", "usage"}`, `usage` as
    OpenAI names it (`prompt_tokens`, `completion_tokens`, `total_tokens`, `cached_tokens`, and
    `prompt_tokens_details.cached_tokens`: document tokens served from cache), which LlamaIndex's
    `TokenCountingHandler` reads; `additional_kwargs` holds the engine's costs (timings, recomputed tokens,
    cache hits and misses: see `result_stats`) and the `GenerationResult` itself under `"generation_result"`.
    Streams end with one extra item whose `delta` is `""` and which carries all of that.

    Async methods await the engine's asyncio fronts (no thread per request): concurrent calls are decoded
    together in the engine's batch, and a cancelled task (or a stream closed early) cancels its engine request.
    A FusionLLM can't be pickled (it holds the engine).

    Over HTTP: `FusionLLM(base_url="http://host:8000/v1", api_key=..., model=...)` talks to a running
    `kvfuse serve` instead of an engine in this process (see `kvfuse.integrations.remote`): the same calls,
    documents, options, streaming and usage; `generation_result` is then a `RemoteResult` (no token ids).

    Args:
        engine: a `kvfuse.engine.api.FusionEngine` (or a `kvfuse.integrations.remote.RemoteEngine`).
        base_url, api_key, model: instead of `engine`, a running `kvfuse serve` (its URL, key, served model).
        model_name: reported in `metadata` (default: the engine's model name).
        context_window: reported in `metadata` (LlamaIndex packs prompts to it); default and maximum: the
            engine's context window.
        max_tokens: tokens to generate at most (`max_new_tokens` is accepted as another name).
        temperature, top_p, seed: sampling (temperature 0 is greedy; `seed=None` draws a fresh seed every call).
        stop: strings that end the answer.
        strategy, recompute_ratio: the fusion strategy and the fraction of document tokens it recomputes.
        guard_margin: nats; a near-tie on the fused path hands the answer to full prefill from that token on
            (`GenerationOptions.guard_margin`; None: the engine's default); guard_tokens: how many of the answer's
            first tokens it checks (None: all).
        system_prompt: sent as the system turn of every call (through the chat template).
        generate_kwargs: more generation options for every call: any of the settings above not set explicitly
            (`temperature`, `top_p`, `seed`, `stop`, `max_tokens`, `recompute_ratio`, `strategy`) and the
            fusion strategy's own options; checked when the FusionLLM is built.
        Unknown settings raise `TypeError`.
    """

    model_config = ConfigDict(extra="forbid")

    model_name: str = Field(default="", description="Model name reported in metadata (default: the engine's).")
    context_window: int | None = Field(default=None, gt=0,
                                       description="Context window reported in metadata (default: the engine's).")
    strategy: str = Field(default=DEFAULT_STRATEGY, description="Fusion strategy name (see kvfuse.engine.fusion).")
    recompute_ratio: float = Field(default=0.15, ge=0.0, le=1.0,
                                   description="Fraction of document tokens to recompute.")
    max_tokens: int = Field(default=64, gt=0, validation_alias=AliasChoices("max_tokens", "max_new_tokens"),
                            description="Tokens to generate at most.")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int | None = Field(default=None, description="Sampling seed (None: a fresh random seed every call).")
    stop: list[str] | None = Field(default=None, description="Strings that end the answer.")
    guard_margin: float | None = Field(default=None, ge=0, allow_inf_nan=False, description=(
        "Nats: a near-tie on the fused path hands the answer to full prefill (GenerationOptions.guard_margin; "
        "0: none, None: the engine's default)."))
    guard_tokens: int | None = Field(default=None, ge=1, description=(
        "How many of the answer's first tokens the guard checks (None: every token)."))
    guard_at: Literal["answer", "probe"] | None = Field(default=None, description=(
        "Where the guard reads its gap: the fused answer's tokens (answer) or, before the fused prefill, the "
        "question probe of a query-aware strategy (probe; GenerationOptions.guard_at; None: the engine's default)."))
    generate_kwargs: dict[str, Any] = Field(default_factory=dict,
                                            description="More generation options (validated at construction).")

    _engine: Any = PrivateAttr()
    _strategy_options: dict[str, Any] = PrivateAttr(default_factory=dict)
    _generation: dict[str, Any] = PrivateAttr(default_factory=dict)

    def __init__(self, engine: Any = None, *, base_url: str | None = None, api_key: str | None = None,
                 model: str | None = None, **kwargs: Any) -> None:
        if base_url is not None:
            if engine is not None:
                raise ValueError("FusionLLM takes engine= or base_url= (a running `kvfuse serve`), not both")
            from ..remote import RemoteEngine

            engine = RemoteEngine(base_url, api_key=api_key, model=model)
        elif api_key is not None or model is not None:
            raise ValueError("FusionLLM: api_key= and model= name a server's key and model: give base_url= too")
        if engine is None:
            raise ValueError("FusionLLM needs an engine: FusionLLM(engine=FusionEngine.from_pretrained(...)), or "
                             "base_url= of a running `kvfuse serve`")
        known = set(type(self).model_fields) | set(_ALIASES)
        unknown = sorted(k for k in kwargs if k not in known)
        if unknown:
            own = [k for k in type(self).model_fields if k not in CustomLLM.model_fields]
            raise TypeError(f"FusionLLM got unknown settings {unknown}; it takes {own}, max_new_tokens (= max_tokens) "
                            "and the LlamaIndex LLM ones (system_prompt, callback_manager, messages_to_prompt, "
                            "completion_to_prompt, output_parser, pydantic_program_mode, query_wrapper_prompt)")
        if "max_tokens" in kwargs and "max_new_tokens" in kwargs:
            raise TypeError("FusionLLM got both max_tokens and max_new_tokens: give one")
        super().__init__(**kwargs)
        self._engine = engine
        if not self.model_name:
            self.model_name = str(getattr(engine, "model_name", "") or "")
        window = int(engine.context_window)
        if self.context_window is None:
            self.context_window = window
        elif self.context_window > window:
            raise ValueError(f"FusionLLM context_window={self.context_window} is over the engine's context window "
                             f"of {window} tokens ({self.model_name}); give at most {window}, or leave it unset")
        self._check_generate_kwargs()

    def _check_generate_kwargs(self) -> None:
        """Splits `generate_kwargs` into generation settings and strategy options, checking both."""
        from kvfuse.engine.options import GenerationOptions
        from kvfuse.engine.validate import check_strategy

        generation, options = {}, {}
        for key, value in self.generate_kwargs.items():
            name = _ALIASES.get(key, key)
            if name in CALL_OPTIONS:
                if name in self.model_fields_set or name in generation:
                    raise ValueError(f"FusionLLM: {key!r} is set twice (as a setting and in generate_kwargs, or "
                                     "under both its names); set it once")
                info = type(self).model_fields[name]
                kind = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
                try:
                    generation[name] = TypeAdapter(kind).validate_python(value)
                except ValidationError as e:
                    msg = e.errors()[0]["msg"]
                    raise ValueError(f"FusionLLM generate_kwargs[{key!r}] = {value!r}: {msg}") from None
            else:
                options[key] = value
        strategy = generation.get("strategy", self.strategy)
        try:
            if strategy == "auto":  # its targets (target_fidelity, ttft_budget_s) are generation options
                GenerationOptions.from_kwargs(strategy=strategy, **options)
            else:
                check_strategy(strategy, options)
        except ValueError as e:
            raise ValueError(f"FusionLLM generate_kwargs {sorted(options)}: not generation options "
                             f"({', '.join(CALL_OPTIONS)}) nor valid options of the strategy: {e}") from None
        self._generation, self._strategy_options = generation, options

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, engine_options: dict[str, Any] | None = None,
                        **kwargs: Any) -> FusionLLM:
        """Loads a `FusionEngine` and wraps it.

        Args:
            name_or_path: registry name, GGUF path or Hugging Face folder.
            engine_options: keywords of `FusionEngine.from_pretrained` (device, dtype, cache_dir, disk_cache_dir...).
            **kwargs: the FusionLLM settings (max_tokens, temperature, strategy, system_prompt, ...).
        """
        from kvfuse.engine.api import FusionEngine

        return cls(engine=FusionEngine.from_pretrained(name_or_path, **(engine_options or {})), **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "kvfuse_fusion_llm"

    __getstate__ = _unpicklable

    @property
    def engine(self) -> Any:
        """The wrapped `FusionEngine`."""
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=int(self.context_window or self._engine.context_window),
            num_output=int(self._generation.get("max_tokens", self.max_tokens)),
            is_chat_model=True,
            is_function_calling_model=False,
            model_name=self.model_name,
            system_role=MessageRole.SYSTEM,
        )

    # --- requests -----------------------------------------------------------------------------------------

    def _options(self, kwargs: dict[str, Any]) -> tuple[list[Document], dict[str, Any]]:
        """(documents, engine keywords) of one call: settings < generate_kwargs < per-call keywords."""
        kwargs = dict(kwargs)
        docs = nodes_to_documents(kwargs.pop("documents", None) or [])
        if "max_tokens" in kwargs and "max_new_tokens" in kwargs:
            raise TypeError("FusionLLM got both max_tokens and max_new_tokens: give one")
        kwargs = {_ALIASES.get(k, k): v for k, v in kwargs.items()}
        unknown = sorted(k for k in kwargs if k not in CALL_OPTIONS)
        if unknown:
            raise TypeError(f"FusionLLM got unexpected keyword arguments {unknown}; per call it takes documents, "
                            f"{', '.join(CALL_OPTIONS)} (max_new_tokens = max_tokens)")
        opts = {k: getattr(self, k) for k in CALL_OPTIONS}
        opts.update(self._generation)
        opts.update(kwargs)
        if opts["strategy"] == self._generation.get("strategy", self.strategy):
            opts.update(self._strategy_options)
        opts["max_new_tokens"] = opts.pop("max_tokens")
        return docs, opts

    def _resolve(self, chat: list[dict[str, str]], docs: list[Document], opts: dict[str, Any]) -> _Request:
        """Where the documents go: found in the messages as they are; else a lone user prompt is the question of
        the engine's own RAG layout, and otherwise the missing documents are written into the last user turn."""
        missing = [d for d in docs if not any(d.text in m["content"] for m in chat)]
        if not missing:
            return _Request(chat, None, docs, opts)
        if len(chat) == 1 and chat[0]["role"] == "user":
            return _Request(None, chat[0]["content"], docs, opts)
        last = max((i for i, m in enumerate(chat) if m["role"] == "user"), default=None)
        if last is None:
            raise ValueError("FusionLLM: documents= needs a user message to answer")
        fmt = self._engine.prompts.fmt
        block = "".join((f"{d.title}\n" if d.title else "") + d.text + fmt.doc_suffix for d in missing)
        question = fmt.question_template.format(question=chat[last]["content"])
        chat = list(chat)
        chat[last] = {"role": "user", "content": fmt.instruction + block + question}
        return _Request(chat, None, docs, opts)

    def _system(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def _completion_request(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> _Request:
        docs, opts = self._options(kwargs)
        text = prompt if formatted else self.completion_to_prompt(prompt)
        return self._resolve(self._system() + [{"role": "user", "content": text}], docs, opts)

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> _Request:
        docs, opts = self._options(kwargs)
        if self.messages_to_prompt is not generic_messages_to_prompt:  # the user's own formatter: one user turn
            chat = self._system() + [{"role": "user", "content": self.messages_to_prompt(messages)}]
        else:
            chat = messages_to_chat(messages, self.system_prompt)
        return self._resolve(chat, docs, opts)

    # --- the one place that talks to the engine -------------------------------------------------------------

    def _run(self, request: _Request) -> CompletionResponse:
        if request.question is not None:
            result = self._engine.generate(request.question, request.docs, **request.opts)
        else:
            result = self._engine.chat(request.messages, request.docs, **request.opts)
        return self._final(CompletionResponse(text=result.text), result, request)

    def _open(self, request: _Request) -> Any:
        """The engine's stream (arguments are checked now; it computes on the first next())."""
        if request.question is not None:
            return self._engine.stream(request.question, request.docs, **request.opts)
        return self._engine.stream_chat(request.messages, request.docs, **request.opts)

    async def _arun(self, request: _Request) -> CompletionResponse:
        """`_run` on the event loop: the engine's async front, decoded in the same batch as other requests; a
        cancelled task cancels the engine request."""
        result = await arun(self._aopen(request))
        return self._final(CompletionResponse(text=result.text), result, request)

    def _aopen(self, request: _Request) -> Any:
        """The engine's async stream (arguments checked now; submitted on the first anext)."""
        if request.question is not None:
            return self._engine.astream(request.question, request.docs, **request.opts)
        return self._engine.astream_chat(request.messages, request.docs, **request.opts)

    async def _adrain(self, stream: Any, request: _Request) -> AsyncIterator[CompletionResponse]:
        text = ""
        async with contextlib.aclosing(adeltas(stream)) as deltas:  # closes the engine stream however this ends
            async for delta in deltas:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
        yield self._final(CompletionResponse(text=text, delta=""), stream.result, request)

    def _drain(self, stream: Any, request: _Request) -> Iterator[CompletionResponse]:
        text = ""
        try:
            for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
        finally:
            stream.close()
        yield self._final(CompletionResponse(text=text, delta=""), stream.result, request)

    def _final(self, response: CompletionResponse, result: GenerationResult | None,
               request: _Request) -> CompletionResponse:
        """Puts the usage (raw), the costs and the result (additional_kwargs) on the last response of a call."""
        if result is None:  # a stream cancelled before it computed anything
            usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cached_tokens": 0}
        else:
            usage = {k: int(v) for k, v in result.usage().items()}
            self._warn_if_unfused(request, result)
        response.raw = {"model": self.model_name, "finish_reason": getattr(result, "finish_reason", None),
                        "usage": {**usage, "prompt_tokens_details": {"cached_tokens": usage["cached_tokens"]}}}
        response.additional_kwargs = {**result_stats(result), "generation_result": result}
        return response

    def _warn_if_unfused(self, request: _Request, result: GenerationResult) -> None:
        if request.docs or result.doc_tokens or request.chars < UNFUSED_WARNING_CHARS or "unfused" in _warned:
            return
        _warned.add("unfused")
        logger.warning(
            "FusionLLM: a %d-character prompt fused no document: none of its text is a document the engine knows "
            "and no documents= were given, so all of it was computed. Precompute the corpus at ingestion "
            "(KVFusePrecompute) so retrieved node text is found inside the prompt, pass documents=, or use "
            "FusionQueryEngine, which fuses the retrieved nodes itself. (Logged once.)", request.chars)

    # --- completion -------------------------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._run(self._completion_request(prompt, formatted, kwargs))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        request = self._completion_request(prompt, formatted, kwargs)
        return self._drain(self._open(request), request)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await self._arun(self._completion_request(prompt, formatted, kwargs))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        request = self._completion_request(prompt, formatted, kwargs)
        return self._adrain(self._aopen(request), request)  # bad arguments raise here, before the first item

    # --- chat -------------------------------------------------------------------------------------------

    @staticmethod
    def _to_chat(response: CompletionResponse) -> ChatResponse:
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=response.text),
                            delta=response.delta, raw=response.raw,
                            additional_kwargs=response.additional_kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._to_chat(self._run(self._chat_request(messages, kwargs)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        request = self._chat_request(messages, kwargs)
        responses = self._drain(self._open(request), request)
        return (self._to_chat(r) for r in responses)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._to_chat(await self._arun(self._chat_request(messages, kwargs)))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        request = self._chat_request(messages, kwargs)
        responses = self._adrain(self._aopen(request), request)

        async def gen() -> ChatResponseAsyncGen:
            async with contextlib.aclosing(responses):
                async for response in responses:
                    yield self._to_chat(response)

        return gen()
