"""Registered documents, found by content inside any prompt.

A framework's stock path (LlamaIndex's `as_query_engine`, a LangChain LCEL chain that stuffs retrieved text into
a prompt template) hands the LLM one string. kvfuse fuses it anyway: every document the engine has seen
(precomputed, registered, or used in a request) is remembered by its body text, and a prompt is scanned for
those bodies; each found span is served from the document's cache and the text around it is computed.

Only a fingerprint is kept per document (the first `HEAD` characters, the body's length and its sha256), so the
index is small and bounded (`budget_bytes`, least recently registered forgotten first) and never holds document
text. A match is verified by hashing the prompt's span, so a fingerprint collision can't serve a wrong cache.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from .types import Document

__all__ = ["DocumentIndex", "Match", "HEAD"]

HEAD = 24  # characters of a body's start used to find candidates; bodies shorter than this are not searched for


@dataclass(frozen=True)
class Match:
    """A registered document found in a text: characters [start, end) are its body."""

    start: int
    end: int
    doc: Document


@dataclass(frozen=True)
class _Entry:
    doc_id: str
    length: int
    digest: bytes


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


class DocumentIndex:
    """doc id -> fingerprint of its body, searchable by content.

    Args:
        budget_bytes: bound of the index (about 200 bytes per document plus its id).
    """

    _OVERHEAD = 200

    def __init__(self, budget_bytes: int = 16 << 20) -> None:
        self.budget = int(budget_bytes)
        self.used = 0
        self._by_id: OrderedDict[str, tuple[str, _Entry]] = OrderedDict()  # id -> (head, entry)
        self._by_head: dict[str, list[_Entry]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, doc_id: str) -> bool:
        return doc_id in self._by_id

    @staticmethod
    def fingerprint(doc: Document) -> tuple[str, int, bytes] | None:
        """(head, length, sha256) of a document's body, or None when it is too short to be searched for."""
        body = doc.text
        if len(body.strip()) < HEAD:
            return None
        return body[:HEAD], len(body), _digest(body)

    def known(self, doc: Document) -> bool:
        """Whether `doc`'s id is registered with exactly this body (then only marks it recently used)."""
        item = self._by_id.get(doc.id)
        if item is None or item[1].length != len(doc.text) or item[1].digest != _digest(doc.text):
            return False
        self._by_id.move_to_end(doc.id)
        return True

    def add(self, doc: Document) -> bool:
        """Remembers `doc` (replacing what its id held); False when its body is too short to be searched for."""
        fp = self.fingerprint(doc)
        return fp is not None and self.add_fingerprint(doc.id, *fp)

    def add_fingerprint(self, doc_id: str, head: str, length: int, digest: bytes) -> bool:
        """Remembers a document by its fingerprint alone (as stored on disk)."""
        if len(head) != HEAD or length < HEAD or len(digest) != 32:
            return False
        self.remove(doc_id)
        entry = _Entry(doc_id, int(length), bytes(digest))
        cost = self._OVERHEAD + len(doc_id)
        while self._by_id and self.used + cost > self.budget:
            self.remove(next(iter(self._by_id)))
        if cost > self.budget:
            return False
        self._by_id[doc_id] = (head, entry)
        self._by_head.setdefault(head, []).append(entry)
        self.used += cost
        return True

    def remove(self, doc_id: str) -> bool:
        """Forgets a document id; False when it was not registered."""
        item = self._by_id.pop(doc_id, None)
        if item is None:
            return False
        head, entry = item
        same = [e for e in self._by_head.get(head, []) if e is not entry]
        if same:
            self._by_head[head] = same
        else:
            self._by_head.pop(head, None)
        self.used -= self._OVERHEAD + len(doc_id)
        return True

    def find(self, text: str, extra: list[Document] = ()) -> list[Match]:
        """Non-overlapping registered bodies (and `extra` documents' bodies) in `text`, left to right; at one
        position the longest body wins."""
        heads = self._by_head
        local: dict[str, list[_Entry]] = {}
        own: dict[str, Document] = {}
        for d in extra:
            if len(d.text.strip()) >= HEAD:
                local.setdefault(d.text[:HEAD], []).append(_Entry(d.id, len(d.text), _digest(d.text)))
                own[d.id] = d
        if not heads and not local:
            return []
        out: list[Match] = []
        i, n = 0, len(text)
        while i + HEAD <= n:
            h = text[i:i + HEAD]
            if h not in heads and h not in local:
                i += 1
                continue
            cands = heads.get(h, []) + local.get(h, [])
            best = None
            for e in sorted(cands, key=lambda e: -e.length):
                if i + e.length <= n and _digest(text[i:i + e.length]) == e.digest:
                    best = e
                    break
            if best is None:
                i += 1
                continue
            doc = own.get(best.doc_id)
            out.append(Match(i, i + best.length, doc or Document(best.doc_id, text[i:i + best.length])))
            if best.doc_id in self._by_id:
                self._by_id.move_to_end(best.doc_id)
            i += best.length
        return out
