"""The shared Redis tier, against a real redis-server: an entry one engine (or process) computed is served to
another from Redis; anything planted in Redis (random bytes, a pickle, a truncated entry, another model's shape, an
unsigned entry) is rejected, counted, deleted and recomputed, never unpickled; a Redis killed or hung under
running engines costs a local miss (bounded by the timeout), one warning and a `redis_errors` count, and the tier
recovers after a restart; a namespace stays under its byte budget; models never see each other's entries.

Answers are compared with an engine that has no Redis tier: same tokens, same log-probabilities to the bit."""
from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import time

import pytest
import torch
from cases import DOCS, QUESTION
from reliability_fs import OTHER, OTHER_Q, ask_exact, store_warnings

from kvfuse.engine.config import EngineConfig
from kvfuse.engine.store import DocKV, content_key, decode_entry, encode_entry
from kvfuse.engine.types import Document

# Redis reply timeout of the engines here (the default is 0.1 s): a loaded test machine must not turn a hit into
# a timeout; the tests of a hung server set their own.
PATIENT = 2.0



class _Exploit:
    """Unpickling this creates the marker folder: proof that code from the cache ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _key(engine, doc) -> str:
    return content_key(engine.namespace, engine.prompts.prefix_ids, engine.prompts.encode_document(Document(*doc)))


def _entries(server, engine) -> dict[bytes, int]:
    """Entry key -> bytes of every entry in the engine's namespace on the server."""
    c = server.client()
    return {k: c.strlen(k) for k in c.scan_iter(match=engine.store.remote._kv_base + "*")}


# -- sharing ---------------------------------------------------------------------------------------------------
def test_entry_of_engine_a_is_served_to_engine_b(tiny_engine, reference, redis_server, redis_url):
    a = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT)
    ask_exact(a, reference)
    assert a.cache_stats()["misses"] == 3 and a.cache_stats()["redis_hits"] == 0
    b = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT)  # empty memory, no disk: only Redis has them
    r = ask_exact(b, reference)
    s = b.cache_stats()
    assert s["redis_hits"] == 3 and s["misses"] == 0 and r.cache_hits == 3
    assert s["redis_errors"] == 0 and s["corrupt"] == 0
    ask_exact(b, reference)  # now served from memory
    assert b.cache_stats()["redis_hits"] == 3


def test_redis_hit_fills_memory_and_disk(tiny_engine, reference, redis_server, redis_url, tmp_path):
    a = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT)
    ask_exact(a, reference)
    b = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT, disk_cache_dir=tmp_path / "kv")
    ask_exact(b, reference)
    assert b.cache_stats()["redis_hits"] == 3
    redis_server.flush()  # Redis forgets everything: the disk tier filled on the way back serves a new engine
    c = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT, disk_cache_dir=tmp_path / "kv")
    ask_exact(c, reference)
    s = c.cache_stats()
    assert s["disk_hits"] == 3 and s["redis_hits"] == 0 and s["misses"] == 0


def test_precompute_in_another_process_then_serve(tiny_model, redis_server, redis_url, tmp_path):
    """`kvfuse precompute --redis-url` in its own process; a from_pretrained(..., redis_url=) engine with no disk
    tier serves every document from Redis, answering exactly as a cold engine."""
    from kvfuse.engine.api import FusionEngine

    model = str(tiny_model("llama"))
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in DOCS), encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, "-m", "kvfuse.cli", "precompute", str(docs), "--model", model, "--device",
                        "cpu", "--dtype", "fp32", "--cache-dir", str(tmp_path / "a"), "--redis-url", redis_url,
                        "--no-progress"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "3 computed" in p.stdout and redis_url.split("//")[1].split("/")[0] in p.stdout
    served = FusionEngine.from_pretrained(model, device="cpu", dtype="fp32", disk_cache=False, redis_url=redis_url,
                                           redis_timeout_s=PATIENT)
    cold = FusionEngine.from_pretrained(model, device="cpu", dtype="fp32", disk_cache=False)
    try:
        r = served.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=4, return_logprobs=True)
        ref = cold.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=4, return_logprobs=True)
        assert served.cache_stats()["redis_hits"] == 3 and served.cache_stats()["misses"] == 0
        assert cold.cache_stats()["misses"] == 3
        assert r.token_ids == ref.token_ids
        torch.testing.assert_close(r.extra["logprobs"], ref.extra["logprobs"], rtol=0, atol=0)
    finally:
        served.close()
        cold.close()


