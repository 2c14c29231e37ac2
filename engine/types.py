"""Request and result types shared by the API, the CLI, the eval harness and the integrations.

No tensor math here: plain dataclasses that every layer above the runner can import cheaply.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

__all__ = ["Document", "GenerationResult", "PrecomputeReport", "GenerationStream", "as_documents"]


@dataclass(frozen=True)
class Document:
    """One retrieved document.

    Args:
        id: the caller's handle (a node id, a passage id). Used to find the cache quickly; the content
            is always verified, so a changed text under the same id is recomputed, never served stale.
        text: the document text exactly as it should appear in the prompt.
    """

    id: str
    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"document id must be a non-empty string, got {self.id!r}")
        if not isinstance(self.text, str):
            raise ValueError(f"document {self.id!r}: text must be a string, got {type(self.text).__name__}")
        if not self.text.strip():
            raise ValueError(f"document {self.id!r}: text is empty")


def as_documents(docs: Iterable[Any]) -> list[Document]:
    """Normalises `(id, text)` pairs, mappings with `id`/`text` (and optional `title`), or Documents.

    Raises:
        ValueError: on anything else, naming the offending position.
    """
    if docs is None:
        return []
    if isinstance(docs, (str, bytes)):
        raise ValueError("docs must be a list of (id, text) pairs, not a single string")
    out: list[Document] = []
    for i, d in enumerate(docs):
        if isinstance(d, Document):
            out.append(d)
        elif isinstance(d, Mapping):
            if "text" not in d:
                raise ValueError(f"docs[{i}]: mapping has no 'text' key")
            text = d["text"]
            title = d.get("title") or ""
            if title:
                text = f"{title}\n{text}"
            out.append(Document(str(d.get("id") or d.get("doc_id") or f"doc-{i}"), text))
        elif isinstance(d, (tuple, list)) and len(d) == 2:
            out.append(Document(str(d[0]), d[1]))
        else:
            raise ValueError(f"docs[{i}]: expected (id, text), a mapping or a Document, got {type(d).__name__}")
    return out


@dataclass
class GenerationResult:
    """What one `FusionEngine.generate` call produced, with its costs.

    Times are seconds, measured on the host after device synchronisation.
    """

    text: str
    token_ids: list[int]
    strategy: str
    recompute_ratio: float
    finish_reason: str  # "stop" (end-of-turn token or stop string) | "length"
    ttft_s: float  # call -> first token's logits (tokenize, lookup, misses, selection, fused prefill)
    prefill_s: float  # fused prefill alone (selection included)
    decode_s: float  # every token after the first
    selection_s: float  # time the strategy spent choosing tokens
    miss_prefill_s: float  # time spent computing caches of documents that missed
    prompt_tokens: int
    doc_tokens: int
    question_tokens: int  # question + chat suffix, always recomputed
    recomputed_tokens: int  # document tokens recomputed by the strategy (question excluded)
    cache_hits: int
    cache_misses: int
    stale: int = 0  # documents whose id was known but whose content changed (recomputed)
    recomputed_positions: list[int] = field(default_factory=list)  # their prompt positions (empty for full)
    doc_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each document, prompt order
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def recompute_fraction(self) -> float:
        """Recomputed document tokens over all document tokens (0 when there are no documents)."""
        return self.recomputed_tokens / self.doc_tokens if self.doc_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["recompute_fraction"] = self.recompute_fraction
        return d


@dataclass
class PrecomputeReport:
    """Result of `FusionEngine.precompute`."""

    hits: int
    misses: int
    tokens: int
    seconds: float


class GenerationStream:
    """Iterator over text deltas; `.result` holds the GenerationResult once exhausted.

    Args:
        gen: a generator that yields `str` deltas and returns the GenerationResult.
    """

    def __init__(self, gen: Iterator[str], on_close: Callable[[], None] | None = None) -> None:
        self._gen = gen
        self.result: GenerationResult | None = None
        self._on_close = on_close

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> str:
        try:
            return next(self._gen)
        except StopIteration as stop:
            self.result = stop.value
            raise

    def close(self) -> None:
        self._gen.close()
        if self._on_close:
            self._on_close()
