"""Piecewise CUDA graphs of a prefill's dense work, for layouts never seen before.

A fused prefill's layout (document spans, positions, selected rows) changes with every RAG request, but the
dense work of a layer depends only on how many rows it computes: the input norm and q/k/v projections
(`Decoder.project`) and the output projection + MLP (`Decoder.finish`). Those two pieces of every layer are
captured once per row bucket (16, 32, ..., `max_rows`) over static buffers, and replayed for any request whose
active rows fit the bucket (rows past the request's are padding: computed, never read). Attention, the scatter
of fresh rows and the strategy's selection stay eager between the pieces (they carry the layout). This cuts the
eager launches of a layer by about two thirds whatever the layout; a repeated layout still replays a graph of the
whole prefill (engine/runner.py `_GraphCache`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .cudagraph import capture_graph

__all__ = ["DenseGraphs"]


class _Bucket:
    """Static buffers and the per-layer graphs of one row bucket."""

    def __init__(self, dec, rows: int) -> None:
        s = dec.spec
        kw = dict(dtype=dec.dtype, device=dec.device)
        self.rows = rows
        self.h_in = torch.zeros((rows, s.hidden), **kw)                       # project's input
        self.q = torch.zeros((rows, s.n_heads, s.head_dim), **kw)             # project's outputs
        self.k = torch.zeros((rows, s.n_kv_heads, s.head_dim), **kw)
        self.v = torch.zeros((rows, s.n_kv_heads, s.head_dim), **kw)
        self.h_mid = torch.zeros((rows, s.hidden), **kw)                      # finish's inputs
        self.attn = torch.zeros((rows, s.n_heads, s.head_dim), **kw)
        self.h_out = torch.zeros((rows, s.hidden), **kw)                      # finish's output
        self.project: dict[int, torch.cuda.CUDAGraph] = {}
        self.finish: dict[int, torch.cuda.CUDAGraph] = {}


class DenseGraphs:
    """Replays `project`/`finish` of each layer from CUDA graphs captured per row bucket.

    Args:
        decoder: the model's per-layer seam.
        max_rows: the largest bucket (more active rows run eagerly: they are compute-bound anyway).
    """

    def __init__(self, decoder, max_rows: int = 4096) -> None:
        self.dec = decoder
        self.max_rows = max_rows
        self.buckets: dict[int, _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.suspended = 0  # >0 while a whole-prefill graph is being captured (graphs do not nest)

    def _bucket(self, t: int) -> _Bucket | None:
        if self.suspended or t > self.max_rows or t == 0:
            return None
        rows = max(16, 1 << (t - 1).bit_length())
        b = self.buckets.get(rows)
        if b is None:
            b = self.buckets[rows] = _Bucket(self.dec, rows)
        return b

    def _capture(self, fn) -> torch.cuda.CUDAGraph:
        return capture_graph(fn, self.dec.device, self.pool)[0]

    def project(self, i: int, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`Decoder.project(i, h)`; the outputs are views of static buffers, valid until this bucket's next
        `project` (clone what must live longer)."""
        t = int(h.shape[0])
        b = self._bucket(t)
        if b is None:
            return self.dec.project(i, h)
        g = b.project.get(i)
        if g is None:
            def body(b=b, i=i):
                q, k, v = self.dec.project(i, b.h_in)
                b.q.copy_(q)
                b.k.copy_(k)
                b.v.copy_(v)
            g = b.project[i] = self._capture(body)
        b.h_in[:t].copy_(h)
        g.replay()
        return b.q[:t], b.k[:t], b.v[:t]

    def finish(self, i: int, h: Tensor, attn: Tensor) -> Tensor:
        """`Decoder.finish(i, h, attn)`; the output is a view of a static buffer (see `project`)."""
        t = int(h.shape[0])
        b = self._bucket(t)
        if b is None:
            return self.dec.finish(i, h, attn)
        g = b.finish.get(i)
        if g is None:
            def body(b=b, i=i):
                b.h_out.copy_(self.dec.finish(i, b.h_mid, b.attn))
            g = b.finish[i] = self._capture(body)
        b.h_mid[:t].copy_(h)
        b.attn[:t].copy_(attn)
        g.replay()
        return b.h_out[:t]
