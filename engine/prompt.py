"""Prompt layout with explicit document spans.

A RAG prompt is `[prefix][doc 1]...[doc n][question + assistant header]`, built as token ids, never by
searching for separator strings. The prefix is the chat template up to the user turn's content (system
prompt included) plus a fixed instruction; each document is tokenized alone (so its cache is reusable in any
order); the tail holds the question, the end of the user turn and the assistant header.
"""
from __future__ import annotations

import array
import itertools
import string
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .types import Document
from .validate import check_text

__all__ = ["PROMPT_PRESETS", "PromptFormat", "PromptBuilder", "PromptLayout", "Span"]

_SLOT = "\x00KVFUSE-CONTENT\x00"



def _long_tensor(values) -> Tensor:
    """An int64 tensor of an iterable of ints (through `array`: ~2x faster than torch.tensor of a list)."""
    if not _Q8:
        return torch.tensor(list(values), dtype=torch.long)
    buf = array.array("q", values)
    return torch.frombuffer(buf, dtype=torch.long) if len(buf) else torch.zeros(0, dtype=torch.long)


_Q8 = array.array("q").itemsize == 8


class _TokenMemo:
    """Token ids of recently seen document texts (the same documents recur across requests, and tokenizing 8k
    tokens costs milliseconds of every request's TTFT). Keyed by the text itself, so a changed text is never served
    another's ids; least recently used texts go first beyond `max_tokens` ids in all (8 bytes each)."""

    def __init__(self, max_tokens: int = 1 << 21) -> None:
        self.max_tokens = max_tokens
        self._items: OrderedDict[str, array.array] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def ids(self, text: str, encode) -> list[int]:
        with self._lock:
            hit = self._items.get(text)
            if hit is not None:
                self._items.move_to_end(text)
                return hit.tolist()
        ids = encode()
        if len(ids) <= self.max_tokens // 8:
            with self._lock:
                if text not in self._items:
                    self._items[text] = array.array("q", ids)
                    self._tokens += len(ids)
                    while self._tokens > self.max_tokens:
                        self._tokens -= len(self._items.popitem(last=False)[1])
        return list(ids)

@dataclass(frozen=True)
class PromptFormat:
    """Text around the documents. Changing any field changes the cache namespace (via the prefix ids).

    Attributes:
        system_prompt: system message, or None for the chat template's default.
        instruction: fixed text at the start of the user turn, before the documents.
        doc_suffix: appended to every document's text (part of the document's own tokens).
        question_template: the question text after the documents; `{question}` is replaced.
    """

    system_prompt: str | None = None
    instruction: str = "Answer the question using the documents below.\n\n"
    doc_suffix: str = "\n\n"
    question_template: str = "Question: {question}\nAnswer concisely."

    def __post_init__(self) -> None:
        if self.system_prompt is not None:
            check_text(self.system_prompt, "PromptFormat.system_prompt", allow_empty=True)
        check_text(self.instruction, "PromptFormat.instruction", allow_empty=True)
        check_text(self.doc_suffix, "PromptFormat.doc_suffix", allow_empty=True)
        _check_question_template(check_text(self.question_template, "PromptFormat.question_template",
                                            allow_empty=True))


