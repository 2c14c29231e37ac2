"""Disk tier: verified entries in a diskcache directory, stored as raw bytes (never pickled)."""
from __future__ import annotations

from pathlib import Path

import diskcache

from .entry import CorruptEntry, DocKV, decode_entry, encode_entry

__all__ = ["DiskTier"]

_ID_PREFIX = "id:"
_KV_PREFIX = "kv:"


class DiskTier:
    """Persistent key -> DocKV, plus the document-id -> key index.

    Values are `bytes` (diskcache stores exact bytes without pickling); every read is verified by
    `decode_entry`, and a corrupt entry is deleted and reported as a miss.

    Args:
        directory: the cache folder.
        budget_bytes: diskcache size limit (least recently stored entries are culled beyond it).
    """

    def __init__(self, directory: str | Path, budget_bytes: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._cache = diskcache.Cache(str(self.directory), size_limit=int(budget_bytes),
                                      eviction_policy="least-recently-used", cull_limit=10)
        self.corrupt = 0

    def get(self, key: str) -> DocKV | None:
        blob = self._cache.get(_KV_PREFIX + key, default=None, retry=True)
        if blob is None:
            return None
        try:
            return decode_entry(key, blob)
        except CorruptEntry:
            self.corrupt += 1
            self._cache.delete(_KV_PREFIX + key, retry=True)
            return None

    def put(self, key: str, kv: DocKV) -> bool:
        return bool(self._cache.set(_KV_PREFIX + key, encode_entry(key, kv), retry=True))

    def raw_set(self, key: str, blob: bytes) -> None:
        """Writes bytes under a key unchecked (for tests that corrupt entries)."""
        self._cache.set(_KV_PREFIX + key, blob, retry=True)

    def raw_get(self, key: str) -> bytes | None:
        return self._cache.get(_KV_PREFIX + key, default=None, retry=True)

    def get_id(self, doc_id: str) -> str | None:
        v = self._cache.get(_ID_PREFIX + doc_id, default=None, retry=True)
        return v.decode() if isinstance(v, bytes) else None

    def set_id(self, doc_id: str, key: str) -> None:
        self._cache.set(_ID_PREFIX + doc_id, key.encode(), retry=True)

    def __contains__(self, key: str) -> bool:
        return (_KV_PREFIX + key) in self._cache

    def close(self) -> None:
        self._cache.close()
