"""`ChatKVFuse`: a LangChain chat model backed by a kvfuse `FusionEngine`.

The messages go to `FusionEngine.chat` as they are (system / human / ai turns through the model's chat template).
Documents the engine knows (precomputed with `engine.precompute(lc_documents_to_documents(docs))`, the
`KVFusePrecompute` transformer, or used before) are found by content inside the messages and served from their
caches, so the textbook LCEL chain `{"context": retriever | format_docs, "question": RunnablePassthrough()} |
prompt | ChatKVFuse(...)` fuses with no special step. Retrieved documents can also travel in `documents=` (per
call, or `.bind(documents=...)`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document as LCDocument
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError, model_validator

from kvfuse.engine.fusion import DEFAULT_STRATEGY
from kvfuse.engine.types import Document, GenerationResult, as_documents
from .._bridge import SIFT_METADATA_KEY, adeltas, arun, content_id, decode_index, result_stats

__all__ = ["ChatKVFuse", "lc_documents_to_documents", "messages_to_chat"]

logger = logging.getLogger("kvfuse")

#: A prompt of at least this many tokens that fused no document gets the one-time "not fused" warning.
UNFUSED_WARNING_TOKENS = 256
_warned: set[str] = set()  # one-time warnings already given (tests may clear it)

_ROLES = {"system": "system", "developer": "system", "human": "user", "ai": "assistant"}
_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
               "ai": "assistant"}


def lc_documents_to_documents(docs: Sequence[Any] | None) -> list[Document]:
    """Turns LangChain `Document`s (and anything `as_documents` takes) into engine documents.

    A LangChain document's body is its `page_content`, exactly: that text is what is cached, and what is found
    again inside a stuffed prompt (metadata is not part of it). Its id is `doc.id`, else `doc.metadata["id"]`,
    else a hash of its text; ids are only handles, the engine finds caches by content. A sift index carried in
    `doc.metadata["kvfuse_sift_index"]` (written by `KVFusePrecompute(engine, strategy="sift")`) rides along.
    """
    out: list[Any] = []
    for d in docs or []:
        if isinstance(d, LCDocument):
            doc_id = d.id or d.metadata.get("id") or content_id(d.page_content)
            out.append(Document(str(doc_id), d.page_content,
                                sift_index=decode_index(d.metadata.get(SIFT_METADATA_KEY))))
        else:
            out.append(d)
    return as_documents(out)


def _text(message: BaseMessage) -> str:
    if isinstance(message.content, list):
        kinds = {b.get("type") for b in message.content if isinstance(b, dict)} - {"text", None}
        if kinds:
            raise ValueError(f"ChatKVFuse takes text only; got content blocks of type {sorted(kinds)}")
    return message.text


def messages_to_chat(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as the engine's chat turns: `[{"role": "system" | "user" | "assistant", "content"}]`.

    System (and developer) messages are system turns, human messages user turns, AI messages assistant turns;
    a `ChatMessage` keeps its role when it is one of those. Tool and function messages are refused (ChatKVFuse
    has no tool calling), as are non-text content blocks.
    """
    out = []
    for i, m in enumerate(messages):
        role = _ROLES.get(m.type)
        if m.type == "chat":
            role = _CHAT_ROLES.get(str(getattr(m, "role", "")).lower())
        if role is None:
            raise ValueError(f"messages[{i}]: ChatKVFuse takes system, human and AI messages (no tool calling); "
                             f"got a {type(m).__name__} ({m.type!r})")
        out.append({"role": role, "content": _text(m)})
    if not out:
        raise ValueError("ChatKVFuse got no messages")
    return out


# --- one request ----------------------------------------------------------------------------------------------

@dataclass
class _Call:
    """One request as the engine will get it: `question` (engine.generate's RAG prompt) or `messages` (engine.chat)."""

    messages: list[dict[str, str]] | None
    question: str | None
    docs: list[Document]
    opts: dict[str, Any]
    timeout: float | None
    documents_given: bool
    seeds: list[int | None] = field(default_factory=list)


def _timeout_error(timeout: float, received: int) -> TimeoutError:
    return TimeoutError(
        f"ChatKVFuse: no complete answer within timeout={timeout:g}s ({received} text deltas received); the request "
        "was cancelled. Time spent waiting for the engine (queued behind other requests) counts too: raise "
        "timeout= or lower max_tokens")


