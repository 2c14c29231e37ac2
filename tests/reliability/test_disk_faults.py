"""A disk tier that can't be used never fails a request: a junk database, a full filesystem and a folder deleted
under a running engine degrade to memory only, and a read-only folder still serves what it holds (read-only).
Each logs one warning and counts `disk_errors` / `disk_degraded`; answers are identical to an engine with no disk
tier at all. No orphan files are left; when the folder is usable again the tier resumes."""
from __future__ import annotations

import logging
import os
import shutil
import time

from cases import DOCS, QUESTION
from reliability_fs import OTHER, OTHER_Q, ask_exact, remount, store_warnings

from kvfuse.engine.store.disk import DiskTier



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
            ask_exact(engine, reference)
        ask_exact(engine, reference, OTHER_Q, OTHER)
    stats = engine.cache_stats()
    assert stats["disk_degraded"] == 1 and stats["disk_errors"] >= 1
    assert len(store_warnings(caplog)) == 1 and "cache.db" not in store_warnings(caplog)[0] or "memory only" in \
        store_warnings(caplog)[0]
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
        r = ask_exact(engine, reference)
        assert (r.cache_hits, r.cache_misses) == (3, 0) and engine.cache_stats()["disk_hits"] == 3
        r = ask_exact(engine, reference, OTHER_Q, OTHER)  # new documents: computed, kept in memory
        assert (r.cache_hits, r.cache_misses) == (0, 3)
        ask_exact(engine, reference)
        # registrations were read too: a stuffed prompt fuses the shipped documents
        assert engine.chat(f"{DOCS[0][1]}\n\n{QUESTION}", strategy="reuse", max_new_tokens=2).extra["documents"] \
            == [DOCS[0][0]]
    stats = engine.cache_stats()
    assert stats["disk_degraded"] == 1 and stats["disk_errors"] >= 1
    assert len(store_warnings(caplog)) == 1, store_warnings(caplog)
    remount(folder, "rw")
    engine.store.memory.clear()
    r = ask_exact(engine, reference, OTHER_Q, OTHER)  # the folder is writable again: the tier resumes
    assert engine.cache_stats()["disk_degraded"] == 0 and (r.cache_hits, r.cache_misses) == (0, 3)
    r = ask_exact(tiny_engine("llama", disk_cache_dir=folder / "kv"), reference, OTHER_Q, OTHER)
    assert r.cache_hits == 3  # stored once the folder was writable


def test_full_filesystem_keeps_answering_and_leaves_no_orphans(tiny_engine, reference, mount_tmpfs, caplog):
    folder = mount_tmpfs("2m")
    engine = tiny_engine("llama", disk_cache_dir=folder / "kv", disk_retry_s=0.0)
    ask_exact(engine, reference)  # the database exists and holds DOCS
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
            ask_exact(engine, reference, "Where did lantern maker number 2 live?", many[i:i + 2] + [OTHER[0]])
        ask_exact(engine, reference)
    stats = engine.cache_stats()
    assert stats["disk_errors"] >= 1
    assert len(store_warnings(caplog)) == 1, store_warnings(caplog)
    assert _orphans(folder / "kv") == []
    assert not [p for p in (folder / "kv").rglob("*.val") if p.stat().st_size == 0]
    filler.unlink()
    engine.store.memory.clear()
    r = ask_exact(engine, reference, "Where did lantern maker number 2 live?", many[:2] + [OTHER[0]])
    assert engine.cache_stats()["disk_degraded"] == 0
    fresh = tiny_engine("llama", disk_cache_dir=folder / "kv")
    r = ask_exact(fresh, reference, "Where did lantern maker number 2 live?", many[:2] + [OTHER[0]])
    assert r.cache_hits == 3  # written once there was room again


def test_folder_deleted_under_a_running_engine(tiny_engine, reference, tmp_path):
    folder = tmp_path / "kv"
    engine = tiny_engine("llama", disk_cache_dir=folder)
    ask_exact(engine, reference)
    shutil.rmtree(folder)
    engine.store.memory.clear()
    ask_exact(engine, reference)  # memory empty, disk gone: recomputed, same answer
    ask_exact(engine, reference, OTHER_Q, OTHER)
    fresh = tiny_engine("llama", disk_cache_dir=folder)  # a new process over the vanished folder
    ask_exact(fresh, reference, OTHER_Q, OTHER)
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
