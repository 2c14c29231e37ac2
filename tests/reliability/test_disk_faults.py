"""A disk tier that can't be used never fails a request: a junk database, a full filesystem and a folder deleted
under a running engine degrade to memory only, and a read-only folder still serves what it holds (read-only).
Each logs one warning and counts `disk_errors` / `disk_degraded`; answers are identical to an engine with no disk
tier at all. No orphan files are left; when the folder is usable again the tier resumes."""
from __future__ import annotations

import logging
import os
import shutil
import time

import pytest
import torch
from cases import DOCS, QUESTION
from reliability_fs import compare, remount

from kvfuse.engine.store.disk import DiskTier

OTHER = [("o1", "The Merrow Bridge spans the river Tal and was finished in 1902 by the engineer Rosa Pell."),
         ("o2", "Rosa Pell studied at the Carvel Institute and later designed the Dunmore lighthouse."),
         ("o3", "The Dunmore lighthouse is painted red and white and stands forty metres tall.")]
OTHER_Q = "Who designed the Dunmore lighthouse?"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvfuse.store" and r.levelno >= logging.WARNING]


@pytest.fixture
def reference(tiny_engine, tally):
    """Answers of an engine with no disk tier (tokens and exact log-probabilities)."""
    ref = tiny_engine("llama")
    cache = {}

    def answer(question, docs, result=None):
        key = (question, tuple(docs))
        if key not in cache:
            cache[key] = ref.generate(question, docs, strategy="reuse", max_new_tokens=4, return_logprobs=True)
        if result is not None:
            tally(None, 1, *compare(result, cache[key]))
        return cache[key]

    return answer


def _ask(engine, reference, question=QUESTION, docs=DOCS):
    r = engine.generate(question, docs, strategy="reuse", max_new_tokens=4, return_logprobs=True)
    ref = reference(question, docs, r)
    assert r.token_ids == ref.token_ids
    torch.testing.assert_close(r.extra["logprobs"], ref.extra["logprobs"], rtol=0, atol=0)
    return r


def _orphans(folder) -> list:
    disk = DiskTier(folder, 1 << 30)
    try:
        return disk.orphans()
    finally:
        disk.close()


def test_junk_database_degrades_with_one_warning(tiny_engine, reference, tmp_path, caplog):
    folder = tmp_path / "kv"
    folder.mkdir()
    (folder / "cache.db").write_bytes(os.urandom(4096))
    with caplog.at_level(logging.WARNING, logger="kvfuse.store"):
        engine = tiny_engine("llama", disk_cache_dir=folder)  # built, not failed
        for _ in range(3):
            _ask(engine, reference)
        _ask(engine, reference, OTHER_Q, OTHER)
    stats = engine.cache_stats()
    assert stats["disk_degraded"] == 1 and stats["disk_errors"] >= 1
    assert len(_warnings(caplog)) == 1 and "cache.db" not in _warnings(caplog)[0] or "memory only" in \
        _warnings(caplog)[0]
    assert (folder / "cache.db").stat().st_size == 4096  # the user's file is left as it was