def _deltas(stream: Any, timeout: float | None) -> Iterator[str]:
    """The text deltas of an engine `GenerationStream`; always closes it (an early exit cancels the request).

    With `timeout` (seconds, from now) the stream is read on a helper thread and the deadline is exact: past it
    the request is cancelled (the engine stops at its next decode step, or before starting when it was still
    waiting for the engine) and `TimeoutError` is raised.
    """
    if timeout is None:
        try:
            yield from stream
        finally:
            stream.close()
        return
    deadline = time.monotonic() + timeout
    items: queue.SimpleQueue = queue.SimpleQueue()

    def pump() -> None:
        try:
            for delta in stream:
                items.put(("delta", delta))
            items.put(("done", None))
        except BaseException as exc:  # re-raised on the reader
            items.put(("error", exc))
        finally:
            stream.close()

    threading.Thread(target=pump, name="kvfuse-chat-timeout", daemon=True).start()
    received = 0
    try:
        while True:
            remaining = deadline - time.monotonic()
            try:
                kind, value = items.get(timeout=remaining) if remaining > 0 else items.get_nowait()
            except queue.Empty:
                raise _timeout_error(timeout, received) from None
            if kind == "delta":
                received += 1
                yield value
            elif kind == "error":
                raise value
            else:
                return
    finally:
        stream.cancel.set()  # stops the request if it is still running (no effect once it has finished)


# --- structured output ----------------------------------------------------------------------------------------

def _json_schema_of(schema: Any) -> dict[str, Any]:
    """The JSON schema of a pydantic model, a TypedDict, an OpenAI function/tool dict or a JSON schema dict."""
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return schema.model_json_schema()
    if isinstance(schema, Mapping) and "properties" in schema and "parameters" not in schema and "function" not in \
            schema:
        return dict(schema)  # already a JSON schema (with or without a title)
    from langchain_core.utils.function_calling import convert_to_json_schema

    return convert_to_json_schema(schema)


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer(),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _check_json(value: Any, schema: Mapping[str, Any], where: str = "$") -> None:
    """Checks `value` against the common JSON-schema keywords (type, enum, const, properties, required, items,
    anyOf/oneOf, additionalProperties: false); `$ref` and others are not checked. ValueError naming the spot."""
    if not isinstance(schema, Mapping):
        return
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        errors = []
        for option in options:
            try:
                _check_json(value, option, where)
                break
            except ValueError as e:
                errors.append(str(e))
        else:
            raise ValueError(f"{where}: matches none of the allowed forms ({'; '.join(errors)})")
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else list(types)
        if not any(_JSON_TYPES.get(t, lambda v: True)(value) for t in types):
            raise ValueError(f"{where}: expected {' or '.join(types)}, got {type(value).__name__} {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise ValueError(f"{where}: {value!r} is not one of {schema['enum']!r}")
    if "const" in schema and value != schema["const"]:
        raise ValueError(f"{where}: expected {schema['const']!r}, got {value!r}")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        missing = [k for k in schema.get("required", []) if k not in value]
        if missing:
            raise ValueError(f"{where}: missing required key(s) {missing}")
        if schema.get("additionalProperties") is False:
            extra = sorted(set(value) - set(props))
            if extra:
                raise ValueError(f"{where}: unexpected key(s) {extra}")
        for key, sub in props.items():
            if key in value:
                _check_json(value[key], sub, f"{where}.{key}")
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            _check_json(item, schema["items"], f"{where}[{i}]")


_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.S)


def _first_json(text: str) -> Any:
    """The first JSON object (or array) in a model's answer (code fences and prose around it are skipped)."""
    fenced = _FENCE.search(text)
    body = fenced.group(1) if fenced else text
    decoder = json.JSONDecoder()
    starts = [i for i, ch in enumerate(body) if ch in "{["]
    if not starts:
        raise ValueError("the answer holds no JSON object")
    first_error = None
    for i in starts[:50]:
        try:
            return decoder.raw_decode(body[i:])[0]
        except json.JSONDecodeError as e:
            first_error = first_error or e
    raise ValueError(f"the answer is not valid JSON ({first_error})")


