"""DocStore: the tiers behind one lookup, and the document-id index.

The id is a handle, the content key is the truth: `lookup(doc_id, key)` serves only an entry stored under
`key`; when the id was last seen with a different key, the document changed and the lookup counts as
stale (and as a miss). Memory is checked first, then disk (promoted to memory on a hit).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from .disk import DiskTier
from .entry import DocKV
from .memory import MemoryTier
from .pool import KVPool

__all__ = ["DocStore", "StoreStats"]


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    stale: int = 0
    disk_hits: int = 0
    corrupt: int = 0
    evictions: int = 0
    memory_bytes: int = 0
    memory_entries: int = 0


class DocStore:
    """Tiered cache of DocKV.

    Args:
        memory_budget_bytes: byte budget of the in-memory tier.
        disk_dir: folder of the disk tier, or None for memory only.
        disk_budget_bytes: size limit of the disk tier.
        device: where served entries live (disk entries are moved there).
        pool: a KVPool holding the in-memory tier (entries become views of pool rows).
        pin: keep in-memory entries in pinned host memory (a host tier feeding a GPU).
    """

    def __init__(self, memory_budget_bytes: int, disk_dir: str | Path | None = None,
                 disk_budget_bytes: int = 20 << 30, device="cpu", pool: KVPool | None = None,
                 pin: bool = False) -> None:
        self.memory = MemoryTier(memory_budget_bytes, pool)
        self.disk = DiskTier(disk_dir, disk_budget_bytes) if disk_dir is not None else None
        self.device = device
        self.pin = pin
        self._ids: dict[str, str] = {}
        self.stats = StoreStats()

    def _known_key(self, doc_id: str) -> str | None:
        key = self._ids.get(doc_id)
        if key is None and self.disk is not None:
            key = self.disk.get_id(doc_id)
        return key

    def lookup(self, doc_id: str | None, key: str) -> DocKV | None:
        """The entry for `key`, or None (a miss). Counts hits, misses and stale ids."""
        if doc_id is not None:
            known = self._known_key(doc_id)
            if known is not None and known != key:
                self.stats.stale += 1
        kv = self.memory.get(key)
        if kv is None and self.disk is not None:
            kv = self.disk.get(key)
            self.stats.corrupt = self.disk.corrupt
            if kv is not None:
                self.stats.disk_hits += 1
                kv = self._admit(key, kv)
        if kv is None:
            self.stats.misses += 1
        else:
            self.touch(key)
            self.stats.hits += 1
            if doc_id is not None:
                self._ids[doc_id] = key
        return kv

    @contextlib.contextmanager
    def hold(self):
        """Within this block, entries looked up or put are never evicted (a request is using them)."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            self.memory.held.clear()

    def touch(self, key: str) -> None:
        """Marks key as used by the running request (see `hold`)."""
        if getattr(self, "_holding", False):
            self.memory.held.add(key)

    def peek(self, key: str) -> bool:
        """Whether `key` is stored in any tier (no accounting, no promotion)."""
        return key in self.memory or (self.disk is not None and key in self.disk)

    def _admit(self, key: str, kv: DocKV) -> DocKV:
        """Puts kv in the memory tier (pinned or pooled as configured); returns the copy to serve."""
        if self.pin:
            kv = DocKV(kv.k.cpu().pin_memory(), kv.v.cpu().pin_memory(), kv.extras)
        elif self.memory.pool is None:
            kv = kv.to(self.device)
        if self.memory.put(key, kv):
            kv = self.memory.get(key)
            self.touch(key)
        return kv if self.memory.pool is None or kv.pool is not None else kv.to(self.device)

    def put(self, doc_id: str | None, key: str, kv: DocKV) -> DocKV:
        """Stores kv in every tier; returns the copy requests should use (a pool view when pooled)."""
        served = self._admit(key, kv)
        if self.disk is not None:
            self.disk.put(key, kv)
        if doc_id is not None:
            self._ids[doc_id] = key
            if self.disk is not None:
                self.disk.set_id(doc_id, key)
        return served

    def snapshot(self) -> StoreStats:
        s = self.stats
        s.evictions = self.memory.evictions
        s.memory_bytes = self.memory.used
        s.memory_entries = len(self.memory)
        return StoreStats(**vars(s))

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