def test_junk_database_cli_answers_with_one_warning_line(tiny_model, tmp_path, capsys):
    from kvfuse.cli import main

    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "cache.db").write_bytes(b"not a database" * 100)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join('{"id": "%s", "text": "%s"}' % d for d in DOCS), encoding="utf-8")
    rc = main(["ask", QUESTION, "--docs", str(docs), "--model", str(tiny_model("llama")), "--cache-dir",
               str(tmp_path), "--max-new-tokens", "3", "--dtype", "fp32", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "Traceback" not in err
    assert sum("disk cache" in line for line in err.splitlines()) == 1, err


def test_read_only_folder_is_served_read_only(tiny_engine, reference, mount_tmpfs, caplog):
    folder = mount_tmpfs("4m")
    writer = tiny_engine("llama", disk_cache_dir=folder / "kv")
    writer.precompute(DOCS)  # e.g. caches shipped in a read-only image
    writer.close()
    remount(folder, "ro")
    with caplog.at_level(logging.WARNING, logger="kvfuse.store"):
        engine = tiny_engine("llama", disk_cache_dir=folder / "kv", disk_retry_s=0.0)  # tries to write every time
        r = _ask(engine, reference)
        assert (r.cache_hits, r.cache_misses) == (3, 0) and engine.cache_stats()["disk_hits"] == 3
        r = _ask(engine, reference, OTHER_Q, OTHER)  # new documents: computed, kept in memory
        assert (r.cache_hits, r.cache_misses) == (0, 3)
        _ask(engine, reference)
        # registrations were read too: a stuffed prompt fuses the shipped documents
        assert engine.chat(f"{DOCS[0][1]}\n\n{QUESTION}", strategy="reuse", max_new_tokens=2).extra["documents"] \
            == [DOCS[0][0]]
    stats = engine.cache_stats()
    assert stats["disk_degraded"] == 1 and stats["disk_errors"] >= 1
    assert len(_warnings(caplog)) == 1, _warnings(caplog)
    remount(folder, "rw")
    engine.store.memory.clear()
    r = _ask(engine, reference, OTHER_Q, OTHER)  # the folder is writable again: the tier resumes
    assert engine.cache_stats()["disk_degraded"] == 0 and (r.cache_hits, r.cache_misses) == (0, 3)
    r = _ask(tiny_engine("llama", disk_cache_dir=folder / "kv"), reference, OTHER_Q, OTHER)
    assert r.cache_hits == 3  # stored once the folder was writable


def test_full_filesystem_keeps_answering_and_leaves_no_orphans(tiny_engine, reference, mount_tmpfs, caplog):
    folder = mount_tmpfs("2m")
    engine = tiny_engine("llama", disk_cache_dir=folder / "kv", disk_retry_s=0.0)
    _ask(engine, reference)  # the database exists and holds DOCS
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:  # fill the filesystem to the last byte
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    with caplog.at_level(logging.WARNING, logger="kvfuse.store"):
        many = [(f"m{i}", f"Entry {i}: the lantern maker number {i} lived at {i * 7} Harbour Street, Dunmore. "
                 * 3) for i in range(6)]
        for i in range(0, 6, 2):
            _ask(engine, reference, "Where did lantern maker number 2 live?", many[i:i + 2] + [OTHER[0]])
        _ask(engine, reference)
    stats = engine.cache_stats()
    assert stats["disk_errors"] >= 1
    assert len(_warnings(caplog)) == 1, _warnings(caplog)
    assert _orphans(folder / "kv") == []
    assert not [p for p in (folder / "kv").rglob("*.val") if p.stat().st_size == 0]
    filler.unlink()
    engine.store.memory.clear()
    r = _ask(engine, reference, "Where did lantern maker number 2 live?", many[:2] + [OTHER[0]])
    assert engine.cache_stats()["disk_degraded"] == 0
    fresh = tiny_engine("llama", disk_cache_dir=folder / "kv")
    r = _ask(fresh, reference, "Where did lantern maker number 2 live?", many[:2] + [OTHER[0]])
    assert r.cache_hits == 3  # written once there was room again


def test_folder_deleted_under_a_running_engine(tiny_engine, reference, tmp_path):
    folder = tmp_path / "kv"
    engine = tiny_engine("llama", disk_cache_dir=folder)
    _ask(engine, reference)
    shutil.rmtree(folder)
    engine.store.memory.clear()
    _ask(engine, reference)  # memory empty, disk gone: recomputed, same answer
    _ask(engine, reference, OTHER_Q, OTHER)
    fresh = tiny_engine("llama", disk_cache_dir=folder)  # a new process over the vanished folder
    _ask(fresh, reference, OTHER_Q, OTHER)
    assert _orphans(folder) == []


def test_degraded_tier_retries_after_its_pause(tmp_path):
    folder = tmp_path / "kv"
    folder.mkdir()
    (folder / "cache.db").write_bytes(b"junk" * 1000)
    disk = DiskTier(folder, 1 << 30, retry_s=0.3)
    assert disk.degraded and disk.errors == 1 and disk.get("a" * 64) is None
    assert disk.errors == 1  # paused: not even tried
    (folder / "cache.db").unlink()
    time.sleep(0.35)
    assert disk.get("a" * 64) is None and not disk.degraded  # reopened
    disk.close()
