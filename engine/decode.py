"""Decoding many sequences at once over one arena of K/V rows.

Every sequence's keys live in one arena (`[n_layers, rows, kv_heads, head_dim]`, keys BEFORE RoPE): on the GPU
it is the document pool itself, so a cached document's rows are read in place by every sequence that uses it, at
that sequence's own positions (deferred RoPE in the attention kernel); only the rows a request computed (its
recomputed document tokens, glue, question) and its answer get private rows (a slab). A sequence is a row map:
position -> arena row. One decode step function (`Decoding.step_fn`) runs a batch of sequences, one new token
each; the CUDA-graph path captures that same function per (batch bucket, capacity bucket), with tokens,
positions and row maps as data in static buffers, so any batch of any lengths replays a graph.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..kernels.attention import fused_attention
from ..kernels.decode_attention import decode_attention
from ..kernels.rope import apply_rope
from .cudagraph import capture_graph
from .sources import PooledSource, PoolRows
from .store.pool import KVPool, fit_rows

__all__ = ["Arena", "Slab", "Sequence", "Decoding", "BATCH_BUCKETS", "decode_rows", "request_rows", "sized_rows"]

_UIDS = itertools.count()
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def request_rows(context_window: int) -> int:
    """Rows of the longest request a pool serves: the context window, capped at 32768 (the default scratch rows)."""
    return min(context_window, 32768)


def decode_rows(config, context_window: int) -> int:
    """Rows kept for running requests' prompts and answers: `config.decode_tokens`, by default two of the longest
    (twice the context window, capped at 2 x 32768)."""
    return config.decode_tokens or 2 * request_rows(context_window)


def sized_rows(config, context_window: int, doc_rows: int, scratch_rows: int, row_bytes: int,
               device) -> tuple[int, int]:
    """(document rows, decode rows) of a pool on `device`, fitted to its free memory (`store.pool.fit_rows`: the
    automatic decode rows shrink first, then the documents', each to one longest request)."""
    return fit_rows(doc_rows, decode_rows(config, context_window), scratch_rows, row_bytes, device,
                    min_rows=request_rows(context_window), shrink_decode=not config.decode_tokens)


@dataclass(frozen=True)
class Slab:
    """Arena rows held by one sequence: ranges (start, rows), in order. One range when the arena has a free range
    that long; otherwise several, so a long prompt needs no contiguous hole among the documents' rows."""

    ranges: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(n for _, n in self.ranges)

    def rows(self, device) -> Tensor:
        """[size] the rows, in order."""
        if not self.ranges:
            return torch.empty(0, dtype=torch.long, device=device)
        return torch.cat([torch.arange(a, a + n, device=device) for a, n in self.ranges])

    def split(self, k: int) -> tuple[Slab, Slab]:
        """(its first k rows, the rest)."""
        head, tail, left = [], [], k
        for a, n in self.ranges:
            if left >= n:
                head.append((a, n))
            elif left > 0:
                head.append((a, left))
                tail.append((a + left, n - left))
            else:
                tail.append((a, n))
            left -= min(left, n)
        return Slab(tuple(head)), Slab(tuple(tail))


class Arena:
    """The rows sequences decode into: a KVPool plus a zeroed dummy row (padding of row maps and batches).

    Args:
        pool: the document pool (GPU tier: documents are shared in place) or a pool of its own (host tier).
        evict: called when no free range is large enough; frees some rows (e.g. the least recently used unpinned
            document) and returns False when nothing more can be freed.
    """

    def __init__(self, pool: KVPool, evict=None) -> None:
        self.pool = pool
        self._evict = evict
        self.dummy = pool.alloc(1)
        if self.dummy is None:
            raise RuntimeError("the KV arena has no free row")
        pool.k[:, self.dummy].zero_()
        pool.v[:, self.dummy].zero_()

    def alloc(self, n: int) -> Slab | None:
        """n free rows: one range when there is one that long, else the free ranges needed (first first); evicts
        unpinned documents only while fewer than n rows are free in all. None when they can't be found."""
        start = self.pool.alloc(n)
        if start is not None:
            return Slab(((start, n),))
        while self.pool.free_rows < n:
            if self._evict is None or not self._evict():
                return None
            start = self.pool.alloc(n)
            if start is not None:
                return Slab(((start, n),))
        return Slab(tuple(self.pool.alloc_scattered(n)))

    def free(self, slab: Slab) -> None:
        for start, n in slab.ranges:
            if n > 0:
                self.pool.free(start, n)


@dataclass
class Sequence:
    """One request's decode view: `row_map[p]` is the arena row of position p (prompt and answer, fixed at
    creation); rows >= `length` are not yet written.

    Attributes:
        row_map: [capacity] int64 on the device.
        length: positions written.
        prompt_len: the prompt's length (answer positions follow).
        slab: the private rows this sequence owns in the arena.
    """

    row_map: Tensor
    length: int
    prompt_len: int
    slab: Slab
    shared_rows: int = 0  # prompt positions read in place from document rows
    uid: int = field(default_factory=lambda: next(_UIDS))

    @property
    def capacity(self) -> int:
        return int(self.row_map.numel())


class Decoding:
    """Opens sequences from prefills and runs decode steps over batches of them.

    Args:
        runner: the Runner (model seam, RoPE tables).
        arena: where sequences live.
        cuda_graphs: replay decode steps from CUDA graphs (CUDA only).
    """

    def __init__(self, runner, arena: Arena, cuda_graphs: bool) -> None:
        self.runner = runner
        self.arena = arena
        self.graphs = _StepGraphs(self) if cuda_graphs and runner.dec.device.type == "cuda" else None
        self._batch_key = None
        self._batch_rows: Tensor | None = None

    # -- opening a sequence --------------------------------------------------------------------------------
    @torch.inference_mode()
    def open(self, pending, slab: Slab, reserve: int) -> Sequence:
        """Writes a prefill's prompt K/V into the arena and returns its sequence.

        Args:
            pending: a PrefillOutput's `pending` (source, per-layer fresh rows, n).
            slab: the `n + reserve` arena rows reserved for this sequence (`Arena.alloc`; the part not needed, the
                prompt rows read in place from documents, is given back).
            reserve: answer rows.
        """
        src, fresh, n = pending
        pool = self.arena.pool
        dev = pool.k.device
        recomputed = torch.zeros(n, dtype=torch.bool, device=dev)
        for pos, _, _ in fresh:
            recomputed[pos.to(dev)] = True
        if isinstance(src, PooledSource) and src.pool is pool:  # documents in the arena: read them in place
            shared = (src.base_rows.to(dev) < pool.scratch_start) & ~recomputed
        else:
            shared = torch.zeros(n, dtype=torch.bool, device=dev)
        private = torch.nonzero(~shared).squeeze(1)                       # [P] positions (one host sync)
        p = int(private.numel())
        mine, spare = slab.split(p + reserve)
        held = mine.rows(dev)                                              # [p + reserve] prompt rows, then answer's
        rows = held[:p]
        row_map = torch.empty(n + reserve, dtype=torch.long, device=dev)
        if bool(shared.any()):
            row_map[:n] = src.base_rows.to(dev)
        row_map[private] = rows
        row_map[n:] = held[p:]
        where = torch.full((n,), -1, dtype=torch.long, device=dev)
        where[private] = torch.arange(p, device=dev)                     # position -> index among the private rows
        pooled = isinstance(src, PooledSource)
        base_private = src.base_rows.to(dev)[private] if pooled else None  # their cached rows, once for all layers
        for i, (pos, k, v) in enumerate(fresh):
            pos = pos.to(dev)
            if isinstance(k, PoolRows):  # the prefill's rows still in the pool: read them before they are reused
                k, v = k.take(i)
            if pooled:
                ck = pool.k[i].index_select(0, base_private)
                cv = pool.v[i].index_select(0, base_private)
            else:
                full_k, full_v = src.cached_layer(i)
                ck, cv = full_k[private], full_v[private]
            dst = where[pos]
            ck[dst], cv[dst] = k, v  # rows computed at this layer override the cached ones
            pool.k[i].index_copy_(0, rows, ck)
            pool.v[i].index_copy_(0, rows, cv)
        self.arena.free(spare)
        return Sequence(row_map=row_map, length=n, prompt_len=n, slab=mine, shared_rows=n - p)

    def close(self, seq: Sequence) -> None:
        """Gives the sequence's private rows back to the arena."""
        self.arena.free(seq.slab)
        seq.slab = Slab(())

    # -- one decode step for a batch ------------------------------------------------------------------------
    def step_fn(self, tokens: Tensor, pos: Tensor, row_map: Tensor) -> Tensor:
        """THE decode step (eager, and captured by the graph path): B sequences, one new token each.

        Args:
            tokens: [B] token ids; pos: [B] their positions; row_map: [B, C] arena rows of positions 0..C-1
                (the new token's row is `row_map[b, pos[b]]`).
        Returns:
            [B, vocab] float32 logits.
        """
        r = self.runner
        dec, spec = r.dec, r.spec
        pool = self.arena.pool
        write = row_map.gather(1, pos[:, None])[:, 0]                    # [B] rows of the new tokens
        c, s = r._cos.index_select(0, pos), r._sin.index_select(0, pos)
        h = dec.embed_tokens(tokens)
        for i in range(spec.n_layers):
            q, k, v = dec.project(i, h)
            pool.k[i].index_copy_(0, write, k)
            pool.v[i].index_copy_(0, write, v)
            o = decode_attention(apply_rope(q, c, s), pos, pool.k[i], pool.v[i], row_map, r._cos, r._sin,
                                 spec.scale)
            h = dec.finish(i, h, o)
        return dec.logits(h).float()

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], tokens: list[int]) -> Tensor:
        """Appends one token to each sequence; returns [B, vocab] float32 logits (row b: sequence b)."""
        dev = self.arena.pool.k.device
        for sq in seqs:
            if sq.length >= sq.capacity:
                raise RuntimeError(f"decode cache full ({sq.capacity} rows)")
        cap = max(sq.capacity for sq in seqs)
        self.runner.rope(cap)
        if self.graphs is not None:
            logits = self.graphs.step(seqs, tokens, cap)
        else:
            ids = torch.tensor(tokens, dtype=torch.long, device=dev)
            pos = torch.tensor([sq.length for sq in seqs], dtype=torch.long, device=dev)
            logits = self.step_fn(ids, pos, self.batch_rows(seqs, cap))
        for sq in seqs:
            sq.length += 1
        return logits

    def batch_rows(self, seqs: list[Sequence], width: int) -> Tensor:
        """[B, width] row maps of a batch (padding: the dummy row); kept while the batch does not change."""
        key = (tuple(sq.uid for sq in seqs), width)
        if key != self._batch_key:
            rows = torch.full((len(seqs), width), self.arena.dummy, dtype=torch.long, device=self.arena.pool.k.device)
            for b, sq in enumerate(seqs):
                rows[b, :sq.capacity] = sq.row_map
            self._batch_key, self._batch_rows = key, rows
        return self._batch_rows

    # -- several tokens of one sequence (teacher forcing, re-scoring) --------------------------------------------
    @torch.inference_mode()
    def extend(self, seq: Sequence, ids: Tensor) -> Tensor:
        """Appends T tokens to one sequence; returns [T, vocab] float32 logits. One token is a decode step."""
        t = int(ids.numel())
        if t == 1:
            return self.step([seq], [int(ids.view(-1)[0])])
        r = self.runner
        dec, spec = r.dec, r.spec
        pool = self.arena.pool
        dev = pool.k.device
        p = seq.length
        if p + t > seq.capacity:
            raise RuntimeError(f"decode cache full ({seq.capacity} rows)")
        cos, sin = r.rope(p + t)
        pos = torch.arange(p, p + t, device=dev)
        rows = seq.row_map[p:p + t]
        kv_rows = seq.row_map[:p + t]  # position j is the sequence's j-th row (kv_pos None below)
        c, s = cos[p:p + t], sin[p:p + t]
        h = dec.embed_tokens(ids.to(dev))
        for i in range(spec.n_layers):
            q, k, v = dec.project(i, h)
            pool.k[i].index_copy_(0, rows, k)
            pool.v[i].index_copy_(0, rows, v)
            o = fused_attention(apply_rope(q, c, s), pos, pool.k[i], pool.v[i], kv_rows, None, cos, sin,
                                spec.scale)
            h = dec.finish(i, h, o)
        seq.length = p + t
        return dec.logits(h).float()

    def keys(self, seq: Sequence, layer: int) -> Tensor:
        """[length, kv_heads, head_dim] keys of positions 0..length-1 of one layer, rotated (for tests)."""
        n = seq.length
        cos, sin = self.runner.rope(n)
        k = self.arena.pool.k[layer].index_select(0, seq.row_map[:n])
        return apply_rope(k, cos[:n], sin[:n])