def test_forget_reaches_redis(tiny_engine, reference, redis_server, redis_url):
    a = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT)
    ask_exact(a, reference)
    b = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT)  # never saw the ids: learns them from Redis
    assert b.forget(["larkspur"]) == 1
    c = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT)
    ask_exact(c, reference)
    assert c.cache_stats()["redis_hits"] == 2 and c.cache_stats()["misses"] == 1


# -- planted and damaged entries ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["random", "pickle", "truncated", "other_shape", "other_key", "empty",
                                  "other_type"])
def test_bad_entry_is_rejected_deleted_and_recomputed(tiny_engine, reference, redis_server, redis_url, tmp_path,
                                                      kind, tally):
    a = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT)
    ask_exact(a, reference)
    key = _key(a, DOCS[0])
    name = a.store.remote._kv_base + key
    c = redis_server.client()
    good = c.get(name)
    marker = tmp_path / "pwned"
    spec = a.decoder.spec
    bad = {
        "random": os.urandom(len(good)),
        "pickle": pickle.dumps(_Exploit(str(marker))),
        "truncated": good[: len(good) // 2],
        # a well-formed, checksummed entry under this key, of a shape this model can't use
        "other_shape": encode_entry(key, DocKV(torch.zeros(spec.n_layers + 1, 5, spec.n_kv_heads, 2 * spec.head_dim),
                                               torch.zeros(spec.n_layers + 1, 5, spec.n_kv_heads, 2 * spec.head_dim))),
        "other_key": c.get(a.store.remote._kv_base + _key(a, DOCS[1])),  # another document's (valid) entry
        "empty": b"",
        "other_type": None,
    }[kind]
    if kind == "other_type":  # a hash where the entry should be: dropped, not an error of the tier
        c.delete(name)
        c.hset(name, "k", pickle.dumps(_Exploit(str(marker))))
    else:
        c.set(name, bad)
    b = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT)
    ask_exact(b, reference)
    s = b.cache_stats()
    tally(None, 0, executed=int(marker.exists()))
    assert not marker.exists(), "a pickle from Redis was loaded"
    assert s["corrupt"] == 1 and s["redis_hits"] == 2 and s["misses"] == 1 and s["redis_errors"] == 0
    decode_entry(key, c.get(name))  # the recomputed entry replaced the bad one
    assert c.get(name) == good


def test_entries_unsigned_or_signed_with_another_secret_are_refused(tiny_engine, reference, redis_server,
                                                                    redis_url):
    a = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT)  # unsigned
    ask_exact(a, reference)
    b = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT, cache_secret="s3cret")
    ask_exact(b, reference)
    assert b.cache_stats()["corrupt"] == 3 and b.cache_stats()["redis_hits"] == 0
    c = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT, cache_secret="other")
    ask_exact(c, reference)
    assert c.cache_stats()["corrupt"] == 3
    d = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT, cache_secret="other")
    ask_exact(d, reference)
    assert d.cache_stats()["redis_hits"] == 3 and d.cache_stats()["corrupt"] == 0


def test_bad_id_row_is_dropped(tiny_engine, reference, redis_server, redis_url):
    a = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT)
    ask_exact(a, reference)
    c = redis_server.client()
    rows = list(c.scan_iter(match=a.store.remote._id_base + "*"))
    assert len(rows) == 3
    for row in rows:
        c.set(row, pickle.dumps({"x": 1}))
    b = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT)
    ask_exact(b, reference)
    assert b.cache_stats()["redis_hits"] == 3 and b.cache_stats()["corrupt"] == 3
    assert all(c.get(row) is None or len(c.get(row)) == 64 for row in rows)


# -- a Redis that is down or hung --------------------------------------------------------------------------------
def test_killed_redis_is_a_local_miss_then_recovers(tiny_engine, reference, own_redis, caplog):
    url = own_redis.url
    a = tiny_engine("llama", redis_url=url, redis_timeout_s=PATIENT, redis_retry_s=0.5)
    ask_exact(a, reference)
    own_redis.kill()
    with caplog.at_level(logging.WARNING, logger="kvfuse.store"):
        ask_exact(a, reference, OTHER_Q, OTHER)  # misses computed; their writes to Redis fail
        b = tiny_engine("llama", redis_url=url, redis_timeout_s=PATIENT, redis_retry_s=0.5)
        for _ in range(3):
            ask_exact(b, reference)
            time.sleep(0.3)
        sa, sb = a.cache_stats(), b.cache_stats()
        assert sa["redis_errors"] >= 1 and sb["redis_errors"] >= 1
        assert sb["misses"] == 3 and sb["redis_hits"] == 0
        assert len(store_warnings(caplog)) == 2  # one per engine (episode)
        assert all("failed" in w and "trying it again" in w for w in store_warnings(caplog))
        own_redis.start()  # the same port, empty
        time.sleep(0.6)
        ask_exact(b, reference, OTHER_Q, OTHER)  # computed, and stored in Redis again
        assert any("usable again" in w for w in store_warnings(caplog))
    assert b.cache_stats()["redis_degraded"] == 0
    c = tiny_engine("llama", redis_url=url, redis_timeout_s=PATIENT)
    ask_exact(c, reference, OTHER_Q, OTHER)
    assert c.cache_stats()["redis_hits"] == 3 and c.cache_stats()["redis_errors"] == 0


