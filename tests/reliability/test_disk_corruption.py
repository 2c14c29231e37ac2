"""Corruption of every on-disk structure is detected, dropped and rebuilt; nothing stale or wrong is served.

Entry level: random mutations of an encoded entry (hypothesis) and crafted ones (headers that are valid JSON
but not objects, wrong shapes, a payload re-checksummed after tampering). Engine level: the same written into
the cache through diskcache, and sqlite rows of values and of document ids damaged directly; the answer must
equal an engine with no disk tier, to the last bit of its log-probabilities, and the next process must hit.
"""
from __future__ import annotations

import hashlib
import json
import sqlite3
import struct

import pytest
import torch
from cases import DOCS, QUESTION
from reliability_fs import compare
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as st_save

from kvfuse.engine.prompt import PromptFormat
from kvfuse.engine.store import CorruptEntry, DocKV, content_key, decode_entry, encode_entry
from kvfuse.engine.store.entry import MAGIC
from kvfuse.engine.store.keys import LAYOUT_VERSION
from kvfuse.engine.types import Document

KEY = "ab" * 32


def _kv(length=5, seed=0) -> DocKV:
    g = torch.Generator().manual_seed(seed)
    return DocKV(torch.randn(2, length, 2, 4, generator=g), torch.randn(2, length, 2, 4, generator=g),
                 {"anchors": torch.tensor([0, 2], dtype=torch.int32)})


def _blob(header, payload: bytes) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return MAGIC + struct.pack("<I", len(raw)) + raw + payload


def _forged(key: str, tensors: dict, shape=None, dtype="torch.float32") -> bytes:
    """A well-formed entry with a correct checksum over whatever tensors it is given."""
    payload = st_save(tensors)
    shape = shape or list(tensors["k"].shape)
    return _blob({"key": key, "layout": LAYOUT_VERSION, "shape": shape, "dtype": dtype,
                  "sha256": hashlib.sha256(payload).hexdigest()}, payload)


GOOD = encode_entry(KEY, _kv())


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_mutation_is_rejected_or_harmless(data, tally):
    blob = bytearray(GOOD)
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice", "zero"]))
    if kind == "flip":
        for i in data.draw(st.lists(st.integers(0, len(blob) - 1), min_size=1, max_size=8)):
            blob[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        blob = blob[:data.draw(st.integers(0, len(blob) - 1))]
    elif kind == "extend":
        blob += data.draw(st.binary(min_size=1, max_size=64))
    elif kind == "splice":
        i = data.draw(st.integers(0, len(blob)))
        blob[i:i] = data.draw(st.binary(min_size=1, max_size=64))
    else:
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i:i + data.draw(st.integers(1, 256))] = b"\0" * 4
    try:
        back = decode_entry(KEY, bytes(blob))
    except CorruptEntry:
        tally()
        return
    ref = _kv()  # only an unchanged entry may decode, and then to exactly the stored tensors
    same = torch.equal(back.k, ref.k) and torch.equal(back.v, ref.v)
    tally(stale=int(not same))
    assert same


