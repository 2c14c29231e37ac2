"""Where a request's cached K/V rows come from during a fused prefill, one layer at a time.

Two sources, one interface (`layer(i) -> (k_i, v_i)` pools of rows, plus `base_rows`/`scratch_rows`):

- PooledSource: every cached segment already lives in the device KVPool. Nothing is copied: prompt position p
  reads pool row `base_rows[p]`; recomputed rows are written to the pool's scratch region (`scratch_rows[p]`),
  so the shared document rows are never modified.
- AssembledSource: segments are standalone tensors (the CPU tier, or a pinned host tier feeding a GPU). Each
  layer is assembled into a private `[N, kv_heads, head_dim]` buffer, position p at row p; recomputed rows
  overwrite their own row. When the segments sit on the host and the compute on a GPU, layer i+1 is copied
  on a side stream while layer i computes (double buffering).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .store.entry import DocKV
from .store.pool import KVPool

__all__ = ["PooledSource", "AssembledSource", "PoolRows", "make_source", "pool_rows"]


def pool_rows(cached, n: int, pool: KVPool) -> Tensor:
    """Pool row of every prompt position: cached spans [(start, end, DocKV)] read their document's rows, every
    other (computed) position its own scratch row. Built on the host."""
    base = torch.arange(pool.scratch_start, pool.scratch_start + n)
    for start, end, kv in cached:
        base[start:end] = torch.arange(kv.offset, kv.offset + (end - start))
    return base


class _NoPrefetch:
    def prefetch(self, i: int, n_layers: int) -> None:
        pass


class PoolRows:
    """Fresh K/V a prefill left in a pool's rows (a bucketed prefill's scratch rows), read when a sequence opens.

    A pending entry `(positions, PoolRows, None)` stands for `(positions, k, v)` with k/v the layer's rows `rows`
    of `pool`: the prefill keeps no copy of its own (a captured graph then holds no per-layer outputs), and the
    gather runs in `Decoding.open`, after the first token.
    """

    __slots__ = ("pool", "rows")

    def __init__(self, pool: KVPool, rows: Tensor) -> None:
        self.pool, self.rows = pool, rows

    def take(self, i: int) -> tuple[Tensor, Tensor]:
        """Layer i's (k, v) of the rows."""
        return self.pool.k[i].index_select(0, self.rows), self.pool.v[i].index_select(0, self.rows)


class PooledSource(_NoPrefetch):
    """Zero-copy view of cached segments resident in one KVPool.

    Args:
        pool: the pool every cached segment lives in.
        segments: [(start, end, DocKV | None)] covering [0, N).
        n: prompt length.
        device: compute device.
    """
    identity = False  # prompt position p is not pool row p

    def __init__(self, pool: KVPool, segments, n: int, device) -> None:
        self.pool = pool
        if n > pool.scratch_rows:
            raise RuntimeError(f"prompt of {n} tokens exceeds the pool's scratch region ({pool.scratch_rows})")
        scratch = torch.arange(pool.scratch_start, pool.scratch_start + n)
        self.scratch_rows = scratch.to(device)
        self.base_rows = pool_rows([(s, e, kv) for s, e, kv in segments if kv is not None], n, pool).to(device)

    @classmethod
    def from_rows(cls, pool: KVPool, base_rows: Tensor, scratch_rows: Tensor) -> PooledSource:
        """A source over rows already on the device (the static inputs of a CUDA graph)."""
        src = cls.__new__(cls)
        src.pool, src.base_rows, src.scratch_rows = pool, base_rows, scratch_rows
        return src

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return self.pool.k[i], self.pool.v[i]

    def done_with(self, i: int) -> None:
        pass

    def cached_layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Rows of layer i in prompt order (cached values; computed rows hold whatever scratch holds)."""
        return self.pool.k[i].index_select(0, self.base_rows), self.pool.v[i].index_select(0, self.base_rows)


class AssembledSource:
    """Per-layer private buffers assembled from standalone segment tensors.

    Args:
        segments: [(start, end, DocKV | None)] covering [0, N).
        n: prompt length.
        shape: (n_kv_heads, head_dim); dtype/device of the compute.
    """
    identity = True  # prompt position p is buffer row p

    def __init__(self, segments, n: int, shape: tuple[int, int], dtype: torch.dtype, device) -> None:
        self.segments = [(s, e, kv) for s, e, kv in segments if kv is not None]
        self.n = n
        self.device = torch.device(device)
        self.base_rows = torch.arange(n, device=self.device)
        self.scratch_rows = self.base_rows
        host = any(kv.k.device.type == "cpu" for _, _, kv in self.segments)
        self.streamed = self.device.type == "cuda" and host
        n_buf = 2 if self.streamed else 1
        self._k = [torch.empty((n, *shape), dtype=dtype, device=self.device) for _ in range(n_buf)]
        self._v = [torch.empty((n, *shape), dtype=dtype, device=self.device) for _ in range(n_buf)]
        if self.streamed:
            self._stream = torch.cuda.Stream(self.device)
            self._ready = [torch.cuda.Event() for _ in range(n_buf)]
            self._free = [torch.cuda.Event() for _ in range(n_buf)]
            self._issued = -1
            self._issue(0)

    def _fill(self, i: int, slot: int) -> None:
        k, v = self._k[slot], self._v[slot]
        for s, e, kv in self.segments:
            k[s:e].copy_(kv.k[i], non_blocking=True)
            v[s:e].copy_(kv.v[i], non_blocking=True)

    def _issue(self, i: int) -> None:
        slot = i % 2
        with torch.cuda.stream(self._stream):
            if i >= 2:
                self._stream.wait_event(self._free[slot])
            self._fill(i, slot)
            self._ready[slot].record(self._stream)
        self._issued = i

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        if not self.streamed:
            self._fill(i, 0)
            return self._k[0], self._v[0]
        slot = i % 2
        torch.cuda.current_stream(self.device).wait_event(self._ready[slot])
        return self._k[slot], self._v[slot]

    def done_with(self, i: int) -> None:
        """Layer i's buffer may be reused once the compute stream is past this point; prefetch i + 2."""
        if self.streamed:
            self._free[i % 2].record(torch.cuda.current_stream(self.device))

    def prefetch(self, i: int, n_layers: int) -> None:
        if self.streamed and i < n_layers and i > self._issued:
            self._issue(i)

    def cached_layer(self, i: int) -> tuple[Tensor, Tensor]:
        k = torch.empty_like(self._k[0])
        v = torch.empty_like(self._v[0])
        for s, e, kv in self.segments:
            k[s:e].copy_(kv.k[i], non_blocking=True)
            v[s:e].copy_(kv.v[i], non_blocking=True)
        return k, v


def make_source(segments, n: int, shape: tuple[int, int], dtype: torch.dtype, device):
    """PooledSource when every cached segment is a view of one pool on `device`, else AssembledSource."""
    kvs: list[DocKV] = [kv for _, _, kv in segments if kv is not None]
    pools = {id(kv.pool) for kv in kvs}
    same_device = bool(kvs) and kvs[0].k.device.type == torch.device(device).type
    if kvs and len(pools) == 1 and kvs[0].pool is not None and same_device and n <= kvs[0].pool.scratch_rows:
        return PooledSource(kvs[0].pool, segments, n, device)
    return AssembledSource(segments, n, shape, dtype, device)
