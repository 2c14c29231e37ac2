"""`coinrag` (CoinRAG's nugget-level reuse): keep only the query-relevant sentences of the retrieved chunks.

Chunk caches are the ordinary per-document caches (each computed with the whole chunk as its context). Per request:

1. the question is probed over every retrieved chunk (the runner's question probe, as infoflow's: the deepest
   third of the layers) and each cached token gets infoflow's score (L2 norm over the question rows of the
   attention it receives, averaged over the probe layers);
2. each chunk is cut into sentences (at tokens whose text ends a sentence or a line) and a sentence's score is its
   mean token score (density, so long sentences are not favoured);
3. sentences are kept, best first over all chunks, until `keep` of the document tokens are kept; a chunk none of
   whose sentences is kept leaves the prompt with its title, and a kept chunk keeps its title rows (computed) as
   its chunk-level context;
4. the kept sentences' K/V rows are sliced from the chunk caches and re-positioned exactly (RoPE at their new,
   contiguous positions), and the shorter prompt is fused with infoflow's selection at the request's ratio (the
   ratio applies to the kept tokens).

The prompt the model sees is shorter, so prefill and every decode step cost less; the first probe (over the whole
chunks) is the price. The engine runs steps 1-3 (`compresses_documents`, `nuggets`); the selection of step 4 is
this class's `initial`, inherited from infoflow.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import SelectContext, register
from .infoflow import InfoFlow

__all__ = ["CoinRAG", "sentence_spans"]

_ENDS = (".", "!", "?", "\n", ";")


def sentence_spans(texts: list[str], min_tokens: int = 6) -> list[tuple[int, int]]:
    """Token index spans [start, end) of the sentences of a chunk, from its tokens' texts: a sentence ends at a
    token whose text (stripped of spaces) ends with . ! ? ; or holds a newline; spans shorter than `min_tokens`
    join the next one (abbreviations, list items)."""
    spans, start = [], 0
    for i, t in enumerate(texts):
        s = t.rstrip(" ")
        if ("\n" in t or s.endswith(_ENDS)) and i + 1 - start >= min_tokens:
            spans.append((start, i + 1))
            start = i + 1
    if start < len(texts):
        if spans and len(texts) - start < min_tokens:
            spans[-1] = (spans[-1][0], len(texts))
        else:
            spans.append((start, len(texts)))
    return spans


@register
class CoinRAG(InfoFlow):
    name = "coinrag"
    graph_safe = False  # the prompt itself changes per request
    layout_free = False
    compresses_documents = True

    def __init__(self, keep: float = 0.5, layers=None, depth: float = 1 / 3, min_sentence_tokens: int = 6) -> None:
        """
        Args:
            keep: share of the retrieved document tokens kept as nuggets, in (0, 1].
            layers / depth: the probe layers (as infoflow's).
            min_sentence_tokens: shorter sentences join the next one.
        """
        super().__init__(layers=layers, depth=depth)
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"keep must be in (0, 1], got {keep}")
        if min_sentence_tokens < 1:
            raise ValueError(f"min_sentence_tokens must be >= 1, got {min_sentence_tokens}")
        self.keep = float(keep)
        self.min_sentence_tokens = int(min_sentence_tokens)

    def nuggets(self, ctx: SelectContext, sentences: list[list[tuple[int, int]]]) -> list[Tensor]:
        """Per document (prompt order), the sorted local token rows kept.

        Args:
            ctx: the selection context of the probe over the whole chunks.
            sentences: per document, its sentence spans (local token indices, `sentence_spans`).
        """
        scores = self.scores(ctx).float().cpu()
        cand = ctx.candidates.cpu()
        total = sum(e - s for s, e in ctx.doc_spans)
        ranked = []  # (density, doc, start, end)
        for d, ((s0, _), spans) in enumerate(zip(ctx.doc_spans, sentences)):
            for a, b in spans:
                lo = int(torch.searchsorted(cand, s0 + a))
                hi = int(torch.searchsorted(cand, s0 + b))
                dens = float(scores[lo:hi].mean()) if hi > lo else 0.0
                ranked.append((dens, d, a, b))
        ranked.sort(key=lambda r: (-r[0], r[1], r[2]))
        want = max(1, round(self.keep * total))
        kept: list[list[tuple[int, int]]] = [[] for _ in ctx.doc_spans]
        n = 0
        for _, d, a, b in ranked:
            if n >= want:
                break
            kept[d].append((a, b))
            n += b - a
        return [torch.cat([torch.arange(a, b) for a, b in sorted(k)]) if k else torch.zeros(0, dtype=torch.long)
                for k in kept]

    def describe(self) -> str:
        return f"{self.name}(keep={self.keep:g})"