def bucket(b: int) -> int:
    """The batch bucket a batch of b sequences is padded to."""
    for size in BATCH_BUCKETS:
        if size >= b:
            return size
    return b


class _StepGraphs:
    """CUDA graphs of `Decoding.step_fn`, one per (batch bucket, capacity bucket): tokens, positions and row maps
    are copied into static buffers, padding slots decode a dummy token into the dummy row."""

    def __init__(self, decoding: Decoding, max_graphs: int = 16) -> None:
        self.d = decoding
        self.max_graphs = max_graphs
        self.entries: dict = {}

    def step(self, seqs: list[Sequence], tokens: list[int], cap: int) -> Tensor:
        d = self.d
        dev = d.arena.pool.k.device
        b, bb = len(seqs), bucket(len(seqs))
        width = max(256, 1 << (cap - 1).bit_length())
        d.runner.rope(width)
        key = (bb, width)
        entry = self.entries.get(key)
        if entry is None:
            ids = torch.zeros(bb, dtype=torch.long, device=dev)
            pos = torch.zeros(bb, dtype=torch.long, device=dev)
            rows = torch.full((bb, width), d.arena.dummy, dtype=torch.long, device=dev)
            graph, logits = capture_graph(lambda: d.step_fn(ids, pos, rows), dev)  # writes only the dummy row
            if len(self.entries) >= self.max_graphs:
                self.entries.pop(next(iter(self.entries)))
            entry = self.entries[key] = (graph, ids, pos, rows, logits, (d.runner._cos, d.runner._sin))
        else:
            self.entries[key] = self.entries.pop(key)
        graph, ids, pos, rows, logits, _ = entry
        host = torch.zeros((2, bb), dtype=torch.long)
        host[0, :b] = torch.tensor(tokens, dtype=torch.long)
        host[1, :b] = torch.tensor([sq.length for sq in seqs], dtype=torch.long)
        ids.copy_(host[0], non_blocking=True)
        pos.copy_(host[1], non_blocking=True)
        self._rows(seqs, rows)
        graph.replay()
        return logits[:b].clone()

    def _rows(self, seqs: list[Sequence], rows: Tensor) -> None:
        key = (tuple(sq.uid for sq in seqs), rows.data_ptr())
        if getattr(self, "_key", None) != key:
            rows.fill_(self.d.arena.dummy)
            for b, sq in enumerate(seqs):
                rows[b, :sq.capacity] = sq.row_map
            self._key = key
