"""In-memory tier: DocKV tensors on the engine's device, LRU-evicted under a byte budget.

With a KVPool (the GPU tier), entries are copied into pool rows and served as views of the pool, so a request
refers to them by row without a copy; the budget is then the pool itself.
"""
from __future__ import annotations

from collections import OrderedDict

from .entry import DocKV
from .pool import KVPool

__all__ = ["MemoryTier"]


class MemoryTier:
    """LRU map key -> DocKV bounded by `budget_bytes`.

    Args:
        budget_bytes: the most bytes of K/V held; an entry larger than the whole budget is not kept.
    """

    def __init__(self, budget_bytes: int, pool: KVPool | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError("memory budget must be >= 0 bytes")
        self.pool = pool
        self.budget = int(budget_bytes) if pool is None else min(int(budget_bytes), pool.doc_rows * pool.row_bytes)
        self.used = 0
        self.evictions = 0
        self._items: OrderedDict[str, DocKV] = OrderedDict()
        self.held: set[str] = set()  # keys in use by the request being prepared: never evicted
        self.pins: dict[str, int] = {}  # keys read in place by decoding requests (reference counts): never evicted
        self._zombies: dict[str, list[DocKV]] = {}  # replaced or dropped while pinned: rows freed at the last unpin

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        return list(self._items)

    def get(self, key: str) -> DocKV | None:
        kv = self._items.get(key)
        if kv is not None:
            self._items.move_to_end(key)
        return kv

    def put(self, key: str, kv: DocKV) -> bool:
        """Stores kv, evicting least recently used entries to fit. Returns False if it can never fit."""
        size = kv.nbytes
        if size > self.budget:
            return False
        self.discard(key)
        while self.used + size > self.budget:
            if not self._evict_lru():
                return False
        if self.pool is not None:
            start = self.pool.alloc(kv.length)
            while start is None:  # fragmented: free more until a range fits
                if not self._evict_lru():
                    return False
                start = self.pool.alloc(kv.length)
            end = start + kv.length
            self.pool.k[:, start:end].copy_(kv.k, non_blocking=True)
            self.pool.v[:, start:end].copy_(kv.v, non_blocking=True)
            kv = DocKV(self.pool.k[:, start:end], self.pool.v[:, start:end],
                       {n: t.cpu() for n, t in kv.extras.items()}, self.pool, start)  # extras: host side
        self._items[key] = kv
        self.used += size
        return True

    def _evict_lru(self) -> bool:
        """Evicts the least recently used entry not held; False when there is none."""
        for key in self._items:
            if key not in self.held and key not in self.pins:
                self._release(self._items.pop(key))
                self.evictions += 1
                return True
        return False

    def _release(self, kv: DocKV) -> None:
        self.used -= kv.nbytes
        if kv.pool is not None:
            kv.pool.free(kv.offset, kv.length)

    def discard(self, key: str) -> None:
        kv = self._items.pop(key, None)
        if kv is None:
            return
        if key in self.pins:  # a decoding request still reads these rows
            self.used -= kv.nbytes
            self._zombies.setdefault(key, []).append(kv)
        else:
            self._release(kv)

    def pin(self, keys) -> None:
        """Marks entries as read in place by a running request: never evicted, rows never reused."""
        for key in keys:
            self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, keys) -> None:
        for key in keys:
            left = self.pins.get(key, 0) - 1
            if left > 0:
                self.pins[key] = left
                continue
            self.pins.pop(key, None)
            for kv in self._zombies.pop(key, []):
                if kv.pool is not None:
                    kv.pool.free(kv.offset, kv.length)

    def clear(self) -> None:
        for key in list(self._items):
            self.discard(key)