class _StructuredParser:
    """Turns the model's AIMessage into the schema's type: a pydantic instance, or a dict (TypedDict / JSON schema)."""

    def __init__(self, schema: Any) -> None:
        self.schema = schema
        self.is_model = isinstance(schema, type) and issubclass(schema, BaseModel)
        self.json_schema = _json_schema_of(schema)
        self.name = self.json_schema.get("title") or getattr(schema, "__name__", None) or "the schema"

    def __call__(self, message: BaseMessage) -> Any:
        text = message.text if isinstance(message, BaseMessage) else str(message)
        finish = message.response_metadata.get("finish_reason") if isinstance(message, BaseMessage) else None
        hint = (" (generation stopped at max_tokens: raise max_tokens)" if finish == "length" else "")
        try:
            value = _first_json(text)
        except ValueError as e:
            raise OutputParserException(
                f"ChatKVFuse structured output: the model did not answer with JSON for {self.name}: {e}{hint}. "
                f"Answer: {text[:300]!r}", llm_output=text) from None
        try:
            if self.is_model:
                return self.schema.model_validate(value)
            _check_json(value, self.json_schema)
            return value
        except (ValidationError, ValueError) as e:
            raise OutputParserException(
                f"ChatKVFuse structured output: the model's JSON does not match {self.name}: {e}{hint}. "
                f"Answer: {text[:300]!r}", llm_output=text) from None


def _instruction(json_schema: dict[str, Any] | None) -> str:
    if json_schema is None:
        return "Reply with one JSON object and nothing else: no prose, no code fences."
    return ("Reply with one JSON object and nothing else (no prose, no code fences). It must match this JSON "
            f"schema:\n{json.dumps(json_schema, ensure_ascii=False)}")


# --- the chat model -------------------------------------------------------------------------------------------