def test_redis_down_at_start_never_fails(tiny_engine, reference, own_redis):
    url = own_redis.url
    own_redis.kill()
    e = tiny_engine("llama", redis_url=url)  # built without contacting the server
    ask_exact(e, reference)
    ask_exact(e, reference, OTHER_Q, OTHER)
    s = e.cache_stats()
    assert s["redis_errors"] >= 1 and s["redis_degraded"] == 1 and s["redis_hits"] == 0


def test_hung_redis_costs_one_timeout(tiny_engine, reference, own_redis, caplog, tally):
    url = own_redis.url
    a = tiny_engine("llama", redis_url=url, redis_timeout_s=PATIENT)
    ask_exact(a, reference)
    cold = tiny_engine("llama")
    t0 = time.monotonic()
    cold.generate(OTHER_Q, OTHER, strategy="reuse", max_new_tokens=4)
    cold_s = time.monotonic() - t0
    own_redis.pause()  # accepts connections, never answers
    try:
        b = tiny_engine("llama", redis_url=url, redis_timeout_s=0.1, redis_retry_s=60)
        t0 = time.monotonic()
        ask_exact(b, reference)
        hung_s = time.monotonic() - t0
        ask_exact(b, reference, OTHER_Q, OTHER)
        s = b.cache_stats()
        assert s["redis_errors"] == 1 and s["redis_degraded"] == 1  # one timeout, then the tier is skipped
        assert s["misses"] == 6
        # the hung server adds about one timeout; the margin absorbs a busy machine
        tally(None, 0, hangs=int(hung_s > cold_s + 3.0))
        assert hung_s < cold_s + 3.0, (hung_s, cold_s)
        tier = b.store.remote
        tier._paused_until = 0.0  # as after the pause: the next operation tries the server again
        t0 = time.monotonic()
        assert tier.get(_key(b, DOCS[0])) is None
        assert time.monotonic() - t0 < 0.1 + 0.5
        assert tier.errors == 2
    finally:
        own_redis.resume()


# -- budget and namespaces ---------------------------------------------------------------------------------------
def _kv(seed: int, tokens: int = 16) -> DocKV:
    g = torch.Generator().manual_seed(seed)
    return DocKV(torch.randn(2, tokens, 2, 8, generator=g), torch.randn(2, tokens, 2, 8, generator=g))


def _tier(url, namespace, budget, **kw):
    from kvfuse.engine.store.redis_tier import RedisTier

    return RedisTier(url, namespace, budget, **kw)


