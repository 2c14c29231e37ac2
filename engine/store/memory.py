"""In-memory tier: DocKV tensors on the engine's device, LRU-evicted under a byte budget."""
from __future__ import annotations

from collections import OrderedDict

from .entry import DocKV

__all__ = ["MemoryTier"]


class MemoryTier:
    """LRU map key -> DocKV bounded by `budget_bytes`.

    Args:
        budget_bytes: the most bytes of K/V held; an entry larger than the whole budget is not kept.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("memory budget must be >= 0 bytes")
        self.budget = int(budget_bytes)
        self.used = 0
        self.evictions = 0
        self._items: OrderedDict[str, DocKV] = OrderedDict()

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
        old = self._items.pop(key, None)
        if old is not None:
            self.used -= old.nbytes
        while self.used + size > self.budget and self._items:
            _, victim = self._items.popitem(last=False)
            self.used -= victim.nbytes
            self.evictions += 1
        self._items[key] = kv
        self.used += size
        return True

    def discard(self, key: str) -> None:
        kv = self._items.pop(key, None)
        if kv is not None:
            self.used -= kv.nbytes

    def clear(self) -> None:
        self._items.clear()
        self.used = 0
