"""DocStore: the tiers behind one lookup, and the document-id index.

The id is a handle, the content key is the truth: `lookup(doc_id, key)` serves only an entry stored under
`key`; when the id was last seen with a different key, the document changed and the lookup counts as
stale (and as a miss). Memory is checked first, then disk (promoted to memory on a hit).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .disk import DiskTier
from .entry import DocKV
from .memory import MemoryTier

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
    """

    def __init__(self, memory_budget_bytes: int, disk_dir: str | Path | None = None,
                 disk_budget_bytes: int = 20 << 30, device="cpu") -> None:
        self.memory = MemoryTier(memory_budget_bytes)
        self.disk = DiskTier(disk_dir, disk_budget_bytes) if disk_dir is not None else None
        self.device = device
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
                kv = kv.to(self.device)
                self.stats.disk_hits += 1
                self.memory.put(key, kv)
        if kv is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
            if doc_id is not None:
                self._ids[doc_id] = key
        return kv

    def peek(self, key: str) -> bool:
        """Whether `key` is stored in any tier (no accounting, no promotion)."""
        return key in self.memory or (self.disk is not None and key in self.disk)

    def put(self, doc_id: str | None, key: str, kv: DocKV) -> None:
        self.memory.put(key, kv)
        if self.disk is not None:
            self.disk.put(key, kv)
        if doc_id is not None:
            self._ids[doc_id] = key
            if self.disk is not None:
                self.disk.set_id(doc_id, key)

    def snapshot(self) -> StoreStats:
        s = self.stats
        s.evictions = self.memory.evictions
        s.memory_bytes = self.memory.used
        s.memory_entries = len(self.memory)
        return StoreStats(**vars(s))

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
