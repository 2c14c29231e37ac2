"""Disk tier: verified entries in a diskcache directory, stored as raw bytes, never pickled.

The cache folder may be shared with other processes, so everything read from it is untrusted input:

- `RawBytesDisk` is the only diskcache `Disk` used. It stores `str` keys and `bytes` values and nothing else;
  a row in any other storage mode (pickle, text), a pickled key, or a file name outside the cache folder is
  refused with `UnsafeRow` before anything is loaded or removed. diskcache cannot unpickle through it.
- Every value is verified (`decode_entry` for K/V entries, a hex content key for document-id rows); a row that
  fails is deleted and reported as a miss, so the caller recomputes it.
- A folder that can't be used (read-only, full, not a database, vanished mid-write) never fails a request:
  the tier degrades (writes only, or reads and writes) for `retry_s` seconds, logs one warning per episode and
  counts `errors`; after the pause the next operation tries again.
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import diskcache
from diskcache.core import MODE_BINARY, MODE_RAW, UNKNOWN

from .entry import CorruptEntry, DocKV, decode_entry, encode_entry

__all__ = ["DiskTier", "RawBytesDisk", "UnsafeRow"]

log = logging.getLogger("kvfuse.store")

_ID_PREFIX = "id:"
_KV_PREFIX = "kv:"
_KEY_RE = re.compile(r"[0-9a-f]{64}")
# diskcache names value files <2 hex>/<2 hex>/<28 hex>.val under the cache folder
_FILE_RE = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")
_SQLITE_TIMEOUT_S = 10.0  # a writer in another process holding the database longer than this is a miss, not a hang


class UnsafeRow(ValueError):
    """A cache row that kvfuse never writes: a non-raw (pickled) key, a pickle/text value, a foreign file path."""


class RawBytesDisk(diskcache.Disk):
    """A diskcache `Disk` that can only store and load `str` keys and `bytes` values.

    Values under `min_file_size` live in the database (MODE_RAW), larger ones in files (MODE_BINARY) whose
    partial file is removed when writing fails. Settings other than `min_file_size` (which diskcache reads from
    the database's Settings table and passes here) are ignored, so a planted `disk_*` setting can't break it.
    """

    def __init__(self, directory: str, min_file_size: int = 1 << 15, **_ignored: Any) -> None:
        super().__init__(directory, min_file_size=int(min_file_size), pickle_protocol=0)
        self._root = os.path.realpath(directory)
        self._local = threading.local()

    # keys -------------------------------------------------------------------------------------------------
    def put(self, key):
        if type(key) is not str:
            raise TypeError(f"kvfuse's disk tier takes str keys only, got {type(key).__name__}")
        return key, True

    def get(self, key, raw):
        if not raw or type(key) is not str:
            raise UnsafeRow("a pickled or non-text key in the cache database")
        return key

    # values -----------------------------------------------------------------------------------------------
    def store(self, value, read, key=UNKNOWN):
        if read or type(value) is not bytes:
            raise TypeError(f"kvfuse's disk tier stores bytes only, got {type(value).__name__}")
        if len(value) < self.min_file_size:
            return 0, MODE_RAW, None, sqlite3.Binary(value)
        filename, full_path = self.filename(key, value)
        try:
            self._write(full_path, io.BytesIO(value), "xb")
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(full_path)  # no partial file is left behind (ENOSPC, EIO, interrupted)
            raise
        self._local.written = filename
        return len(value), MODE_BINARY, filename, None

    def take_written(self) -> str | None:
        """The file the last `store` on this thread wrote (so a failed insert can remove it), then forgets it."""
        name, self._local.written = getattr(self._local, "written", None), None
        return name

    def fetch(self, mode, filename, value, read):
        if read:
            raise UnsafeRow("file handles are not served")
        if mode == MODE_RAW and type(value) is bytes:
            return value
        if mode == MODE_BINARY and value is None:
            with open(self._path(filename), "rb") as f:  # a missing file is an IOError: diskcache reports a miss
                return f.read()
        raise UnsafeRow(f"storage mode {mode} with a {type(value).__name__} value (kvfuse writes raw bytes only)")

    def remove(self, file_path):
        if file_path is None:
            return
        try:
            path = self._path(file_path)
        except UnsafeRow:
            log.warning("refusing to remove %r named by the cache database: outside the cache folder", file_path)
            return
        with contextlib.suppress(OSError):
            os.remove(path)
        with contextlib.suppress(OSError):
            os.removedirs(os.path.dirname(path))

    def _path(self, filename) -> str:
        """The absolute path of a value file, refusing anything diskcache itself would not have named."""
        if type(filename) is not str or not _FILE_RE.fullmatch(filename.replace(os.sep, "/")):
            raise UnsafeRow(f"value file name {filename!r} is not one the cache writes")
        full = os.path.join(self._root, filename)
        if os.path.realpath(full) != full:  # a planted symlink (file or folder) pointing elsewhere
            raise UnsafeRow(f"value file {filename!r} resolves outside the cache folder")
        return full


def _read_only(db: Path) -> sqlite3.Connection | None:
    """A read-only connection to a diskcache database, or None. On a read-only filesystem a WAL database can't
    make its shared-memory file, so it is then opened as immutable (nothing else can be writing it there)."""
    for flags in ("mode=ro", "mode=ro&immutable=1"):
        try:
            con = sqlite3.connect(f"file:{db}?{flags}", uri=True, check_same_thread=False, timeout=_SQLITE_TIMEOUT_S)
            con.execute("SELECT key, raw, mode, filename, value FROM Cache LIMIT 1").fetchall()
            return con
        except sqlite3.Error:
            continue
    return None


class _ReadOnlyCache:
    """The reads of a diskcache folder that can't be written (a read-only filesystem or folder): rows are read
    with a read-only sqlite connection and loaded through `RawBytesDisk.fetch` (the same refusals); access times
    are not updated and nothing is deleted or written."""

    def __init__(self, directory: Path, con: sqlite3.Connection) -> None:
        self._con = con
        self._disk = RawBytesDisk(str(directory))
        self._lock = threading.Lock()

    @classmethod
    def open(cls, directory: Path) -> _ReadOnlyCache | None:
        db = Path(directory) / "cache.db"
        if not db.is_file():
            return None
        con = _read_only(db)
        return None if con is None else cls(Path(directory), con)

    def _row(self, key: str):
        with self._lock:
            return self._con.execute("SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1 AND "
                                     "(expire_time IS NULL OR expire_time > ?)", (key, time.time())).fetchone()

    def get(self, key: str, default=None, retry: bool = False):
        row = self._row(key)
        if row is None:
            return default
        try:
            return self._disk.fetch(row[0], row[1], row[2], False)
        except OSError:
            return default

    def __contains__(self, key: str) -> bool:
        return self._row(key) is not None

    def delete(self, key: str, retry: bool = False) -> bool:
        return False  # read-only: a bad row stays, and is refused again next time

    def set(self, *args, **kwargs):
        raise sqlite3.OperationalError("the cache folder is read-only")

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._con.close()


def _is_disk_failure(e: BaseException) -> bool:
    """An error that says the folder can't be used now (as opposed to a bad row)."""
    return isinstance(e, (sqlite3.Error, OSError, diskcache.Timeout))


class DiskTier:
    """Persistent key -> DocKV, plus the document-id -> key index.

    Values are `bytes` through `RawBytesDisk`; every read is verified and a bad row is deleted and reported as a
    miss. Faults of the folder itself degrade the tier instead of raising (see the module docstring).

    Args:
        directory: the cache folder.
        budget_bytes: diskcache size limit (least recently used entries are culled beyond it).
        id_scope: namespaces the document-id rows (the engine passes its model/tokenizer/prompt prefix key), so
            ids seen under another prompt format or model are never compared with this one's keys.
        retry_s: seconds a degraded tier waits before trying the folder again.
        secret: when given, entries are signed (HMAC-SHA256) and only entries signed with it are served.

    Counters: `corrupt` (rows dropped), `errors` (operations that failed on the folder), `degraded` (whether
    the tier is degraded now), `degradations` (episodes so far).
    """

    def __init__(self, directory: str | Path, budget_bytes: int, id_scope: str = "", retry_s: float = 60.0,
                 secret: bytes | None = None) -> None:
        self.directory = Path(directory)
        self.secret = secret or None
        self.budget_bytes = int(budget_bytes)
        self.id_scope = id_scope
        self.retry_s = float(retry_s)
        self.corrupt = 0
        self.errors = 0
        self.degradations = 0
        self._cache: diskcache.Cache | None = None
        self._no_reads_until = 0.0  # monotonic times before which reads / writes are skipped
        self._no_writes_until = 0.0
        self._episode: str | None = None  # "reads" / "writes" while degraded
        self._mutex = threading.Lock()
        self._open()

    @property
    def degraded(self) -> bool:
        """Whether reads or writes are being skipped now (or the folder could not be opened, or only read-only)."""
        now = time.monotonic()
        return (self._cache is None or isinstance(self._cache, _ReadOnlyCache) or now < self._no_reads_until
                or now < self._no_writes_until)

    # -- the folder ------------------------------------------------------------------------------------------
    def _open(self) -> bool:
        try:
            if self.directory.exists() and not self.directory.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(self.directory))
            self.directory.mkdir(parents=True, exist_ok=True)
            self._cache = diskcache.Cache(str(self.directory), timeout=_SQLITE_TIMEOUT_S, disk=RawBytesDisk,
                                          size_limit=self.budget_bytes, eviction_policy="least-recently-used",
                                          cull_limit=10, disk_min_file_size=1 << 15, statistics=0)
        except Exception as e:  # noqa: BLE001 - any failure to open means "memory only for now"
            ro = _ReadOnlyCache.open(self.directory)  # a read-only folder still serves what it holds
            if ro is not None:
                self._cache = ro
                self._fail(e, reads=False, what="open for writing")
                return False
            self._cache = None
            self._fail(e, reads=True, what="open")
            return False
        with contextlib.suppress(Exception):
            self.sweep_orphans()
        return True

    def _fail(self, e: BaseException, *, reads: bool, what: str) -> None:
        """Counts a failure of the folder and pauses writes (and reads) for `retry_s`; warns once per episode."""
        self.errors += 1
        until = time.monotonic() + self.retry_s
        self._no_writes_until = until
        if reads:
            self._no_reads_until = until
        if self._episode is None:
            self.degradations += 1
            log.warning("kvfuse: disk cache at %s failed to %s (%s: %s); %s memory only, trying it again in "
                        "%.0f s", self.directory, what, type(e).__name__, e,
                        "serving from" if reads else "new entries kept in", self.retry_s)
        if reads or self._episode is None:
            self._episode = "reads" if reads else "writes"

    def _usable(self, write: bool) -> bool:
        if time.monotonic() < (self._no_writes_until if write else self._no_reads_until):
            return False
        if self._cache is None or (write and isinstance(self._cache, _ReadOnlyCache)):
            with self._mutex:
                if self._cache is None or (write and isinstance(self._cache, _ReadOnlyCache)):
                    old = self._cache
                    if not self._open():
                        return False
                    if old is not None:
                        old.close()
        return True

    def _run(self, fn: Callable[[diskcache.Cache], Any], default: Any, *, write: bool, what: str) -> Any:
        """fn(cache), or `default` when the tier is paused or the folder fails (which pauses it)."""
        if not self._usable(write):
            return default
        try:
            out = fn(self._cache)
        except UnsafeRow:
            raise
        except Exception as e:  # noqa: BLE001
            if not _is_disk_failure(e):
                raise
            if isinstance(e, diskcache.Timeout):  # another process held the database past the timeout: skip once
                self.errors += 1
                return default
            self._fail(e, reads=not write, what=what)
            return default
        if self._episode is not None and (write or self._episode == "reads") and not self.degraded:
            self._episode = None
            log.warning("kvfuse: disk cache at %s is usable again", self.directory)
        return out

    def _drop(self, name: str) -> None:
        """Deletes a bad row (and its file, if it is one the cache wrote)."""
        self.corrupt += 1
        self._run(lambda c: c.delete(name, retry=False), None, write=True, what="drop a bad row")

    # -- K/V entries -----------------------------------------------------------------------------------------
    def get(self, key: str, check: Callable[[DocKV], None] | None = None) -> DocKV | None:
        """The verified entry under `key`, or None. `check(kv)` may raise CorruptEntry (e.g. a shape the model
        can't use); a failed entry is deleted."""
        name = _KV_PREFIX + key
        try:
            blob = self._run(lambda c: c.get(name, default=None, retry=False), None, write=False, what="read")
            if blob is None:
                return None
            kv = decode_entry(key, blob, self.secret)
            if check is not None:
                check(kv)
            return kv
        except (CorruptEntry, UnsafeRow) as e:
            log.info("kvfuse: dropped a bad disk cache entry %s: %s", key[:12], e)
            self._drop(name)
            return None

    def put(self, key: str, kv: DocKV, blob: bytes | None = None) -> bool:
        """Stores an entry; `blob`: its `encode_entry` bytes when already made with this tier's secret."""
        return self._set(_KV_PREFIX + key, blob if blob is not None else encode_entry(key, kv, self.secret))

    def _set(self, name: str, blob: bytes) -> bool:
        disk: RawBytesDisk | None = self._cache._disk if self._cache is not None else None

        def write(c: diskcache.Cache) -> bool:
            try:
                return bool(c.set(name, blob, retry=False))
            except BaseException:
                # diskcache writes the file before the row: a failed insert (full disk, locked database) would
                # leave it behind
                c._disk.remove(c._disk.take_written())
                raise

        ok = self._run(write, False, write=True, what="write")
        if disk is not None:
            disk.take_written()
        return ok

    def raw_set(self, key: str, blob: bytes) -> None:
        """Writes bytes under a key unchecked (for tests that corrupt entries)."""
        self._set(_KV_PREFIX + key, blob)

    def raw_get(self, key: str) -> bytes | None:
        return self._run(lambda c: c.get(_KV_PREFIX + key, default=None, retry=False), None, write=False,
                         what="read")

    def __contains__(self, key: str) -> bool:
        return bool(self._run(lambda c: (_KV_PREFIX + key) in c, False, write=False, what="read"))

    # -- document ids ----------------------------------------------------------------------------------------
    def _id_name(self, doc_id: str) -> str:
        return f"{_ID_PREFIX}{self.id_scope}:{doc_id}"

    def get_id(self, doc_id: str) -> str | None:
        """The content key this id was last stored with (in this scope), or None."""
        name = self._id_name(doc_id)
        try:
            v = self._run(lambda c: c.get(name, default=None, retry=False), None, write=False, what="read")
        except UnsafeRow as e:
            log.info("kvfuse: dropped a bad document-id row: %s", e)
            self._drop(name)
            return None
        if v is None:
            return None
        try:
            key = v.decode("ascii") if isinstance(v, bytes) else None
        except UnicodeDecodeError:
            key = None
        if key is None or not _KEY_RE.fullmatch(key):
            self._drop(name)
            return None
        return key

    def set_id(self, doc_id: str, key: str) -> None:
        self._set(self._id_name(doc_id), key.encode("ascii"))

    def forget(self, doc_id: str, key: str | None) -> None:
        """Deletes a document's id row and, when given, its K/V entry."""
        names = [self._id_name(doc_id)] + ([_KV_PREFIX + key] if key else [])
        for name in names:
            self._run(lambda c, n=name: c.delete(n, retry=False), None, write=True, what="delete")

    # -- registrations (the engine's document index, so chat prompts fuse in a new process too) ---------------
    def _reg_prefix(self) -> str:
        return f"reg:{self.id_scope}:"

    def put_registration(self, doc_id: str, head: str, length: int, digest: bytes) -> None:
        blob = json.dumps({"head": head, "length": length, "sha256": digest.hex()}).encode("utf-8")
        self._set(self._reg_prefix() + doc_id, blob)

    def registrations(self) -> list[tuple[str, str, int, bytes]]:
        """(doc id, head, length, sha256) of every registration in this scope; bad rows are dropped."""
        db, prefix = self.directory / "cache.db", self._reg_prefix()
        if self._cache is None or not db.is_file():
            return []
        try:
            con = _read_only(db)
            if con is None:
                return []
            try:
                names = [k for (k,) in con.execute("SELECT key FROM Cache WHERE raw = 1 AND substr(key, 1, ?) = ?",
                                                   (len(prefix), prefix)) if isinstance(k, str)]
            finally:
                con.close()
        except sqlite3.Error:
            return []
        out = []
        for name in names:
            try:
                blob = self._run(lambda c, n=name: c.get(n, default=None, retry=False), None, write=False,
                                 what="read")
                row = json.loads(blob) if isinstance(blob, bytes) else None
                out.append((name[len(prefix):], row["head"], int(row["length"]), bytes.fromhex(row["sha256"])))
            except (UnsafeRow, ValueError, TypeError, KeyError):
                self._drop(name)
        return out

    def forget_registration(self, doc_id: str) -> None:
        self._run(lambda c: c.delete(self._reg_prefix() + doc_id, retry=False), None, write=True, what="delete")

    # -- housekeeping ----------------------------------------------------------------------------------------
    def orphans(self) -> list[Path]:
        """Value files in the folder that no row names (left by a writer killed between file and row)."""
        db = self.directory / "cache.db"
        if not db.is_file():
            return []
        con = _read_only(db)
        if con is None:
            return []
        try:
            named = {f.replace(os.sep, "/") for (f,) in con.execute(
                "SELECT filename FROM Cache WHERE filename IS NOT NULL") if isinstance(f, str)}
        finally:
            con.close()
        return [p for p in self.directory.glob("??/??/*.val")
                if p.relative_to(self.directory).as_posix() not in named]

    def sweep_orphans(self, min_age_s: float = 3600.0) -> int:
        """Removes orphan value files older than `min_age_s` (younger ones may be a live writer's); returns how
        many were removed."""
        removed, now = 0, time.time()
        for p in self.orphans():
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime >= min_age_s:
                    p.unlink()
                    removed += 1
        return removed

    def close(self) -> None:
        if self._cache is not None:
            with contextlib.suppress(Exception):
                self._cache.close()