CRAFTED = {
    "header is a list": lambda: _blob([1, 2], GOOD[12:]),
    "header is a number": lambda: _blob(7, b""),
    "header is a string": lambda: _blob("x", b""),
    "header is null": lambda: _blob(None, b""),
    "header length past the end": lambda: MAGIC + struct.pack("<I", 1 << 30) + b"{}",
    "header not utf-8": lambda: _blob(b"\xff\xfe{", b""),
    "shape not a list": lambda: _forged(KEY, {"k": _kv().k, "v": _kv().v}, shape="5"),
    "shape of strings": lambda: _forged(KEY, {"k": _kv().k, "v": _kv().v}, shape=["2", 5, 2, 4]),
    "unknown dtype": lambda: _forged(KEY, {"k": _kv().k, "v": _kv().v}, dtype="torch.complex64"),
    "v of another shape": lambda: _forged(KEY, {"k": _kv().k, "v": _kv(4).v}),
    "no v": lambda: _forged(KEY, {"k": _kv().k}),
    "another key": lambda: encode_entry("cd" * 32, _kv()),
    "payload not safetensors": lambda: _blob({"key": KEY, "layout": LAYOUT_VERSION, "shape": [2, 5, 2, 4],
                                              "dtype": "torch.float32",
                                              "sha256": hashlib.sha256(b"junk").hexdigest()}, b"junk"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_entries_raise_corrupt_entry_only(case):
    with pytest.raises(CorruptEntry):
        decode_entry(KEY, CRAFTED[case]())


# -- through the engine -------------------------------------------------------------------------------------
def _row(engine, i: int) -> str:
    ids = engine.prompts.encode_document(Document(*DOCS[i]))
    return content_key(engine.namespace, engine.prompts.prefix_ids, ids)


def _entry_damage(engine, key: str, how: str) -> bytes:
    good = engine.store.disk.raw_get(key)
    kv = decode_entry(key, good)
    if how == "header a JSON list":
        return _blob(["key", key], good[12:])
    if how == "payload byte flipped":
        b = bytearray(good)
        b[-7] ^= 0x40
        return bytes(b)
    if how == "checksum rewritten after tampering":  # consistent bytes, wrong numbers: caught by the model check
        return _forged(key, {"k": kv.k[:, :-1].contiguous(), "v": kv.v[:, :-1].contiguous()})
    if how == "other model's shape":
        k = torch.zeros(kv.k.shape[0] + 1, *kv.k.shape[1:])
        return _forged(key, {"k": k, "v": k.clone()})
    if how == "other dtype":
        return _forged(key, {"k": kv.k.half(), "v": kv.v.half()}, dtype="torch.float16")
    if how == "anchors out of range":
        return _forged(key, {"k": kv.k, "v": kv.v, "x.anchors": torch.tensor([0, 10 ** 6], dtype=torch.int32)})
    if how == "truncated":
        return good[:len(good) // 3]
    raise AssertionError(how)


@pytest.fixture
def reference(tiny_engine):
    ref = tiny_engine("llama")
    return ref.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=4, return_logprobs=True)


def _same(r, ref, tally=None):
    if tally is not None:
        tally(None, 1, *compare(r, ref))
    assert r.token_ids == ref.token_ids
    torch.testing.assert_close(r.extra["logprobs"], ref.extra["logprobs"], rtol=0, atol=0)


@pytest.mark.parametrize("how", ["header a JSON list", "payload byte flipped", "checksum rewritten after tampering",
                                 "other model's shape", "other dtype", "anchors out of range", "truncated"])
def test_damaged_entry_is_dropped_rebuilt_and_never_served(tiny_engine, tmp_path, reference, how, tally):
    first = tiny_engine("llama", disk_cache_dir=tmp_path)
    first.precompute(DOCS)
    key = _row(first, 1)
    first.store.disk.raw_set(key, _entry_damage(first, key, how))
    first.close()
    for _ in range(2):  # the damage must not fail or repeat: dropped once, then rebuilt
        engine = tiny_engine("llama", disk_cache_dir=tmp_path)
        r = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=4, return_logprobs=True)
        _same(r, reference, tally)
        engine.close()
    assert (r.cache_hits, r.cache_misses) == (3, 0)
    qc = tiny_engine("llama", disk_cache_dir=tmp_path)  # qcfuse reads the anchors extra
    qc.generate(QUESTION, DOCS, strategy="qcfuse", max_new_tokens=2)


# the first document is long enough for its entry to live in a file rather than in the database
LONG = [(DOCS[0][0], " ".join([DOCS[0][1]] * 4)), *DOCS[1:]]


@pytest.mark.parametrize("how", ["id value not utf-8", "id value not a key", "id value an integer",
                                 "kv value as text", "kv file missing", "kv row emptied"])
def test_damaged_sqlite_rows(tiny_engine, tmp_path, how, tally):
    reference = tiny_engine("llama").generate(QUESTION, LONG, strategy="reuse", max_new_tokens=4,
                                              return_logprobs=True)
    first = tiny_engine("llama", disk_cache_dir=tmp_path)
    first.precompute(LONG)
    id_row = first.store.disk._id_name(LONG[0][0])
    kv_row = "kv:" + content_key(first.namespace, first.prompts.prefix_ids,
                                 first.prompts.encode_document(Document(*LONG[0])))
    first.close()
    con = sqlite3.connect(tmp_path / "cache.db")
    with con:
        if how == "id value not utf-8":
            con.execute("UPDATE Cache SET value = ? WHERE key = ?", (b"\xff\xfe\x80" * 10, id_row))
        elif how == "id value not a key":
            con.execute("UPDATE Cache SET value = ? WHERE key = ?", (b"../../etc/passwd", id_row))
        elif how == "id value an integer":
            con.execute("UPDATE Cache SET value = 12 WHERE key = ?", (id_row,))
        elif how == "kv value as text":
            con.execute("UPDATE Cache SET mode = 1, filename = NULL, value = 'text' WHERE key = ?", (kv_row,))
        elif how == "kv file missing":
            (fn,) = con.execute("SELECT filename FROM Cache WHERE key = ?", (kv_row,)).fetchone()
            assert fn, "expected the entry in a file"
            (tmp_path / fn).unlink()
        else:
            con.execute("UPDATE Cache SET mode = 1, filename = NULL, value = NULL WHERE key = ?", (kv_row,))
    con.close()
    engine = tiny_engine("llama", disk_cache_dir=tmp_path)
    r = engine.generate(QUESTION, LONG, strategy="reuse", max_new_tokens=4, return_logprobs=True)
    _same(r, reference, tally)
    assert r.stale == 0  # a damaged id row is forgotten, not reported as a content change
    again = tiny_engine("llama", disk_cache_dir=tmp_path)
    r2 = again.generate(QUESTION, LONG, strategy="reuse", max_new_tokens=4)
    assert (r2.cache_hits, r2.cache_misses) == (3, 0) and r2.stale == 0


def test_changed_text_across_processes_is_stale_and_id_rows_are_scoped_by_prompt(tiny_engine, tmp_path, tally):
    first = tiny_engine("llama", disk_cache_dir=tmp_path)
    first.precompute(DOCS)
    changed = [DOCS[0], (DOCS[1][0], "The Quillon Lantern Festival was founded in 1931 by the potter Ines Alva."),
               DOCS[2]]
    second = tiny_engine("llama", disk_cache_dir=tmp_path)
    r = second.generate(QUESTION, changed, strategy="reuse", max_new_tokens=4, return_logprobs=True)
    assert (r.stale, r.cache_hits, r.cache_misses) == (1, 2, 1)
    ref = tiny_engine("llama").generate(QUESTION, changed, strategy="reuse", max_new_tokens=4, return_logprobs=True)
    _same(r, ref, tally)
    # the same ids and texts under another prompt format: other content keys, but no false stale counts
    other = tiny_engine("llama", disk_cache_dir=tmp_path, prompt=PromptFormat(instruction="Read these.\n\n"))
    r = other.generate(QUESTION, changed, strategy="reuse", max_new_tokens=2)
    assert r.stale == 0 and r.cache_misses == 3
