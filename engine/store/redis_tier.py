"""Redis tier: verified entries in a Redis server that several engines (machines) share, never pickled.

Entries are the disk tier's bytes (`encode_entry`: magic, versioned JSON header with sha256, safetensors payload,
an HMAC when a cache secret is configured) stored as plain Redis strings. The client never asks Redis for
anything but bytes and never unpickles: everything read is untrusted input, verified by `decode_entry` and the
store's `check`; a value that fails is deleted (only if it is still the same bytes) and reported as a miss.

Keys live under one namespace per model (the cache namespace digest: model and tokenizer fingerprints, dtype,
layout version), inside a hash tag so a namespace's keys share one cluster slot:

    <prefix>:{<ns>}:kv:<content key>   an entry (TTL `ttl_s`, refreshed on every hit)
    <prefix>:{<ns>}:lru                sorted set: content key -> logical time of its last use
    <prefix>:{<ns>}:size               hash: content key -> entry bytes
    <prefix>:{<ns>}:bytes              the namespace's total entry bytes
    <prefix>:{<ns>}:clock              the logical clock (INCR; no dependence on machines' clocks)
    <prefix>:{<ns>}:id:<scope>:<id>    a document id's last content key (TTL `ttl_s`)

Budget: each put runs one Lua script that stores the entry, accounts its bytes and, while the namespace is over
`budget_bytes`, deletes its least recently used entries (gets bump the entry's time in the same round trip), so a
namespace never holds more than its budget of entries whatever the server's settings. On a server of your own,
also set `maxmemory` with `maxmemory-policy allkeys-lru` (or `volatile-lru`: entries carry a TTL) as the hard
bound of the whole server; entries the server evicts or expires are taken out of the accounting when next seen.

Failure: a server that is down, refuses, or answers slower than `timeout_s` (connect and each reply) never fails a
request. The operation is a miss (or an unstored entry), `errors` counts it, the tier pauses for `retry_s`
(every operation meanwhile is skipped at once, so a hung server costs one timeout per episode) and logs one warning
per episode; after the pause the next operation tries again. The client itself never retries.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from .entry import CorruptEntry, DocKV, decode_entry, encode_entry

__all__ = ["RedisTier", "redact_url"]

log = logging.getLogger("kvfuse.store")

_KEY_RE = re.compile(r"[0-9a-f]{64}")

# KEYS: entry, lru, size, bytes, clock. ARGV: content key, blob, budget bytes, ttl ms (0: none).
# Returns 1 when stored, 0 when the entry alone is over the budget (nothing changed).
_PUT = """
local n = string.len(ARGV[2])
local budget = tonumber(ARGV[3])
if n > budget then return 0 end
local member = ARGV[1]
local old = tonumber(redis.call('HGET', KEYS[3], member) or '0')
local ttl = tonumber(ARGV[4])
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[2])
end
redis.call('HSET', KEYS[3], member, n)
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[5]), member)
local total = redis.call('INCRBY', KEYS[4], n - old)
local base = string.sub(KEYS[1], 1, string.len(KEYS[1]) - string.len(member))
while total > budget do
  local victim = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not victim or victim == member then break end
  local size = tonumber(redis.call('HGET', KEYS[3], victim) or '0')
  redis.call('DEL', base .. victim)
  redis.call('ZREM', KEYS[2], victim)
  redis.call('HDEL', KEYS[3], victim)
  total = redis.call('INCRBY', KEYS[4], -size)
end
return 1
"""

# KEYS: entry, lru, size, bytes, clock. ARGV: content key, ttl ms. Returns the entry's bytes, nil (a miss) or 0 (a
# value of another Redis type was there: deleted). A hit bumps its time and TTL; a miss of an accounted entry
# (expired or evicted by the server) takes it out of the accounting.
_GET = """
local member = ARGV[1]
local kind = redis.call('TYPE', KEYS[1])['ok']
local blob = false
if kind == 'string' then
  blob = redis.call('GET', KEYS[1])
elseif kind ~= 'none' then
  redis.call('DEL', KEYS[1])
end
if not blob then
  local size = redis.call('HGET', KEYS[3], member)
  if size then
    redis.call('HDEL', KEYS[3], member)
    redis.call('ZREM', KEYS[2], member)
    redis.call('INCRBY', KEYS[4], -tonumber(size))
  end
  if kind ~= 'string' and kind ~= 'none' then return 0 end
  return false
