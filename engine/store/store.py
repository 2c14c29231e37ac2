"""DocStore: the tiers behind one lookup, and the document-id index.

The id is a handle, the content key is the truth: `lookup(doc_id, key)` serves only an entry stored under
`key`; when the id was last seen with a different key, the document changed and the lookup counts as
stale (and as a miss). Memory is checked first, then the local disk, then the shared Redis tier; a hit fills the
nearer tiers on its way back (a disk hit goes to memory, a Redis hit to memory and disk). Puts go to every tier.

The id index in memory is an LRU bounded by `id_index_bytes` (ids are handles, not data: forgetting one only
forgets that its next content change is counted as stale); on disk it is scoped by `id_scope`.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .disk import DiskTier
from .entry import DocKV, encode_entry
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
    disk_errors: int = 0  # disk-tier operations that failed on the folder (served from memory / recomputed)
    disk_degraded: int = 0  # 1 while the disk tier is paused after such a failure (or could not be opened)
    id_index_bytes: int = 0  # approximate bytes of the in-memory document-id index
    redis_hits: int = 0  # lookups served from the shared Redis tier
    redis_errors: int = 0  # Redis operations that failed or timed out (served from local tiers / recomputed)
    redis_degraded: int = 0  # 1 while the Redis tier is paused after such a failure


class DocStore:
    """Tiered cache of DocKV.

    Args:
        memory_budget_bytes: byte budget of the in-memory tier.
        disk_dir: folder of the disk tier, or None for memory only.
        disk_budget_bytes: size limit of the disk tier.
        device: where served entries live (disk entries are moved there).
        pool: a KVPool holding the in-memory tier (entries become views of pool rows).
        pin: keep in-memory entries in pinned host memory (a host tier feeding a GPU).
        id_scope: namespaces document-id rows on disk (model, tokenizer, dtype and prompt prefix).
        id_index_bytes: bound of the in-memory document-id index.
        disk_retry_s: how long a failed disk tier is left alone before it is tried again.
        validate: `validate(kv, length)` raises CorruptEntry for an entry read from disk that the model can't
            use (wrong layer/head shape, dtype, length or extras), which is then dropped and recomputed.
        disk_secret: signs disk entries (HMAC) and serves only entries signed with it.
        remote: a shared tier behind the disk (a RedisTier, made with the same secret), or None.
    """

    _ID_OVERHEAD = 200  # bytes per id index entry besides the id itself (dict slot, two str objects)

    def __init__(self, memory_budget_bytes: int, disk_dir: str | Path | None = None,
                 disk_budget_bytes: int = 20 << 30, device="cpu", pool: KVPool | None = None,
                 pin: bool = False, id_scope: str = "", id_index_bytes: int = 16 << 20,
                 disk_retry_s: float = 60.0, validate: Callable[[DocKV, int | None], None] | None = None,
                 disk_secret: bytes | None = None, remote=None) -> None:
        self.memory = MemoryTier(memory_budget_bytes, pool)
        self.disk = (DiskTier(disk_dir, disk_budget_bytes, id_scope=id_scope, retry_s=disk_retry_s,
                              secret=disk_secret)
                     if disk_dir is not None else None)
        self.remote = remote
        self.secret = disk_secret or None
        self.device = device
        self.pin = pin
        self._ids: OrderedDict[str, str] = OrderedDict()
        self._ids_bytes = 0
        self.id_index_budget = int(id_index_bytes)
        self.stats = StoreStats()
        self.validate = validate

    def _remember(self, doc_id: str, key: str) -> None:
        """Records doc_id -> key in the bounded in-memory index (least recently used ids are forgotten)."""
        old = self._ids.pop(doc_id, None)
        if old is not None:
            self._ids_bytes -= len(doc_id) + self._ID_OVERHEAD
        cost = len(doc_id) + self._ID_OVERHEAD
        if cost > self.id_index_budget:
            return
        while self._ids and self._ids_bytes + cost > self.id_index_budget:
            gone, _ = self._ids.popitem(last=False)
            self._ids_bytes -= len(gone) + self._ID_OVERHEAD
        self._ids[doc_id] = key
        self._ids_bytes += cost

    def _known_key(self, doc_id: str) -> str | None:
        key = self._ids.get(doc_id)
        if key is not None:
            self._ids.move_to_end(doc_id)
        if key is None and self.disk is not None:
            key = self.disk.get_id(doc_id)
        if key is None and self.remote is not None:
            key = self.remote.get_id(doc_id)
        return key

    def lookup(self, doc_id: str | None, key: str, length: int | None = None) -> DocKV | None:
        """The entry for `key`, or None (a miss). Counts hits, misses and stale ids.

        `length`: the document's token count when known; entries read from disk are checked against it (and
        the model's shape) by `validate`."""
        if doc_id is not None:
            known = self._known_key(doc_id)
            if known is not None and known != key:
                self.stats.stale += 1
        kv = self.memory.get(key)
        check = None if self.validate is None else (lambda e: self.validate(e, length))
        if kv is None and self.disk is not None:
            kv = self.disk.get(key, check)
            if kv is not None:
                self.stats.disk_hits += 1
                kv = self._admit(key, kv)
        if kv is None and self.remote is not None:
            got = self.remote.get_entry(key, check)
            if got is not None:
                kv, blob = got
                self.stats.redis_hits += 1
                if self.disk is not None:
                    self.disk.put(key, kv, blob=blob)  # verified bytes, signed with the same secret
                kv = self._admit(key, kv)
        self.stats.corrupt = self._corrupt()
        if kv is None:
            self.stats.misses += 1
        else:
            self.touch(key)
            self.stats.hits += 1
            if doc_id is not None:
                self._remember(doc_id, key)
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

    def _corrupt(self) -> int:
        return (self.disk.corrupt if self.disk is not None else 0) + (
            self.remote.corrupt if self.remote is not None else 0)

    def peek(self, key: str) -> bool:
        """Whether `key` is stored in any tier (no accounting, no promotion)."""
        return (key in self.memory or (self.disk is not None and key in self.disk)
                or (self.remote is not None and key in self.remote))

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
        blob = encode_entry(key, kv, self.secret) if self.disk is not None or self.remote is not None else None
        if self.disk is not None:
            self.disk.put(key, kv, blob=blob)
        if self.remote is not None:
            self.remote.put(key, kv, blob=blob if self.remote.secret == self.secret else None)
        if doc_id is not None:
            self._remember(doc_id, key)
            if self.disk is not None:
                self.disk.set_id(doc_id, key)
            if self.remote is not None:
                self.remote.set_id(doc_id, key)
        return served

    def forget(self, doc_id: str) -> bool:
        """Drops the cache of the content last stored under `doc_id` from every tier, and the id itself. Entries
        held by a running request stay until it ends. Returns whether the id was known."""
        key = self._known_key(doc_id)
        if doc_id in self._ids:
            self._ids_bytes -= len(doc_id) + self._ID_OVERHEAD
            del self._ids[doc_id]
        if self.disk is not None:
            self.disk.forget(doc_id, key)
        if self.remote is not None:
            self.remote.forget(doc_id, key)
        if key is None:
            return False
        if key not in self.memory.held:
            self.memory.discard(key)
        return True

    def snapshot(self) -> StoreStats:
        s = self.stats
        s.evictions = self.memory.evictions
        s.memory_bytes = self.memory.used
        s.memory_entries = len(self.memory)
        s.id_index_bytes = self._ids_bytes
        s.corrupt = self._corrupt()
        if self.disk is not None:
            s.disk_errors, s.disk_degraded = self.disk.errors, int(self.disk.degraded)
        if self.remote is not None:
            s.redis_errors, s.redis_degraded = self.remote.errors, int(self.remote.degraded)
        return StoreStats(**vars(s))

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
        if self.remote is not None:
            self.remote.close()
