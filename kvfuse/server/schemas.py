"""Request bodies of the OpenAI-compatible endpoints, and their translation into engine keywords.

Fields OpenAI defines but the engine cannot honour are refused with a 400 naming them (never silently ignored
when they would change the answer); fields that do not change the answer (`user`, `store`, `metadata`, ...) are
accepted and ignored. kvfuse's own fields: `documents`, `strategy`, `recompute_ratio`, `guard_margin`, `guard_tokens`, `guard_at`, and
with strategy "auto"
`target_fidelity` or `ttft_budget_s`.
"""
from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError

__all__ = ["DocumentIn", "ChatRequest", "CompletionRequest", "DocumentsRequest", "engine_options",
           "chat_messages"]


class DocumentIn(BaseModel):
    """A document given with its text (a bare string in `documents` names one registered before)."""
    model_config = ConfigDict(extra="forbid")
    id: str | int
    text: str
    title: str = ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    # kvfuse extensions
    documents: list[Any] | None = None  # DocumentIn objects, or ids (str) of documents registered before
    strategy: str | None = None
    recompute_ratio: float | None = None
    target_fidelity: float | None = None  # with strategy "auto"
    ttft_budget_s: float | None = None  # with strategy "auto"
    guard_margin: float | None = None  # near-ties on the fused path hand the answer to full prefill
    guard_tokens: int | None = None  # ... checked on the answer's first this many tokens
    guard_at: str | None = None  # ... read on the answer ("answer") or the question probe ("probe")

    # fields that would change the answer and that this server does not implement
    _unsupported: tuple[str, ...] = ()

    def refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name in self._unsupported:
            if extra.get(name) not in (None, [], {}, False):
                raise APIError(400, f"'{name}' is not supported by this server", param=name)
        if self.n not in (None, 1):
            raise APIError(400, f"only n=1 is supported, got n={self.n}", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"'{name}' is not supported by this server (only 0)", param=name)
        if self.logit_bias:
            raise APIError(400, "'logit_bias' is not supported by this server", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "'stream_options' is only allowed with stream: true", param="stream_options")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    _unsupported = ("tools", "functions", "tool_choice", "function_call", "audio", "prediction")

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs or self.top_logprobs:
            raise APIError(400, "logprobs are not supported by this server", param="logprobs")
        fmt = (self.model_extra or {}).get("response_format")
        if fmt not in (None, {"type": "text"}):
            raise APIError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format")
        modalities = (self.model_extra or {}).get("modalities")
        if modalities not in (None, ["text"]):
            raise APIError(400, "only the text modality is supported", param="modalities")

    @property
    def answer_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree; give one", param="max_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: Union[str, list[str]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs is not None:
            raise APIError(400, "logprobs are not supported by this server", param="logprobs")
        if self.echo:
            raise APIError(400, "'echo' is not supported by this server", param="echo")
        if self.best_of not in (None, 1):
            raise APIError(400, "only best_of=1 is supported", param="best_of")
        if self.suffix:
            raise APIError(400, "'suffix' is not supported by this server", param="suffix")

    @property
    def answer_tokens(self) -> int | None:
        return self.max_tokens

    def question(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise APIError(400, f"one prompt per request is supported, got a list of {len(self.prompt)}",
                           param="prompt")
        return self.prompt[0]


class DocumentsRequest(BaseModel):
    """POST /v1/documents: register documents and compute their caches."""
    model_config = ConfigDict(extra="forbid")
    documents: list[DocumentIn] = Field(min_length=1)
    strategy: str | None = None  # also compute the offline data this strategy reads
    precompute: bool = True


def engine_options(req: _Request, default_max_tokens: int) -> dict[str, Any]:
    """The engine keywords of a request (what the request leaves out keeps the engine's default, except
    temperature, whose OpenAI default is 1)."""
    opts: dict[str, Any] = {
        "max_new_tokens": req.answer_tokens if req.answer_tokens is not None else default_max_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
    }
    if req.top_p is not None:
        opts["top_p"] = req.top_p
    if req.seed is not None:
        opts["seed"] = req.seed
    if req.stop is not None:
        opts["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if len(opts["stop"]) > 4:
            raise APIError(400, f"at most 4 stop sequences, got {len(opts['stop'])}", param="stop")
    if req.strategy is not None:
        opts["strategy"] = req.strategy
    if req.recompute_ratio is not None:
        opts["recompute_ratio"] = req.recompute_ratio
    for name in ("target_fidelity", "ttft_budget_s", "guard_margin", "guard_tokens", "guard_at"):
        if getattr(req, name) is not None:
            opts[name] = getattr(req, name)
    return opts


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """OpenAI messages as the engine's {role, content} turns: text parts joined, `developer` read as `system`;
    tool turns and non-text parts refused."""
    out = []
    for i, m in enumerate(messages):
        role = _ROLES.get(m.role)
        if role is None:
            raise APIError(400, f"messages[{i}]: role {m.role!r} is not supported (system, developer, user, "
                                f"assistant)", param=f"messages[{i}].role")
        if (m.model_extra or {}).get("tool_calls"):
            raise APIError(400, f"messages[{i}]: tool calls are not supported", param=f"messages[{i}].tool_calls")
        content = m.content
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content[{j}]: only text parts are supported, got "
                                        f"{part.get('type')!r}", param=f"messages[{i}].content")
                texts.append(part["text"])
            content = "\n".join(texts)
        out.append({"role": role, "content": content})
    return out

