"""One device-resident KV pool: every hot document's K/V lives in it, addressed by row.

`k` and `v` are `[n_layers, rows, n_kv_heads, head_dim]`. Documents occupy contiguous row ranges handed out
first-fit; a request refers to its documents by row index (no copy) and writes the rows it recomputes into a
reserved scratch region at the end of the pool, which the document allocator never hands out.
"""
from __future__ import annotations

import bisect
import logging

import torch

__all__ = ["KVPool", "RESERVE_SHARE", "check_fits", "fit_rows", "share_rows"]

log = logging.getLogger("kvfuse.engine")

RESERVE_SHARE = 0.05  # of a GPU's memory left free beside a new pool, for the prefills' activations


def _device_memory(device) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device, counting what this process's caching allocator holds unused as free;
    None for any other device (no check there)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(0, int(cached)), int(total)


def check_fits(rows: int, row_bytes: int, device) -> None:
    """Raises torch.OutOfMemoryError, before anything is allocated, when `rows` KV rows of `row_bytes` (K and V over
    every layer) would leave less than RESERVE_SHARE of the device's memory free: a clear message naming what to
    lower, instead of a failed allocation now or at the first long prefill."""
    mem = _device_memory(device)
    if mem is None:
        return
    free, total = mem
    need, room = rows * row_bytes, free - int(RESERVE_SHARE * total)
    if need > room:
        gib = 2 ** 30
        raise torch.OutOfMemoryError(
            f"the KV pool needs {rows} rows x {row_bytes / 2 ** 20:.3f} MiB = {need / gib:.2f} GiB on {device}, but "
            f"{free / gib:.2f} GiB are free there and {RESERVE_SHARE:.0%} of its {total / gib:.1f} GiB stay free for "
            f"prefills: about {max(0, room) // row_bytes} rows fit. Lower EngineConfig.memory_budget_bytes (cached "
            f"documents), decode_tokens (running requests' rows; default twice the context window, at most 65536) or "
            f"scratch_tokens (one prefill's rows; default the context window, at most 32768)")


def fit_rows(doc_rows: int, decode_rows: int, scratch_rows: int, row_bytes: int, device, *, min_rows: int,
             shrink_decode: bool) -> tuple[int, int]:
    """(document rows, decode rows) for a pool on `device`: as asked when they fit beside `scratch_rows` in its free
    memory (RESERVE_SHARE of the card kept free), else shrunk with a warning: first the decode rows, when they are
    the engine's automatic default (`shrink_decode`), down to `min_rows` (one longest request); then the documents'
    rows, down to `min_rows`. What still does not fit is left to `check_fits` (a clear error when the pool is made).
    Not a GPU, or no free-memory reading: unchanged."""
    mem = _device_memory(device)
    if mem is None:
        return doc_rows, decode_rows
    free, total = mem
    room = (free - int(RESERVE_SHARE * total)) // row_bytes
    if doc_rows + decode_rows + scratch_rows <= room:
        return doc_rows, decode_rows
    docs, decode = doc_rows, decode_rows
    if shrink_decode:
        decode = min(decode, max(min_rows, room - docs - scratch_rows))
    if docs + decode + scratch_rows > room:
        docs = min(docs, max(min_rows, room - decode - scratch_rows))
    gib = row_bytes / 2 ** 30
    log.warning("the KV pool asked for (%d document rows, %d decode rows, %d scratch rows: %.2f GiB) does not fit the "
                "%.2f GiB free on %s with %.0f%% of it kept for prefills; using %d document rows (%.2f GiB) and %d "
                "decode rows (%.2f GiB). Set EngineConfig.memory_budget_bytes and decode_tokens to choose.",
                doc_rows, decode_rows, scratch_rows, (doc_rows + decode_rows + scratch_rows) * gib, free / 2 ** 30,
                device, 100 * RESERVE_SHARE, docs, docs * gib, decode, decode * gib)
    return docs, decode


def share_rows(share: float, row_bytes: int, device, other_rows: int) -> int | None:
    """Document rows that bring the whole device's use to `share` of its memory once a pool of those rows and
    `other_rows` (decode, scratch) is made (vLLM's gpu_memory_utilization: what anything holds now, this process's
    weights and other processes' alike, counts against the share). 0 when the share is already used; None when
    `device` is not a GPU (or gives no reading)."""
    mem = _device_memory(device)
    if mem is None:
        return None
    free, total = mem
    room = int(share * total) - (total - free)
    return max(0, room // row_bytes - other_rows)


class KVPool:
    """Row allocator over two preallocated tensors.

    Args:
        n_layers, n_kv_heads, head_dim: the model's KV shape.
        doc_rows: rows available to documents.
        scratch_rows: rows reserved for one request's recomputed tokens (requests are serialised).
        dtype, device: storage.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, doc_rows: int, scratch_rows: int,
                 dtype: torch.dtype, device) -> None:
        if doc_rows <= 0 or scratch_rows <= 0:
            raise ValueError("a KV pool needs doc_rows > 0 and scratch_rows > 0")
        shape = (n_layers, doc_rows + scratch_rows, n_kv_heads, head_dim)
        check_fits(doc_rows + scratch_rows, 2 * n_layers * n_kv_heads * head_dim * dtype.itemsize, device)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.doc_rows = doc_rows
        self.scratch_start = doc_rows
        self.scratch_rows = scratch_rows
        self._free: list[tuple[int, int]] = [(0, doc_rows)]  # sorted (start, length)

    @property
    def row_bytes(self) -> int:
        return self.k[:, 0].numel() * self.k.element_size() * 2

    @property
    def free_rows(self) -> int:
        return sum(n for _, n in self._free)

    def alloc(self, n: int) -> int | None:
        """Start row of a free contiguous range of n rows, or None when none is large enough."""
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    self._free.pop(i)
                else:
                    self._free[i] = (start + n, length - n)
                return start
        return None

    def alloc_scattered(self, n: int) -> list[tuple[int, int]]:
        """n free rows as ranges (start, rows), lowest first, taken from the free list in order."""
        if n > self.free_rows:
            raise ValueError(f"{n} rows asked, {self.free_rows} free")
        out = []
        while n > 0:
            start, length = self._free[0]
            take = min(n, length)
            if take == length:
                self._free.pop(0)
            else:
                self._free[0] = (start + take, length - take)
            out.append((start, take))
            n -= take
        return out

    def free(self, start: int, n: int) -> None:
        """Returns rows [start, start + n) to the allocator, merging neighbours."""
        i = bisect.bisect_left(self._free, (start, 0))
        self._free.insert(i, (start, n))
        merged: list[tuple[int, int]] = []
        for s, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((s, length))
        self._free = merged