end
redis.call('ZADD', KEYS[2], 'XX', redis.call('INCR', KEYS[5]), member)
local ttl = tonumber(ARGV[2])
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
return blob
"""

# KEYS: entry, lru, size, bytes. ARGV: content key, sha1 of the bytes to drop ('' drops whatever is there).
# Deletes the entry only while it still holds those bytes (another engine may have rewritten it meanwhile).
_DROP = """
local blob = redis.call('GET', KEYS[1])
if blob and ARGV[2] ~= '' and redis.sha1hex(blob) ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
local size = redis.call('HGET', KEYS[3], ARGV[1])
if size then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('INCRBY', KEYS[4], -tonumber(size))
end
return 1
"""


def redact_url(url: str) -> str:
    """The URL without its password (for logs and errors)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{host}{port}{parts.path}"
    except ValueError:
        return "<unparsable redis url>"


class RedisTier:
    """A shared tier of verified entries in Redis (see the module doc).

    Args:
        url: redis://[:password@]host:port/db, rediss://... (TLS) or unix:///path/to/socket.
        namespace: the cache namespace (e.g. `Namespace.digest`); entries of other namespaces are never seen.
        budget_bytes: bytes of entries this namespace keeps at most (least recently used beyond it are deleted).
        timeout_s: connect and reply timeout of every operation; slower means a miss.
        retry_s: how long the tier is left alone after a failure before it is tried again.
        ttl_s: entries and id rows expire this long after their last use (0: never).
        secret: signs entries (HMAC-SHA256); only entries signed with it are served.
        id_scope: namespaces the document-id rows (the engine's prompt-prefix key).
        prefix: first part of every key (to share a server with other applications).
        client: a ready `redis.Redis` (tests); by default one is made from `url` with these timeouts, no retries.

    Counters: `hits`, `corrupt` (entries dropped), `errors` (operations that failed or timed out), `degraded`
    (whether the tier is paused now), `degradations` (episodes so far).
    """

    def __init__(self, url: str, namespace: str, budget_bytes: int, *, timeout_s: float = 0.1,
                 retry_s: float = 30.0, ttl_s: float = 7 * 86400.0, secret: bytes | None = None,
                 id_scope: str = "", prefix: str = "kvfuse", client: Any = None) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ImportError("the Redis cache tier needs the redis package: pip install 'kvfuse[redis]'") from e
        if not namespace or any(c in namespace for c in "{}:"):
            raise ValueError(f"redis namespace must be a non-empty string without '{{', '}}' or ':', got "
                             f"{namespace!r}")
        self._errors_t: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.url = redact_url(url)
        self.namespace = namespace
        self.budget_bytes = int(budget_bytes)
        self.timeout_s = float(timeout_s)
        self.retry_s = float(retry_s)
        self.ttl_ms = int(ttl_s * 1000)
        self.secret = secret or None
        self.id_scope = id_scope
        self.hits = 0
        self.corrupt = 0
        self.errors = 0
        self.degradations = 0
        self._paused_until = 0.0
        self._episode = False
        self._mutex = threading.Lock()
        self.client = client if client is not None else redis.Redis.from_url(
            url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0, decode_responses=False)
        base = f"{prefix}:{{{namespace}}}:"
        self._kv_base = base + "kv:"
        self._lru, self._size, self._bytes, self._clock = (base + s for s in ("lru", "size", "bytes", "clock"))
        self._id_base = f"{base}id:{id_scope}:"
        self._put = self.client.register_script(_PUT)
        self._get = self.client.register_script(_GET)
        self._drop_script = self.client.register_script(_DROP)

    # -- failures ----------------------------------------------------------------------------------------------
    @property
    def degraded(self) -> bool:
        """Whether operations are being skipped now (after a failure, for `retry_s`)."""
        return time.monotonic() < self._paused_until

    def _run(self, fn: Callable[[], Any], default: Any, what: str) -> Any:
        """fn(), or `default` when the tier is paused or the server fails (which pauses it)."""
        if time.monotonic() < self._paused_until:
            return default
        try:
            out = fn()
        except self._errors_t as e:
            with self._mutex:
                self.errors += 1
                self._paused_until = time.monotonic() + self.retry_s
                if not self._episode:
                    self._episode = True
                    self.degradations += 1
                    log.warning("kvfuse: redis cache at %s failed to %s (%s: %s); serving from local tiers, trying "
                                "it again in %.0f s", self.url, what, type(e).__name__, e, self.retry_s)
            return default
        if self._episode:
            with self._mutex:
                if self._episode:
                    self._episode = False
                    log.warning("kvfuse: redis cache at %s is usable again", self.url)
        return out

    # -- K/V entries -------------------------------------------------------------------------------------------
    def _keys(self, key: str) -> list[str]:
        return [self._kv_base + key, self._lru, self._size, self._bytes, self._clock]

    def get_entry(self, key: str, check: Callable[[DocKV], None] | None = None) -> tuple[DocKV, bytes] | None:
        """The verified entry under `key` and its bytes, or None. `check(kv)` may raise CorruptEntry (e.g. a shape
        the model can't use); a failed entry is deleted."""
        blob = self._run(lambda: self._get(keys=self._keys(key), args=[key, self.ttl_ms]), None, "read")
        if blob is None:
            return None
        if blob == 0:
            log.info("kvfuse: dropped a redis value of another type under entry %s", key[:12])
            self.corrupt += 1
            return None
        try:
            if not isinstance(blob, bytes):
                raise CorruptEntry(f"a {type(blob).__name__} reply, not bytes")
            kv = decode_entry(key, blob, self.secret)
            if check is not None:
                check(kv)
        except CorruptEntry as e:
            log.info("kvfuse: dropped a bad redis cache entry %s: %s", key[:12], e)
            self.corrupt += 1
            sha1 = hashlib.sha1(blob).hexdigest() if isinstance(blob, bytes) else ""
            self._run(lambda: self._drop_script(keys=self._keys(key)[:4], args=[key, sha1]), None,
                      "drop a bad entry")
            return None
        self.hits += 1
        return kv, blob

    def get(self, key: str, check: Callable[[DocKV], None] | None = None) -> DocKV | None:
        got = self.get_entry(key, check)
        return None if got is None else got[0]

    def put(self, key: str, kv: DocKV, blob: bytes | None = None) -> bool:
        """Stores an entry (`blob`: its `encode_entry` bytes when already made with this tier's secret). Returns
        whether it was stored (False: over the whole budget, or the server failed)."""
        if blob is None:
            blob = encode_entry(key, kv, self.secret)
        return self.put_bytes(key, blob)

    def put_bytes(self, key: str, blob: bytes) -> bool:
        """Stores bytes under a key unchecked (entries are verified when read; tests use it to plant bad ones)."""
        args = [key, blob, self.budget_bytes, self.ttl_ms]
        return bool(self._run(lambda: self._put(keys=self._keys(key), args=args), 0, "write"))

    def raw_get(self, key: str) -> bytes | None:
        return self._run(lambda: self.client.get(self._kv_base + key), None, "read")

    def __contains__(self, key: str) -> bool:
        return bool(self._run(lambda: self.client.exists(self._kv_base + key), 0, "read"))

    def used_bytes(self) -> int:
        """The namespace's accounted entry bytes (0 when unknown)."""
        v = self._run(lambda: self.client.get(self._bytes), None, "read")
        try:
            return int(v or 0)
        except ValueError:
            return 0

    # -- document ids ------------------------------------------------------------------------------------------
    def get_id(self, doc_id: str) -> str | None:
        """The content key this id was last stored with (in this scope), or None."""
        v = self._run(lambda: self.client.get(self._id_base + doc_id), None, "read")
        try:
            key = v.decode("ascii") if isinstance(v, bytes) else None
        except UnicodeDecodeError:
            key = None
        if v is not None and (key is None or not _KEY_RE.fullmatch(key)):
            self.corrupt += 1
            self._run(lambda: self.client.delete(self._id_base + doc_id), None, "drop a bad id row")
            return None
        return key

    def set_id(self, doc_id: str, key: str) -> None:
        self._run(lambda: self.client.set(self._id_base + doc_id, key.encode("ascii"),
                                          px=self.ttl_ms or None), None, "write")

    def forget(self, doc_id: str, key: str | None) -> None:
        """Deletes a document's id row and, when given, its entry."""
        self._run(lambda: self.client.delete(self._id_base + doc_id), None, "delete")
        if key:
            self._run(lambda: self._drop_script(keys=self._keys(key)[:4], args=[key, ""]), None, "delete")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