def test_budget_evicts_least_recently_used_of_the_namespace(redis_server, redis_url):
    size = len(encode_entry("0" * 64, _kv(0)))
    t = _tier(redis_url, "nsa", 4 * size + size // 2)  # four entries fit
    keys = [f"{i:064x}" for i in range(10)]
    for i, k in enumerate(keys[:4]):
        assert t.put(k, _kv(i))
    assert t.get(keys[0]) is not None  # used: now the most recent
    for i, k in enumerate(keys[4:], start=4):
        assert t.put(k, _kv(i))
        c = redis_server.client()
        real = sum(c.strlen(n) for n in c.scan_iter(match="kvfuse:{nsa}:kv:*"))
        assert real == t.used_bytes() <= t.budget_bytes
    kept = [k for k in keys if k in t]
    assert kept == keys[-4:]
    t2 = _tier(redis_url, "nsa", 4 * size + size // 2)
    for i, k in enumerate(keys[:4]):
        t2.put(k, _kv(i))
    t2.get(keys[0])
    t2.put(keys[4], _kv(4))
    assert keys[0] in t2 and keys[1] not in t2  # the hit kept keys[0]; the least recently used went
    assert not t.put("f" * 64, _kv(99, tokens=400))  # one entry over the whole budget is not stored
    assert "f" * 64 not in t


def test_engine_namespace_stays_under_budget(tiny_engine, redis_server, redis_url):
    docs = [(f"d{i}", f"Document number {i} tells of the harbour town of Dunmore and its lighthouse keeper, who "
                      f"counted {i * 7} ships in the year {1800 + i}.") for i in range(12)]
    probe = tiny_engine("llama")
    probe.precompute(docs[:1])
    one = probe.store.memory.get(_key(probe, docs[0])).nbytes
    budget = int(3.5 * one)
    e = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT, redis_budget_bytes=budget)
    e.precompute(docs)
    entries = _entries(redis_server, e)
    assert 0 < len(entries) < len(docs) and sum(entries.values()) <= budget
    assert e.store.remote.used_bytes() == sum(entries.values())
    assert e.store.remote._kv_base.encode() + _key(e, docs[-1]).encode() in entries  # the newest is kept


def test_entries_deleted_by_the_server_leave_the_accounting(redis_server, redis_url):
    t = _tier(redis_url, "nsx", 1 << 20)
    k = "1" * 64
    t.put(k, _kv(1))
    assert t.used_bytes() > 0
    redis_server.client().delete("kvfuse:{nsx}:kv:" + k)  # as maxmemory eviction or expiry would
    assert t.get(k) is None and t.used_bytes() == 0


def test_ttl_is_set_and_refreshed(redis_server, redis_url):
    t = _tier(redis_url, "nst", 1 << 20, ttl_s=100)
    k = "2" * 64
    t.put(k, _kv(2))
    c = redis_server.client()
    c.pexpire("kvfuse:{nst}:kv:" + k, 5000)
    assert t.get(k) is not None
    assert c.pttl("kvfuse:{nst}:kv:" + k) > 90_000
    t0 = _tier(redis_url, "nsn", 1 << 20, ttl_s=0)
    t0.put(k, _kv(2))
    assert c.pttl("kvfuse:{nsn}:kv:" + k) == -1


def test_namespaces_never_see_each_other(tiny_engine, redis_server, redis_url):
    a, b = _tier(redis_url, "nsa", 1 << 20), _tier(redis_url, "nsb", 3000)
    k = "3" * 64
    a.put(k, _kv(3))
    assert b.get(k) is None and k not in b
    for i in range(10):  # b over its budget evicts only its own entries
        b.put(f"{i:064x}", _kv(i))
    assert k in a and a.get(k) is not None

    llama = tiny_engine("llama", redis_url=redis_url, redis_timeout_s=PATIENT)
    qwen = tiny_engine("qwen2", redis_url=redis_url, redis_timeout_s=PATIENT)
    llama.precompute(DOCS)
    qwen.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=2)
    assert qwen.cache_stats()["redis_hits"] == 0 and qwen.cache_stats()["corrupt"] == 0
    assert llama.store.remote._kv_base != qwen.store.remote._kv_base
    assert len(_entries(redis_server, llama)) == len(_entries(redis_server, qwen)) == 4  # 3 documents + prefix
    qwen2 = tiny_engine("qwen2", redis_url=redis_url, redis_timeout_s=PATIENT)
    qwen2.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=2)
    assert qwen2.cache_stats()["redis_hits"] == 3


# -- configuration ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [dict(redis_url="http://h:1/0"), dict(redis_url="redis://"), dict(redis_url=""),
                                 dict(redis_url="redis://h:port/0"), dict(redis_url="unix://"),
                                 dict(redis_url="redis://h", redis_timeout_s=0),
                                 dict(redis_url="redis://h", redis_budget_bytes=-1),
                                 dict(redis_url="redis://h", redis_retry_s=-1)])
def test_config_rejects_bad_redis_settings(bad):
    with pytest.raises(ValueError, match="redis_"):
        EngineConfig(**bad)


def test_config_accepts_redis_urls():
    for url in ("redis://h:6379/0", "rediss://:pw@h:6380/1", "unix:///tmp/r.sock"):
        assert EngineConfig(redis_url=url).redis_url == url


def test_cli_rejects_a_bad_redis_url_before_loading(tiny_model, tmp_path, capsys):
    from kvfuse.cli import main

    docs = tmp_path / "d.jsonl"
    docs.write_text(json.dumps({"id": "a", "text": "some text"}) + "\n", encoding="utf-8")
    assert main(["precompute", str(docs), "--model", str(tiny_model("llama")), "--redis-url",
                 "http://:secret@h/0"]) == 2
    err = capsys.readouterr().err
    assert "--redis-url" in err and "secret" not in err
