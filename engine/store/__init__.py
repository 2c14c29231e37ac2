"""Document KV store: content keys, the entry format, memory and disk tiers."""
from .entry import CorruptEntry, DocKV, decode_entry, encode_entry
from .keys import LAYOUT_VERSION, Namespace, content_key, fingerprint_tensors
from .memory import MemoryTier
from .store import DocStore, StoreStats

__all__ = ["CorruptEntry", "DocKV", "DocStore", "LAYOUT_VERSION", "MemoryTier", "Namespace", "StoreStats",
           "content_key", "decode_entry", "encode_entry", "fingerprint_tensors"]
