"""The disk tier can't execute code: pickles planted through diskcache itself (values, document-id rows, keys,
files) and rows switched to pickle mode are refused, never loaded; foreign file paths are neither read nor
deleted. Each planted row is dropped and the request is answered exactly as from a clean cache."""
from __future__ import annotations

import os
import pickle
import sqlite3

import diskcache
import pytest
import torch
from cases import DOCS, QUESTION
from reliability_fs import compare

from kvfuse.engine.store import content_key
from kvfuse.engine.store.disk import RawBytesDisk, UnsafeRow
from kvfuse.engine.types import Document


class _Exploit:
    """Unpickling this creates the marker folder: proof that code from the cache ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _keys(engine):
    """(disk row name of each document's K/V entry, disk row name of each document's id row)."""
    kv = [f"kv:{content_key(engine.namespace, engine.prompts.prefix_ids, engine.prompts.encode_document(Document(*d)))}"
          for d in DOCS]
    ids = [engine.store.disk._id_name(d[0]) for d in DOCS]
    return kv, ids


def _seeded(tiny_engine, tmp_path):
    """A cache folder holding DOCS, written and closed by one engine: (folder, K/V row names, id row names)."""
    cache_dir = tmp_path / "kv"
    first = tiny_engine("llama", disk_cache_dir=cache_dir)
    first.precompute(DOCS)
    kv_rows, id_rows = _keys(first)
    first.close()
    return cache_dir, kv_rows, id_rows


def _reference(tiny_engine):
    ref = tiny_engine("llama")  # memory only: never saw the planted rows
    return ref.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=4, return_logprobs=True)


def _assert_same(r, ref):
    assert r.token_ids == ref.token_ids
    torch.testing.assert_close(r.extra["logprobs"], ref.extra["logprobs"], rtol=0, atol=0)


def test_raw_bytes_disk_refuses_everything_but_str_keys_and_bytes(tmp_path):
    cache = diskcache.Cache(str(tmp_path), disk=RawBytesDisk)
    with pytest.raises(TypeError):
        cache.set("k", {"a": 1})  # would be pickled by diskcache's own Disk
    with pytest.raises(TypeError):
        cache.set(("tuple", "key"), b"x")  # a pickled key
    with pytest.raises(TypeError):
        cache.set("k", "text")
    cache.set("small", b"abc")
    cache.set("big", os.urandom(1 << 16))  # a file under the folder
    assert cache.get("small") == b"abc" and len(cache.get("big")) == 1 << 16
    disk = cache._disk
    with pytest.raises(UnsafeRow):
        disk.get(pickle.dumps("k"), raw=False)
    with pytest.raises(UnsafeRow):
        disk.fetch(diskcache.core.MODE_PICKLE, None, pickle.dumps(1), False)
    with pytest.raises(UnsafeRow):
        disk.fetch(diskcache.core.MODE_BINARY, "../../etc/passwd", None, False)
    cache.close()


@pytest.mark.parametrize("where", ["kv", "id"])
def test_pickle_set_through_diskcache_is_never_loaded(tiny_engine, tmp_path, where, tally):
    cache_dir, kv_rows, id_rows = _seeded(tiny_engine, tmp_path)
    marker = tmp_path / "pwned"
    attacker = diskcache.Cache(str(cache_dir))  # diskcache's default Disk: it pickles what it is given
    rows = kv_rows if where == "kv" else id_rows
    for i, row in enumerate(rows):  # a small pickle in the database, and a large one in a file
        payload = _Exploit(str(marker)) if i % 2 == 0 else [_Exploit(str(marker)), b"\0" * (1 << 16)]
        attacker.set(row, payload)
    attacker.close()

    engine = tiny_engine("llama", disk_cache_dir=cache_dir)
    r = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=4, return_logprobs=True)
    tally(None, len(rows), *compare(r, _reference(tiny_engine)), executed=int(marker.exists()))
    assert not marker.exists(), "a pickle from the cache was loaded"
    _assert_same(r, _reference(tiny_engine))
    stats = engine.cache_stats()
    assert stats["corrupt"] == len(rows)  # each planted row was dropped...
    if where == "kv":
        assert (r.cache_hits, r.cache_misses) == (0, 3)  # ...and its entry recomputed
    again = tiny_engine("llama", disk_cache_dir=cache_dir).generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=4)
    assert (again.cache_hits, again.cache_misses) == (3, 0)  # rebuilt entries are served to the next process


def test_rows_switched_to_pickle_mode_and_pickled_keys(tiny_engine, tmp_path, tally):
    cache_dir, kv_rows, id_rows = _seeded(tiny_engine, tmp_path)
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Exploit(str(marker)))
    con = sqlite3.connect(cache_dir / "cache.db")
    with con:
        # an existing K/V row: storage mode switched to pickle with a pickle in place of the value
        con.execute("UPDATE Cache SET mode = 4, filename = NULL, value = ? WHERE key = ?", (evil, kv_rows[0]))
        # an existing K/V row: mode switched to pickle, value left (a file row for big entries, or raw bytes)
        con.execute("UPDATE Cache SET mode = 4 WHERE key = ?", (kv_rows[1],))
        # an id row switched to pickle
        con.execute("UPDATE Cache SET mode = 4, value = ? WHERE key = ?", (evil, id_rows[2]))
        # a pickled key (raw = 0) next to the real ones
        con.execute("INSERT INTO Cache(key, raw, store_time, access_time, mode, value) VALUES (?, 0, 0, 0, 1, ?)",
                    (evil, b"x"))
    con.close()
    engine = tiny_engine("llama", disk_cache_dir=cache_dir)
    r = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=4, return_logprobs=True)
    tally(None, 4, *compare(r, _reference(tiny_engine)), executed=int(marker.exists()))
    assert not marker.exists()
    _assert_same(r, _reference(tiny_engine))
    assert engine.cache_stats()["corrupt"] == 3 and (r.cache_hits, r.cache_misses) == (1, 2)
    cache = engine.store.disk._cache
    with pytest.raises(UnsafeRow):
        list(cache.iterkeys())  # even diskcache's own key iteration can't unpickle the planted key
    assert not marker.exists()


def test_foreign_file_paths_are_neither_read_nor_deleted(tiny_engine, tmp_path):
    cache_dir, kv_rows, _ = _seeded(tiny_engine, tmp_path)
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    con = sqlite3.connect(cache_dir / "cache.db")
    with con:  # path traversal to a file outside the cache folder
        con.execute("UPDATE Cache SET mode = 2, value = NULL, filename = ? WHERE key = ?",
                    (os.path.relpath(victim, cache_dir), kv_rows[0]))
    con.close()
    # a symlinked value folder pointing outside the cache
    engine = tiny_engine("llama", disk_cache_dir=cache_dir)
    r = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=4, return_logprobs=True)
    _assert_same(r, _reference(tiny_engine))
    assert victim.read_text() == "keep me"
    assert engine.cache_stats()["corrupt"] == 1


def test_symlinked_value_file_is_refused(tmp_path):
    cache = diskcache.Cache(str(tmp_path / "kv"), disk=RawBytesDisk)
    cache.set("big", os.urandom(1 << 16))
    (filename,) = [f for (f,) in cache._sql("SELECT filename FROM Cache WHERE key = 'big'")]
    victim = tmp_path / "precious.bin"
    victim.write_bytes(b"secret")
    path = tmp_path / "kv" / filename
    path.unlink()
    path.symlink_to(victim)
    with pytest.raises(UnsafeRow):
        cache.get("big")
    cache.delete("big")
    assert victim.read_bytes() == b"secret"
    cache.close()


def test_cache_secret_refuses_forged_entries(tiny_engine, tmp_path, tally):
    """A well-formed entry of wrong numbers (right key, shape and checksum) is what a checksum can't catch: with
    a cache secret it is refused, dropped and rebuilt; without one it would be served (shown here, as the limit)."""
    from kvfuse.engine.store import decode_entry, encode_entry
    from kvfuse.engine.store.entry import DocKV

    ref = _reference(tiny_engine)
    for secret in (None, "s3cret"):
        folder = tmp_path / f"kv-{secret}"
        first = tiny_engine("llama", disk_cache_dir=folder, cache_secret=secret)
        first.precompute(DOCS)
        key = _keys(first)[0][1][3:]
        kv = decode_entry(key, first.store.disk.raw_get(key))
        forged = DocKV(torch.flip(kv.k, dims=[1]).contiguous(), torch.flip(kv.v, dims=[1]).contiguous())
        first.store.disk.raw_set(key, encode_entry(key, forged))  # signed with no secret: what an attacker can do
        first.close()
        engine = tiny_engine("llama", disk_cache_dir=folder, cache_secret=secret)
        r = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=4, return_logprobs=True)
        if secret is None:
            assert compare(r, ref)[1] == 1  # served: the log-probabilities moved
            continue
        tally(None, 1, *compare(r, ref))
        _assert_same(r, ref)
        assert engine.cache_stats()["corrupt"] == 1 and r.cache_misses == 1
        again = tiny_engine("llama", disk_cache_dir=folder, cache_secret=secret)
        assert again.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=2).cache_hits == 3