def _check_question_template(template: str) -> None:
    """The template must hold the plain field `{question}` (at least once) and no other field; literal braces are
    written `{{` and `}}`."""
    what = f"PromptFormat.question_template {template!r}"
    try:
        fields = [(name, conv, spec) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as e:  # unbalanced braces
        raise ValueError(f"{what} is not a valid format string ({e}); write literal braces as {{{{ and }}}}") from None
    for name, conv, spec in fields:
        if name != "question" or conv or spec:
            field = "{" + name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
            raise ValueError(f"{what} has the field {field}; only {{question}} is allowed (write literal braces as "
                             f"{{{{ and }}}})")
    if not fields:
        raise ValueError(f"{what} has no {{question}} field: the question would be dropped from the prompt")


_SHORT = "Answer the question based on the given passages. Only give me the answer and do not output any other words."

#: Named prompt formats. "chat" (the default) answers in sentences; "qa" asks for the bare answer the way
#: LongBench's multi-document QA prompts do, which is what word-level F1 against short gold answers expects.
PROMPT_PRESETS: dict[str, PromptFormat] = {
    "chat": PromptFormat(),
    "qa": PromptFormat(instruction=f"{_SHORT}\n\nThe following are given passages.\n\n",
                       question_template=f"{_SHORT}\n\nQuestion: {{question}}\nAnswer:"),
}


@dataclass(frozen=True)
class Span:
    """A half-open token range [start, end) of the fused prompt."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass
class PromptLayout:
    """Token ids of one request and where each part sits.

    Attributes:
        ids: [N] int64 token ids of the whole prompt.
        prefix: span of the fixed prefix (always starts at 0).
        docs: one span per document, in prompt order.
        tail: span of the question + assistant header (always recomputed).
        doc_ids: per-document token ids (each [L_i]), the exact tokens cached for that document.
        glue: computed, never-cached spans between the prefix and the tail (document titles; the text around
            documents found inside a chat prompt).
        prefix_cached: whether the prefix is the engine's fixed prefix (served from its cache) or prompt text
            of a chat request (computed).
    """

    ids: Tensor
    prefix: Span
    docs: list[Span]
    tail: Span
    doc_ids: list[Tensor]
    glue: list[Span] = field(default_factory=list)
    prefix_cached: bool = True

    @classmethod
    def from_pieces(cls, pieces: list[tuple[str, list[int]]], prefix_cached: bool = False) -> PromptLayout:
        """A layout from ("text", ids) and ("doc", ids) pieces in prompt order: the first piece is the prefix, the
        last the tail (both text), text pieces between are glue."""
        if len(pieces) == 1:  # text alone (a chat with no documents): an empty prefix, all of it the tail
            pieces = [("text", []), *pieces]
        if not pieces or pieces[0][0] != "text" or pieces[-1][0] != "text":
            raise ValueError("a layout needs a text prefix and a text tail around its pieces")
        spans, pos = [], 0
        for _, ids in pieces:
            spans.append(Span(pos, pos + len(ids)))
            pos += len(ids)
        docs = [sp for sp, (kind, _) in zip(spans, pieces) if kind == "doc"]
        glue = [sp for sp, (kind, _) in zip(spans[1:-1], pieces[1:-1]) if kind == "text" and len(sp)]
        ids = _long_tensor(itertools.chain.from_iterable(p for _, p in pieces))
        return cls(ids=ids, prefix=spans[0], docs=docs, tail=spans[-1], doc_ids=[ids[sp.start:sp.end] for sp in docs],
                   glue=glue, prefix_cached=prefix_cached)

    @property
    def n(self) -> int:
        return int(self.ids.numel())

    @property
    def doc_tokens(self) -> int:
        return sum(len(s) for s in self.docs)

    def first_document_exact(self, documents_adapted: bool = False) -> bool:
        """Whether the first document's plain cache is exactly what full prefill computes there: it sits right after
        the engine's cached prefix, the context it was computed after, and no adapter acted on the documents (an
        offline fusion adapter's caches differ from the base model's by design). Such a document is never
        selected for recompute, and a cache variant computed with other context (fusionrag's, a `doc_context`'s)
        is not used for it."""
        return (self.prefix_cached and bool(self.docs) and self.docs[0].start == self.prefix.end
                and not documents_adapted)


class PromptBuilder:
    """Turns (question, documents) into a PromptLayout for one tokenizer and format.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template (a plain fallback is used without one).
        fmt: the PromptFormat.
    """

    def __init__(self, tokenizer, fmt: PromptFormat | None = None) -> None:
        self.tokenizer = tokenizer
        self.fmt = fmt or PromptFormat()
        self._memo = _TokenMemo()
        head, tail = self._split_template()
        self.prefix_ids = self._encode(head + self.fmt.instruction)
        self._tail_text = tail
        self.empty_tail = self.encode_tail("")  # the tail of an empty question: template text and assistant header
        if not self.prefix_ids:
            raise ValueError("the prompt prefix is empty: give the tokenizer a chat template or an instruction")

    def _split_template(self) -> tuple[str, str]:
        msgs = []
        if self.fmt.system_prompt is not None:
            msgs.append({"role": "system", "content": self.fmt.system_prompt})
        msgs.append({"role": "user", "content": _SLOT})
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        else:
            sys_text = f"{self.fmt.system_prompt}\n\n" if self.fmt.system_prompt else ""
            text = f"{sys_text}User: {_SLOT}\nAssistant:"
        if text.count(_SLOT) != 1:
            raise ValueError("the chat template does not place the user content exactly once")
        head, tail = text.split(_SLOT)
        return head, tail

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_document(self, doc: Document) -> list[int]:
        """Token ids of one document as it appears in every prompt (independent of its position): its body and
        the format's `doc_suffix`, or its `token_ids` as given (no tokenizer call)."""
        if doc.token_ids is not None:
            return list(doc.token_ids)
        return self._memo.ids(doc.text, lambda: self._encode(doc.text + self.fmt.doc_suffix))

    def encode_tail(self, question: str) -> list[int]:
        """Token ids of the question and the assistant header."""
        return self._encode(self.fmt.question_template.format(question=question) + self._tail_text)

    def question_span(self, layout: PromptLayout) -> Span | None:
        """The question's own tokens inside `layout`'s tail: what is left of the tail without the tokens it shares,
        from the front and from the back, with the tail of an empty question (the question template's text and
        the assistant header). None when nothing is left."""
        tail = layout.ids[layout.tail.start:layout.tail.end].tolist()
        empty = self.empty_tail
        a = 0
        while a < min(len(tail), len(empty)) and tail[a] == empty[a]:
            a += 1
        b = 0
        while b < min(len(tail), len(empty)) - a and tail[-1 - b] == empty[-1 - b]:
            b += 1
        if a + b >= len(tail):
            return None
        return Span(layout.tail.start + a, layout.tail.end - b)

    def encode_body(self, doc: Document) -> list[int]:
        """Token ids of a document's body without the suffix (a body found inside a chat prompt, not followed by
        the suffix); cached under its own key."""
        return self._encode(doc.text)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of prompt text (special tokens written in it, like a chat template's, are parsed)."""
        return self._encode(text) if text else []

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The whole chat prompt as text, through the tokenizer's chat template, ending with the assistant header.
        The format's system prompt is used when the messages have none."""
        msgs = list(messages)
        if self.fmt.system_prompt is not None and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.fmt.system_prompt})
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        names = {"system": "System", "user": "User", "assistant": "Assistant"}
        return "".join(f"{names[m['role']]}: {m['content']}\n" for m in msgs) + "Assistant:"

    def encode_title(self, doc: Document) -> list[int]:
        """Token ids of a document's title line (computed before its body, never cached); [] without a title."""
        return self._encode(f"{doc.title}\n") if doc.title else []

    def build(self, question: str | list[int], doc_ids: list[list[int]], title_ids: list[list[int]] | None = None,
              links: list[int] | None = None) -> PromptLayout:
        """Lays out prefix, documents (already tokenized) and question.

        Args:
            question: the user's question as text (tokenized with `encode_tail`), or the tail's token ids as
                given (what `encode_tail` gives for a text question: the question template and the assistant
                header included).
            doc_ids: token ids of each document, from `encode_document`.
            title_ids: token ids of each document's title line (`encode_title`), placed before it as glue.
            links: placeholder ids of the link rows (engine/links.py) written after every document, as glue.
        """
        if isinstance(question, str):
            if not question.strip():
                raise ValueError("the question is empty")
            tail = self.encode_tail(question)
        elif isinstance(question, (list, tuple)):
            tail = list(question)
            if not tail:
                raise ValueError("question_ids is empty")
        else:
            raise ValueError(f"the question must be a string or a list of token ids, got {type(question).__name__}")
        pieces: list[tuple[str, list[int]]] = [("text", list(self.prefix_ids))]
        for i, ids in enumerate(doc_ids):
            if title_ids and title_ids[i]:
                pieces.append(("text", list(title_ids[i])))
            pieces.append(("doc", list(ids)))
            if links:
                pieces.append(("text", list(links)))
        pieces.append(("text", tail))
        return PromptLayout.from_pieces(pieces, prefix_cached=True)
