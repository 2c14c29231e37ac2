"""The KV store on its own: keys, entry format, LRU budget, disk verification, id -> content index."""
from __future__ import annotations

import pickle

import pytest
import torch

from kvfuse.engine.store import (CorruptEntry, DocKV, DocStore, MemoryTier, Namespace, content_key, decode_entry,
                                 encode_entry)


def _kv(length: int, seed: int = 0, layers: int = 2) -> DocKV:
    g = torch.Generator().manual_seed(seed)
    return DocKV(torch.randn(layers, length, 2, 8, generator=g), torch.randn(layers, length, 2, 8, generator=g))


K_A, OLD, NEW = "a" * 64, "0" * 64, "1" * 64  # content keys are sha256 hex digests

NS = Namespace(model="m1", tokenizer="t1", dtype="torch.float32")


def test_key_binds_namespace_prefix_and_content():
    k = content_key(NS, [1, 2], [3, 4, 5])
    assert k == content_key(NS, [1, 2], [3, 4, 5])
    assert k != content_key(NS, [1, 2], [3, 4, 6])
    assert k != content_key(NS, [1], [2, 3, 4, 5])  # the prefix/doc boundary is part of the key
    assert k != content_key(Namespace("m2", "t1", "torch.float32"), [1, 2], [3, 4, 5])
    assert k != content_key(Namespace("m1", "t1", "torch.bfloat16"), [1, 2], [3, 4, 5])
    assert k != content_key(Namespace("m1", "t1", "torch.float32", layout=99), [1, 2], [3, 4, 5])


def test_lru_evicts_least_recently_used_within_budget():
    one = _kv(4).nbytes
    tier = MemoryTier(budget_bytes=3 * one)
    for name in "abc":
        assert tier.put(name, _kv(4))
    assert tier.get("a") is not None  # a becomes most recent: order b, c, a
    tier.put("d", _kv(4))  # evicts b
    assert tier.keys() == ["c", "a", "d"]
    assert tier.used == 3 * one and tier.evictions == 1
    tier.put("e", _kv(8))  # needs two slots: evicts c then a
    assert tier.keys() == ["d", "e"] and tier.evictions == 3
    assert not tier.put("huge", _kv(40))  # larger than the whole budget: refused, nothing evicted
    assert tier.keys() == ["d", "e"]


def test_entry_roundtrip_and_verification():
    kv = _kv(5)
    blob = encode_entry("key1", kv)
    back = decode_entry("key1", blob)
    assert torch.equal(back.k, kv.k) and torch.equal(back.v, kv.v)
    with pytest.raises(CorruptEntry, match="another key"):
        decode_entry("key2", blob)
    flipped = bytearray(blob)
    flipped[-10] ^= 0xFF
    with pytest.raises(CorruptEntry, match="checksum"):
        decode_entry("key1", bytes(flipped))
    with pytest.raises(CorruptEntry):
        decode_entry("key1", blob[: len(blob) // 2])
    with pytest.raises(CorruptEntry, match="magic"):
        decode_entry("key1", pickle.dumps({"k": kv.k, "v": kv.v}))  # a pickle is never loaded


def test_disk_tier_persists_and_rebuilds_corrupt_entries(tmp_path):
    store = DocStore(memory_budget_bytes=1 << 20, disk_dir=tmp_path)
    kv = _kv(6)
    store.put("doc-a", K_A, kv)
    store.close()

    fresh = DocStore(memory_budget_bytes=1 << 20, disk_dir=tmp_path)  # a new process: memory is empty
    got = fresh.lookup("doc-a", K_A)
    assert got is not None and torch.equal(got.k, kv.k)
    assert fresh.stats.disk_hits == 1 and fresh.stats.hits == 1

    blob = bytearray(fresh.disk.raw_get(K_A))
    blob[-3] ^= 0x55  # corrupt the payload on disk
    fresh.disk.raw_set(K_A, bytes(blob))
    fresh.memory.clear()
    assert fresh.lookup("doc-a", K_A) is None  # detected: a miss, never served
    assert fresh.stats.corrupt == 1 and fresh.stats.misses == 1
    assert fresh.disk.raw_get(K_A) is None  # the bad entry was removed so it gets rebuilt
    fresh.put("doc-a", K_A, kv)
    assert fresh.lookup("doc-a", K_A) is not None


def test_changed_content_under_same_id_is_stale_not_served():
    store = DocStore(memory_budget_bytes=1 << 20)
    store.put("doc", OLD, _kv(3))
    assert store.lookup("doc", NEW) is None
    assert store.stats.stale == 1 and store.stats.misses == 1
    assert store.lookup("doc", OLD) is not None  # the old content is still valid under its own key


def test_content_keys_of_lists_and_tensors_agree():
    """Keys hashed from a list (the array fast path) equal keys of the same ids as a tensor (the torch path), so
    entries cached before the fast path are still found."""
    from kvfuse.engine.store.keys import Namespace, content_key

    ns = Namespace(model="m", tokenizer="t", dtype="bf16")
    ids = [5, 2**40, 0, 151000]
    assert content_key(ns, [1, 2, 3], ids) == content_key(ns, torch.tensor([1, 2, 3]), torch.tensor(ids))
    assert content_key(ns, [1, 2, 3], ids) != content_key(ns, [1, 2], [3, *ids])
