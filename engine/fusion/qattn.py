"""Shared pieces of the query-aware strategies (infoflow, prophetkv, qcfuse, fusionrag).

They all read `ctx.question_attention` ({layer: [Q, N]} softmax probabilities of the question rows over every key,
averaged over heads, from the runner's question probe) and rank the cached document tokens (`ctx.candidates`).
Only candidates are ever scored, so the prefix's attention sink (position 0) and the question's attention to
itself never take budget. The rows reduced are `ctx.question`, the rows the runner always computes: the question
and the chat suffix (plus any document served without a cache, which the engine never does: it caches misses
first).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import SelectContext

__all__ = ["resolve_layers", "deep_layers", "window_layers", "spread_layers", "candidate_attention", "reduce_rows",
           "layer_mean", "doc_index"]


def resolve_layers(layers, n_layers: int) -> tuple[int, ...]:
    """Sorted unique layer indices; negative ones count from the end. Raises ValueError when out of range."""
    out = set()
    for x in layers:
        i = int(x)
        j = i + n_layers if i < 0 else i
        if not 0 <= j < n_layers:
            raise ValueError(f"layer {i} out of range for a {n_layers}-layer model")
        out.add(j)
    if not out:
        raise ValueError("no probe layers given")
    return tuple(sorted(out))


def deep_layers(n_layers: int, fraction: float) -> tuple[int, ...]:
    """The last `fraction` of the layers (at least one): e.g. 1/3 of 24 layers -> 16..23."""
    k = max(1, min(n_layers, int(round(n_layers * fraction))))
    return tuple(range(n_layers - k, n_layers))


def window_layers(n_layers: int, lo: float, hi: float) -> tuple[int, ...]:
    """The layers whose depth fraction lies in [lo, hi): floor(lo * n) .. ceil(hi * n) - 1, at least one, never
    the last layer unless the model has one. E.g. (0.55, 0.65) of 40 layers -> 22..25, of 24 -> 13..15."""
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"layer window must satisfy 0 <= lo < hi <= 1, got ({lo}, {hi})")
    top = max(0, n_layers - 2) if n_layers > 1 else 0
    a = min(int(lo * n_layers), top)
    b = min(max(a + 1, math.ceil(round(hi * n_layers, 6))), top + 1)
    return tuple(range(a, b))


def spread_layers(n_layers: int, count: int, lo: float = 0.0, hi: float = 1.0) -> tuple[int, ...]:
    """`count` layers evenly spread over the depth fractions [lo, hi] (unique, sorted)."""
    if n_layers <= 0:
        return ()
    top = n_layers - 1
    if count <= 1:
        return (min(top, int(round(top * (lo + hi) / 2))),)
    pts = torch.linspace(lo * top, hi * top, count).round().long().clamp(0, top)
    return tuple(sorted(set(int(p) for p in pts)))


def candidate_attention(ctx: SelectContext, layer: int) -> Tensor:
    """[Q, C] float32 attention of the question rows to the candidate tokens at `layer`."""
    att = ctx.question_attention.get(layer)
    if att is None:
        raise RuntimeError(f"no question attention recorded at layer {layer} (probe layers: "
                           f"{sorted(ctx.question_attention)})")
    return att.float()[:, ctx.candidates.to(att.device)]


def reduce_rows(att: Tensor, how: str, rows: Tensor | None = None) -> Tensor:
    """Reduces [Q, C] over the question rows: "l2" (InfoFlow's attention norm), "mean", "max". `rows` ([Q] bool)
    keeps only those rows; it is applied as a mask (no data-dependent shapes: CUDA-graph safe), and when it keeps
    none every row counts."""
    if att.shape[0] == 0:
        return att.new_zeros(att.shape[1])
    if rows is not None:
        keep = rows.to(att.device).bool()
        keep = keep | ~keep.any()  # none marked: all rows
        w = keep.to(att.dtype)[:, None]
        if how == "mean":
            return (att * w).sum(dim=0) / w.sum().clamp_min(1.0)
        att = att * w  # attention is >= 0: a zeroed row changes neither the L2 norm nor the max of the others
    if how == "l2":
        return torch.linalg.vector_norm(att, ord=2, dim=0)
    if how == "mean":
        return att.mean(dim=0)
    if how == "max":
        return att.amax(dim=0)
    raise ValueError(f"unknown row reduction {how!r}")


def layer_mean(ctx: SelectContext, layers, how: str, normalise: bool = False, own_rows: bool = False) -> Tensor:
    """[C] candidate scores: per layer, the question rows reduced by `how` (only the question's own tokens,
    `ctx.probe_rows`, with `own_rows`); optionally each layer's scores divided by their sum over the candidates
    (so every layer weighs the same); then averaged over layers."""
    rows = ctx.probe_rows if own_rows else None
    total = None
    for layer in layers:
        s = reduce_rows(candidate_attention(ctx, layer), how, rows)
        if normalise:
            s = s / s.sum().clamp_min(1e-12)
        total = s if total is None else total + s
    if total is None:
        return torch.zeros(int(ctx.candidates.numel()))
    return total / len(layers)


def doc_index(ctx: SelectContext, positions: Tensor) -> Tensor:
    """For each position, the index (prompt order) of the document span containing it."""
    ends = torch.tensor([e for _, e in ctx.doc_spans], dtype=torch.long, device=positions.device)
    return torch.searchsorted(ends, positions, right=True)