class ChatKVFuse(BaseChatModel):
    """LangChain chat model over kvfuse cache fusion.

    Give it an engine (`ChatKVFuse(engine=FusionEngine.from_pretrained(...))`), a model name / path
    (`ChatKVFuse(model="qwen2.5-coder-0.5b")`, loaded on first use with `device`, `dtype`, `cache_dir` and
    `engine_options`), or a running `kvfuse serve` (`ChatKVFuse(base_url="http://host:8000/v1", api_key=...)`,
    `model=` optionally naming the served model): the same calls, documents, options, streaming and metadata
    over HTTP (see `kvfuse.integrations.remote`).

    Messages are a real chat: system, human and AI turns go through the model's chat template
    (`FusionEngine.chat`). Documents the engine knows (precomputed, registered, or used before) are found by
    content inside them and fused from their caches; a prompt template that stuffs retrieved text
    (`{context}`) therefore fuses as it is. `documents=` (per call or `.bind(documents=...)`) names documents
    explicitly: when their text is not in the messages already they are laid out before the last question the
    way `FusionEngine.generate` does it. LangChain `Document`s (id = `doc.id`, else `metadata["id"]`, else a
    content hash), `(id, text)` pairs, mappings or kvfuse `Document`s.

    Settings (constructor; per call too, except `n` and `model_kwargs`): `strategy`, `recompute_ratio`,
    `max_tokens` (alias `max_new_tokens`), `temperature`, `top_p`, `seed` (None: a fresh random seed per call),
    `stop`, `timeout` (seconds; past it the request is cancelled and `TimeoutError` raised; waiting for the
    engine counts), `n` (generations per prompt, for `generate()`, each message with its own usage, the total in
    `llm_output["token_usage"]`; seeds `seed, seed+1, ...`; `invoke` returns the first and `stream` yields it
    whole: n > 1 does not stream token by token), `model_kwargs` (options of the fusion strategy, e.g.
    `{"max_per_doc": 2}` for epic; checked at construction). `max_retries` is accepted for LangChain's standard parameters and has no effect: a
    local engine has no transient failures to retry. Unknown settings are an error.

    The returned `AIMessage` has `usage_metadata` (input = prompt tokens, output = generated tokens,
    `input_token_details["cache_read"]` = document tokens served from their caches) and `response_metadata`
    with `model_name`, `finish_reason`, `token_usage` (the engine's `usage()`) and `kvfuse` (ttft including the
    time waiting for the engine, `queue_s`, cache hits/misses, recomputed tokens and fraction, ...: see
    `result_stats`). Streams put all of that on the last chunk.

    `with_structured_output(schema)` (pydantic model, TypedDict or JSON schema) asks for JSON matching the
    schema and parses and validates it (`OutputParserException` when the model's answer does not comply).
    Text only: no tool calling, no image/audio input.
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True, extra="forbid")

    model_name: str = Field(default="", alias="model", description="Model name or path (engine's if empty).")
    engine: Any = Field(default=None, exclude=True, description="A kvfuse FusionEngine (loaded lazily if None).")
    base_url: str | None = Field(default=None, description="URL of a running `kvfuse serve` (instead of engine).")
    api_key: SecretStr | None = Field(default=None, exclude=True, description="The server's API key.")
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
    seed: int | None = Field(default=None, description="Sampling seed (None: a fresh random seed per call).")
    stop: list[str] | None = Field(default=None, alias="stop_sequences", description="Default stop strings.")
    streaming: bool = Field(default=False, description="Stream internally on invoke() (token callbacks).")
    n: int = Field(default=1, ge=1, description="Generations per prompt (generate(); n > 1 does not stream).")
    timeout: float | None = Field(default=None, gt=0, description="Seconds per call, waiting included.")
    guard_margin: float | None = Field(default=None, ge=0, allow_inf_nan=False, description=(
        "Nats: a near-tie on the fused path hands the answer to full prefill (GenerationOptions.guard_margin; "
        "0: none, None: the engine's default)."))
    guard_tokens: int | None = Field(default=None, ge=1, description=(
        "How many of the answer's first tokens the guard checks (None: every token)."))
    guard_at: Literal["answer", "probe"] | None = Field(default=None, description=(
        "Where the guard reads its gap: the fused answer's tokens (answer) or, before the fused prefill, the "
        "question probe of a query-aware strategy (probe; GenerationOptions.guard_at; None: the engine's default)."))
    max_retries: int = Field(default=0, ge=0, description="Accepted for compatibility; nothing is retried.")
    model_kwargs: dict[str, Any] = Field(default_factory=dict, description="Fusion strategy options.")

    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @model_validator(mode="before")
    @classmethod
    def _known_settings(cls, values: Any) -> Any:
        if isinstance(values, Mapping):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            unknown = sorted(k for k in values if k not in known)
            if unknown:
                raise ValueError(f"ChatKVFuse got unknown settings {unknown}; it takes "
                                 f"{sorted(k for k in known if k not in BaseChatModel.model_fields)} (and the "
                                 "BaseChatModel ones: callbacks, tags, metadata, ...)")
        return values

    @model_validator(mode="after")
    def _check(self) -> ChatKVFuse:
        if self.base_url is not None:
            if self.engine is not None:
                raise ValueError("ChatKVFuse takes engine= or base_url= (a running `kvfuse serve`), not both")
            from ..remote import RemoteEngine

            key = self.api_key.get_secret_value() if self.api_key is not None else None
            self.engine = RemoteEngine(self.base_url, api_key=key, model=self.model_name or None)
        elif self.api_key is not None:
            raise ValueError("ChatKVFuse: api_key= is a server's key: give base_url= too")
        if self.engine is None and not self.model_name:
            raise ValueError("ChatKVFuse needs engine=, model= or base_url=")
        if not self.model_name:
            self.model_name = str(self.engine.model_name)
        if self.model_kwargs:
            from kvfuse.engine.options import GenerationOptions

            shadowed = sorted(k for k in self.model_kwargs if k in type(self).model_fields or k in (
                "max_new_tokens", "documents", "messages", "return_logprobs", "teacher_ids"))
            if shadowed:
                raise ValueError(f"ChatKVFuse model_kwargs {shadowed}: set these as ChatKVFuse settings or per "
                                 "call, not in model_kwargs (which holds fusion strategy options)")
            GenerationOptions.from_kwargs(strategy=self.strategy, **self.model_kwargs)  # a ValueError naming it
        if self.streaming and self.n > 1:
            raise ValueError("ChatKVFuse: streaming=True needs n=1 (n generations are not streamed)")
        return self

    @property
    def _llm_type(self) -> str:
        return "kvfuse"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "strategy": self.strategy, "recompute_ratio": self.recompute_ratio,
                "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed, "n": self.n, "timeout": self.timeout, "model_kwargs": dict(self.model_kwargs)}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "kvfuse"
        params["ls_model_name"] = str(kwargs.get("model") or self.model_name)
        params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        params["ls_max_tokens"] = kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_tokens))
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def _combine_llm_outputs(self, llm_outputs: list[dict | None]) -> dict:
        total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cached_tokens": 0}
        for out in llm_outputs:
            for k, v in ((out or {}).get("token_usage") or {}).items():
                total[k] = total.get(k, 0) + v
        return {"model_name": self.model_name, "token_usage": total}

    def _should_stream(self, *, async_api: bool, run_manager: Any = None, **kwargs: Any) -> bool:
        if self.n > 1:  # n generations come from generate(), never from a stream
            return False
        return super()._should_stream(async_api=async_api, run_manager=run_manager, **kwargs)

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

    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any],
                 resolve: bool = True) -> _Call:
        """The request of one call; with `resolve=False` only the arguments are checked (the engine is not
        touched, so a lazily loaded one is not loaded on an event loop)."""
        kwargs = dict(kwargs)
        model = kwargs.pop("model", None)
        if model and model != self.model_name:
            raise ValueError(f"ChatKVFuse serves {self.model_name!r}; a per-call model ({model!r}) is not "
                             "supported: build another ChatKVFuse")
        given = kwargs.pop("documents", None)
        docs = lc_documents_to_documents(given)
        response_format = kwargs.pop("response_format", None)
        if "max_tokens" in kwargs and "max_new_tokens" in kwargs:
            raise TypeError("ChatKVFuse got both max_tokens and max_new_tokens: give one")
        strategy = kwargs.pop("strategy", self.strategy)
        opts = {"strategy": strategy,
                "recompute_ratio": kwargs.pop("recompute_ratio", self.recompute_ratio),
                "max_new_tokens": kwargs.pop("max_tokens", kwargs.pop("max_new_tokens", self.max_tokens)),
                "temperature": kwargs.pop("temperature", self.temperature),
                "top_p": kwargs.pop("top_p", self.top_p),
                "guard_margin": kwargs.pop("guard_margin", self.guard_margin),
                "guard_tokens": kwargs.pop("guard_tokens", self.guard_tokens),
                "guard_at": kwargs.pop("guard_at", self.guard_at),
                "stop": list(stop) if stop else (list(self.stop) if self.stop else None)}
        if strategy == self.strategy:
            opts.update(self.model_kwargs)
        seed = kwargs.pop("seed", self.seed)
        timeout = kwargs.pop("timeout", self.timeout)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"timeout must be None or a number of seconds > 0, got {timeout!r}")
        if kwargs:
            raise TypeError(f"ChatKVFuse got unexpected keyword arguments {sorted(kwargs)}; per call it takes "
                            "documents, strategy, recompute_ratio, max_tokens, temperature, top_p, seed, timeout, "
                            "guard_margin, guard_tokens, guard_at, response_format and stop")
        seeds = [seed if seed is None else seed + i for i in range(self.n)]
        chat = messages_to_chat(messages)
        call = _Call(messages=chat, question=None, docs=docs, opts=opts, timeout=timeout,
                     documents_given=bool(docs), seeds=seeds)
        if response_format is not None:
            self._add_format_instruction(chat, response_format)
        if docs and resolve:
            lone = len(chat) == 1 and chat[0]["role"] == "user"
            if lone and response_format is None and not self._docs_in(chat, docs):
                return _Call(None, chat[0]["content"], docs, opts, timeout, True, seeds)  # engine.generate's prompt
            if not self._docs_in(chat, docs):
                self._lay_out_documents(chat, docs)
        return call

    @staticmethod
    def _docs_in(chat: list[dict[str, str]], docs: list[Document]) -> bool:
        """Whether every document's body is already written in the messages (then they are found there)."""
        return all(any(d.text in m["content"] for m in chat) for d in docs)

    def _lay_out_documents(self, chat: list[dict[str, str]], docs: list[Document]) -> None:
        """Writes `docs` into the last user turn as `FusionEngine.generate` lays them out (its PromptFormat's
        instruction, each body + document suffix, the question template), so they are found and fused."""
        last = max((i for i, m in enumerate(chat) if m["role"] == "user"), default=None)
        if last is None:
            raise ValueError("ChatKVFuse: documents= needs a human message to answer")
        fmt = self.get_engine().prompts.fmt
        body = "".join((f"{d.title}\n" if getattr(d, "title", "") else "") + d.text + fmt.doc_suffix for d in docs)
        question = fmt.question_template.format(question=chat[last]["content"])
        chat[last] = {"role": "user", "content": fmt.instruction + body + question}

    @staticmethod
    def _add_format_instruction(chat: list[dict[str, str]], response_format: Any) -> None:
        if not isinstance(response_format, Mapping) or response_format.get("type") not in ("json_object",
                                                                                            "json_schema"):
            raise ValueError("response_format must be {'type': 'json_object'} or {'type': 'json_schema', "
                             f"'schema': {{...}}}}, got {response_format!r}")
        schema = response_format.get("schema") if response_format["type"] == "json_schema" else None
        last = max((i for i, m in enumerate(chat) if m["role"] == "user"), default=None)
        if last is None:
            raise ValueError("ChatKVFuse: structured output needs a human message to answer")
        content = chat[last]["content"]
        chat[last] = {"role": "user", "content": f"{content}\n\n{_instruction(schema)}"}

    def _open(self, call: _Call, seed: int | None) -> Any:
        engine = self.get_engine()
        if call.messages is None:
            return engine.stream(call.question, call.docs, seed=seed, **call.opts)
        return engine.stream_chat(call.messages, call.docs, seed=seed, **call.opts)

    def _run(self, call: _Call, seed: int | None) -> GenerationResult:
        """One generation to its end (inline without a timeout; through a stream with one)."""
        engine = self.get_engine()
        if call.timeout is None:
            if call.messages is None:
                result = engine.generate(call.question, call.docs, seed=seed, **call.opts)
            else:
                result = engine.chat(call.messages, call.docs, seed=seed, **call.opts)
        else:
            stream = self._open(call, seed)
            for _ in _deltas(stream, call.timeout):
                pass
            result = stream.result
        self._warn_if_unfused(call, result)
        return result

    async def _aengine(self) -> Any:
        """`get_engine` from the event loop: a lazily loaded engine is loaded on a worker thread (once)."""
        if self.engine is None:
            await asyncio.to_thread(self.get_engine)
        return self.engine

    def _aopen(self, call: _Call, seed: int | None) -> Any:
        """The engine's async stream (arguments checked now; submitted on the first anext)."""
        if call.messages is None:
            return self.engine.astream(call.question, call.docs, seed=seed, **call.opts)
        return self.engine.astream_chat(call.messages, call.docs, seed=seed, **call.opts)

    def _adeltas(self, call: _Call, seed: int | None) -> tuple[Any, AsyncIterator[str]]:
        """(engine stream, its deltas under the call's timeout); the deltas generator closes the stream."""
        stream = self._aopen(call, seed)
        on_timeout = None if call.timeout is None else lambda n: _timeout_error(call.timeout, n)
        return stream, adeltas(stream, call.timeout, on_timeout)

    async def _arun(self, call: _Call, seed: int | None) -> GenerationResult:
        """`_run` on the event loop (the engine's async front: decoded in the engine's batch with the other
        requests; a cancelled task or the timeout cancels the engine request)."""
        stream = self._aopen(call, seed)
        on_timeout = None if call.timeout is None else lambda n: _timeout_error(call.timeout, n)
        result = await arun(stream, call.timeout, on_timeout)
        self._warn_if_unfused(call, result)
        return result

    def _warn_if_unfused(self, call: _Call, result: GenerationResult | None) -> None:
        if (result is None or call.documents_given or result.doc_tokens
                or result.prompt_tokens < UNFUSED_WARNING_TOKENS or "unfused" in _warned):
            return
        _warned.add("unfused")
        logger.warning(
            "ChatKVFuse: a %d-token prompt fused no document: none of its text is a document the engine knows, and "
            "no documents= were given, so all of it was computed. Precompute the corpus first (KVFusePrecompute, "
            "or engine.precompute(lc_documents_to_documents(docs))) so retrieved text is found inside the prompt, "
            "pass documents=, or use FusionRunnable, which fuses the retrieved documents itself. "
            "(Logged once.)", result.prompt_tokens)

    def _metadata(self, result: GenerationResult | None, seed: int | None) -> tuple[UsageMetadata, dict[str, Any]]:
        stats = result_stats(result)
        if result is None:
            usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cached_tokens": 0}
        else:
            usage = dict(result.usage())
        meta_usage = UsageMetadata(input_tokens=int(usage["prompt_tokens"]),
                                   output_tokens=int(usage["completion_tokens"]),
                                   total_tokens=int(usage["total_tokens"]),
                                   input_token_details={"cache_read": int(usage["cached_tokens"])})
        meta = {"model_name": self.model_name, "finish_reason": stats.get("finish_reason"), "token_usage": usage,
                "kvfuse": stats}
        if seed is not None:
            meta["seed"] = seed
        return meta_usage, meta

    # --- LangChain hooks --------------------------------------------------------------------------------

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self._request(messages, stop, kwargs)
        return self._chat_result([(self._run(call, seed), seed) for seed in call.seeds])

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        self._request(messages, stop, kwargs, resolve=False)  # bad arguments raise before an engine is loaded
        await self._aengine()
        call = self._request(messages, stop, kwargs)
        return self._chat_result([(await self._arun(call, seed), seed) for seed in call.seeds])

    def _chat_result(self, results: list[tuple[GenerationResult, int | None]]) -> ChatResult:
        generations, total = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cached_tokens": 0}
        for result, seed in results:
            usage, meta = self._metadata(result, seed)
            for k in total:
                total[k] += meta["token_usage"][k]
            message = AIMessage(content=result.text, usage_metadata=usage, response_metadata=meta)
            generations.append(ChatGeneration(message=message, generation_info={
                "finish_reason": meta["finish_reason"], "kvfuse": meta["kvfuse"]}))
        return ChatResult(generations=generations, llm_output={"model_name": self.model_name, "token_usage": total})

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        call = self._request(messages, stop, kwargs)
        if len(call.seeds) > 1:
            raise ValueError("ChatKVFuse: n > 1 cannot stream; call generate() (or invoke) instead")
        seed = call.seeds[0]
        stream = self._open(call, seed)
        for delta in _deltas(stream, call.timeout):
            if not delta:
                continue
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(call, stream.result, seed)

    def _last_chunk(self, call, result, seed) -> ChatGenerationChunk:
        """The stream's closing chunk: usage and response metadata of the finished request."""
        self._warn_if_unfused(call, result)
        usage, meta = self._metadata(result, seed)
        return ChatGenerationChunk(message=AIMessageChunk(content="", usage_metadata=usage, response_metadata=meta,
                                                          chunk_position="last"),
                                   generation_info={"finish_reason": meta["finish_reason"]})

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        call = self._request(messages, stop, kwargs, resolve=False)  # bad arguments raise before an engine loads
        if len(call.seeds) > 1:
            raise ValueError("ChatKVFuse: n > 1 cannot stream; call agenerate() (or ainvoke) instead")
        await self._aengine()
        call = self._request(messages, stop, kwargs)
        seed = call.seeds[0]
        stream, deltas = self._adeltas(call, seed)
        async with contextlib.aclosing(deltas):  # closes the engine stream (cancelling it) however this ends
            async for delta in deltas:
                if not delta:
                    continue
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
                if run_manager:
                    await run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        yield self._last_chunk(call, stream.result, seed)

    # --- structured output ------------------------------------------------------------------------------

    def with_structured_output(self, schema: dict[str, Any] | type, *, include_raw: bool = False,
                               method: str = "json_schema", strict: bool | None = None,
                               **kwargs: Any) -> Runnable:
        """A Runnable that answers with an instance of `schema` (pydantic model) or a dict (TypedDict, JSON schema).

        The model is asked (in the last human turn) for one JSON object matching the schema; the first JSON
        object of its answer is parsed and validated. `method`: "json_schema" (default; the schema is shown to the
        model), "function_calling" (the same here: there is no tool calling) or "json_mode" (only "answer with
        JSON" is asked; the prompt must describe the fields). `strict` is accepted; validation is always strict.

        Raises (on invoke): `OutputParserException` when the answer is not JSON or does not match the schema
        (small models often cannot comply; raise `max_tokens` for long objects). With `include_raw=True` the
        output is `{"raw": AIMessage, "parsed": object | None, "parsing_error": exception | None}` instead.
        """
        if kwargs:
            raise ValueError(f"ChatKVFuse.with_structured_output got unsupported arguments {sorted(kwargs)}")
        if method not in ("json_schema", "function_calling", "json_mode"):
            raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}")
        parser = _StructuredParser(schema)
        response_format = ({"type": "json_object"} if method == "json_mode" else
                           {"type": "json_schema", "schema": parser.json_schema})
        llm = self.bind(response_format=response_format,
                        ls_structured_output_format={"kwargs": {"method": method}, "schema": schema})
        parse = RunnableLambda(parser, name="KVFuseStructuredOutputParser")
        if not include_raw:
            return llm | parse
        from operator import itemgetter

        parser_assign = RunnablePassthrough.assign(parsed=itemgetter("raw") | parse, parsing_error=lambda _: None)
        parser_none = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parser_assign.with_fallbacks([parser_none], exception_key="parsing_error")
