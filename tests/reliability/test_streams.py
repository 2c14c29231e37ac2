"""Streams never hold the engine for their reader.

A stream computes on a worker thread into a queue; the engine lock is held for the request's own compute only.
Covered: a stream abandoned mid-way (still referenced) doesn't block the next request on the same thread; a
dropped or closed stream cancels its request early and frees the engine; a slow reader doesn't delay another
thread's request; worker exceptions reach the reader; concurrent threads and processes get exactly the serial
answers. Each blocking step runs under a join timeout, so a regression fails instead of hanging the suite.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from reliability_fs import CASE_OF_FILE, row
from cases import DOCS, QUESTION

pytestmark = pytest.mark.timeout(600)

TESTS_DIR = Path(__file__).resolve().parents[1]


def in_thread(fn, timeout: float = 120.0):
    """fn() on another thread; fails (instead of hanging) when it does not finish within `timeout` seconds."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised below, on the test's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    row(CASE_OF_FILE["test_streams.py"])["hangs"] += int(t.is_alive())
    assert not t.is_alive(), f"still blocked after {timeout} s: the engine is stuck"
    if "error" in box:
        raise box["error"]
    return box["value"]


def lock_is_free(engine, timeout: float = 30.0) -> bool:
    if not engine.scheduler.lock.acquire(timeout=timeout):
        return False
    engine.scheduler.lock.release()
    return True


def count_decode_steps(monkeypatch, engine, delay: float = 0.0) -> list[int]:
    """Wraps the batched decode step: records each call's batch size (and sleeps `delay` seconds in it, to make
    decoding slow)."""
    calls: list[int] = []
    inner = engine.decoding.step

    def step(seqs, tokens):
        calls.append(len(tokens))
        if delay:
            time.sleep(delay)
        return inner(seqs, tokens)

    monkeypatch.setattr(engine.decoding, "step", step)
    return calls


def wait_idle(engine, timeout: float = 30.0) -> None:
    """Waits until the scheduler runs no request (a cancelled one leaves at the next decode step)."""
    end = time.monotonic() + timeout
    while engine.serving_stats()["running"] or engine.serving_stats()["queued"]:
        assert time.monotonic() < end, "a request is still running"
        time.sleep(0.01)


def test_abandoned_stream_does_not_block_the_next_request_on_the_same_thread(tiny_engine):
    engine = tiny_engine("qwen2")
    engine.eos_ids = set()  # decode to max_new_tokens: deltas are sure to come
    ref = engine.generate(QUESTION, DOCS, max_new_tokens=10)

    def abandon_then_generate():
        s = engine.stream(QUESTION, DOCS, max_new_tokens=10)
        first = ""
        for first in s:  # the reader stops early but keeps the stream referenced
            break
        r = engine.generate(QUESTION, DOCS, max_new_tokens=10)  # deadlocked when the stream held the lock
        return s, first, r

    s, first, r = in_thread(abandon_then_generate)
    assert first and r.token_ids == ref.token_ids and r.text == ref.text
    rest = in_thread(lambda: "".join(s))  # nothing was lost: the abandoned stream still reads to its end
    assert first + rest == ref.text and s.result.token_ids == ref.token_ids
    assert s.result.finish_reason == "length"

    # the same, with another thread waiting on the engine while this one holds the half-read stream
    s = engine.stream(QUESTION, DOCS, max_new_tokens=10)
    assert in_thread(lambda: next(s))
    other = in_thread(lambda: engine.generate(QUESTION, DOCS[1:], max_new_tokens=4))
    assert other.token_ids and lock_is_free(engine, timeout=5)
    s.close()


def test_dropped_stream_is_cancelled_and_frees_the_engine(tiny_engine, monkeypatch):
    engine = tiny_engine("llama")
    engine.eos_ids = set()
    ref = engine.generate(QUESTION, DOCS, max_new_tokens=6)
    max_new = 200
    calls = count_decode_steps(monkeypatch, engine, delay=0.02)  # a full run would take max_new - 1 steps (~4 s)

    def drop():
        s = engine.stream(QUESTION, DOCS, max_new_tokens=max_new)
        for _ in s:
            break
        del s
        gc.collect()
        return lock_is_free(engine)  # the worker holds the lock until it ends: now it ended

    assert in_thread(drop)
    wait_idle(engine)
    assert len(calls) < 20, f"{len(calls)} decode steps: the dropped stream was not cancelled"
    monkeypatch.undo()
    assert engine.generate(QUESTION, DOCS, max_new_tokens=6).token_ids == ref.token_ids  # engine state intact


def test_closed_stream_is_cancelled_at_the_next_decode_step(tiny_engine, monkeypatch):
    engine = tiny_engine("llama")
    engine.eos_ids = set()
    calls = count_decode_steps(monkeypatch, engine, delay=0.02)
    s = engine.stream(QUESTION, DOCS, max_new_tokens=200, return_logprobs=True)
    first = in_thread(lambda: next(s))
    in_thread(s.close, timeout=30)
    stats = engine.serving_stats()  # close() waited until the request left the batch, its rows given back
    assert stats["running"] == 0 and stats["pool_rows_used"] == 1  # the arena's dummy row only
    r = s.result
    assert r is not None and r.finish_reason == "cancelled" and r.text.startswith(first)
    assert 1 <= len(r.token_ids) < 20 and len(calls) < 20 and "logprobs" not in r.extra
    with pytest.raises(StopIteration):
        next(s)
    s.close()  # idempotent

    # closed before its first next(): nothing is computed at all
    prefills = []
    monkeypatch.setattr(engine.runner, "prefill", lambda *a, **k: prefills.append(1))
    never = engine.stream(QUESTION, DOCS, max_new_tokens=4)
    never.close()
    with pytest.raises(StopIteration):
        next(never)
    assert never.result is None and not prefills


def test_slow_reader_does_not_delay_another_threads_request(tiny_engine):
    engine = tiny_engine("qwen2")
    engine.eos_ids = set()
    other_q = "Who founded the Quillon Lantern Festival?"
    ref = engine.generate(QUESTION, DOCS, max_new_tokens=40)
    ref_other = engine.generate(other_q, DOCS[1:], max_new_tokens=8)

    s = engine.stream(QUESTION, DOCS, max_new_tokens=40)
    parts: list[str] = []
    started = threading.Event()

    def slow_reader():
        for d in s:
            parts.append(d)
            started.set()
            time.sleep(0.15)

    reader = threading.Thread(target=slow_reader, daemon=True)
    reader.start()
    assert started.wait(60)
    t0 = time.perf_counter()
    other = in_thread(lambda: engine.generate(other_q, DOCS[1:], max_new_tokens=8), timeout=60)
    waited = time.perf_counter() - t0
    unread = reader.is_alive() and s.result is None
    assert unread, f"the other request finished only after the slow reader was done ({waited:.1f} s)"
    assert other.token_ids == ref_other.token_ids
    reader.join(120)
    assert not reader.is_alive()
    assert "".join(parts) == ref.text and s.result.token_ids == ref.token_ids and len(parts) > 5


def test_worker_exception_reaches_the_reader_after_the_earlier_deltas(tiny_engine, monkeypatch):
    engine = tiny_engine("llama")
    engine.eos_ids = set()
    ref = engine.generate(QUESTION, DOCS, max_new_tokens=8)
    inner, steps = engine.decoding.step, []

    def failing_step(seqs, tokens):
        steps.append(1)
        if len(steps) == 4:
            raise RuntimeError("boom in decode step 4")
        return inner(seqs, tokens)

    monkeypatch.setattr(engine.decoding, "step", failing_step)
    s = engine.stream(QUESTION, DOCS, max_new_tokens=8)
    got: list[str] = []

    def read():
        with pytest.raises(RuntimeError, match="boom in decode step 4"):
            for d in s:
                got.append(d)
        with pytest.raises(StopIteration):
            next(s)

    in_thread(read)
    assert got and ref.text.startswith("".join(got))  # the deltas before the failure came first
    assert s.result is None and lock_is_free(engine, timeout=5)

    # a failure before the first delta (in prefill) is raised by the first next()
    monkeypatch.setattr(engine.runner, "prefill", lambda *a, **k: (_ for _ in ()).throw(KeyError("no prefill")))
    s = engine.stream(QUESTION, DOCS, max_new_tokens=8)
    with pytest.raises(KeyError, match="no prefill"):
        in_thread(lambda: next(s))
    assert lock_is_free(engine, timeout=5)
    monkeypatch.undo()
    assert engine.generate(QUESTION, DOCS, max_new_tokens=8).token_ids == ref.token_ids


REQUESTS = [
    (QUESTION, DOCS, dict(strategy="reuse")),
    ("Who founded the Quillon Lantern Festival?", DOCS[1:], dict(strategy="cacheblend")),
    ("Where was Amelia Voss born?", [DOCS[2], DOCS[0]], dict(strategy="full")),
    (QUESTION, DOCS[::-1], dict(strategy="cacheblend", recompute_ratio=0.3)),
]


def test_threads_sharing_one_engine_get_the_serial_answers(tiny_engine):
    serial = tiny_engine("qwen2")
    refs = [serial.generate(q, d, max_new_tokens=12, **kw) for q, d, kw in REQUESTS]
    engine = tiny_engine("qwen2")
    n, rounds = len(REQUESTS), 3
    barrier = threading.Barrier(n)
    results: dict[tuple[int, int], tuple[str, list[int]]] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        q, d, kw = REQUESTS[i]
        try:
            barrier.wait(30)
            for k in range(rounds):
                if (i + k) % 2:  # streams and plain generates interleave
                    s = engine.stream(q, d, max_new_tokens=12, **kw)
                    text = "".join(s)
                    results[i, k] = (text, s.result.token_ids)
                else:
                    r = engine.generate(q, d, max_new_tokens=12, **kw)
                    results[i, k] = (r.text, r.token_ids)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    row(CASE_OF_FILE["test_streams.py"])["hangs"] += sum(t.is_alive() for t in threads)
    assert not any(t.is_alive() for t in threads), "a client thread is stuck"
    assert not errors, errors
    for (i, k), (text, ids) in results.items():
        assert ids == refs[i].token_ids and text == refs[i].text, (i, k)
    assert len(results) == n * rounds


_CHILD = r"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from fixtures import load_tiny
from kvfuse.engine.api import FusionEngine
from kvfuse.engine.config import EngineConfig

cache_dir, me, question, docs = sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
model, tok, info = load_tiny("llama", dtype=torch.float32)
engine = FusionEngine(model, tok, EngineConfig(disk_cache_dir=cache_dir), model_name=info.name,
                      model_fingerprint=info.fingerprint, tokenizer_fingerprint=info.tokenizer_fingerprint)
sync = Path(cache_dir).parent
(sync / f"ready-{me}").touch()
deadline = time.time() + 300
while not (sync / "go").exists():
    assert time.time() < deadline, "never told to go"
    time.sleep(0.01)
first = engine.generate(question, docs, strategy="reuse", max_new_tokens=8)
engine.precompute(docs)
second = engine.generate(question, docs[::-1], strategy="cacheblend", max_new_tokens=8)
engine.close()
print(json.dumps({"first": first.token_ids, "second": second.token_ids,
                  "hits": first.cache_hits, "misses": first.cache_misses}))
"""

EXTRA_DOCS = [
    ("helder", "Mount Helder rises above the harbour of Dunmore; its slopes were cleared for the observatory road."),
    ("carvel", "Carvel University was founded in 1802 and taught mathematics, astronomy and navigation."),
    ("lantern", "Each spring the lantern makers of Quillon compete for the Reyes prize for the finest glass."),
]


def test_processes_sharing_one_disk_cache_get_the_single_process_answers(tiny_engine, tmp_path):
    cache_dir = tmp_path / "kv"
    pool = DOCS + EXTRA_DOCS
    sets = [[pool[i] for i in idx] for idx in ([0, 1, 2, 3], [2, 3, 4, 0], [4, 5, 0, 2])]  # overlapping
    single = tiny_engine("llama")
    want = [(single.generate(QUESTION, d, strategy="reuse", max_new_tokens=8).token_ids,
             single.generate(QUESTION, d[::-1], strategy="cacheblend", max_new_tokens=8).token_ids) for d in sets]

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    errs = [tmp_path / f"stderr-{i}" for i in range(len(sets))]
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(TESTS_DIR), str(cache_dir), str(i), QUESTION,
                               json.dumps(d)], stdout=subprocess.PIPE, stderr=errs[i].open("w"), text=True, env=env)
             for i, d in enumerate(sets)]
    try:
        deadline = time.time() + 300
        while not all((tmp_path / f"ready-{i}").exists() for i in range(len(sets))):
            assert time.time() < deadline, "the child processes never got ready"
            assert all(p.poll() is None for p in procs), [e.read_text()[-2000:] for e in errs]
            time.sleep(0.05)
        (tmp_path / "go").touch()  # all at once: they race on the same entries
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, e in zip(procs, errs):
        assert p.returncode == 0, e.read_text()[-3000:]
    got = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    for g, (first, second), d in zip(got, want, sets):
        assert g["first"] == first and g["second"] == second
        assert g["hits"] + g["misses"] == len(d)

    # every entry the three processes wrote reads back intact
    union = list(dict.fromkeys(pool[i] for i in (0, 1, 2, 3, 4, 5)))
    fresh = tiny_engine("llama", disk_cache_dir=cache_dir)
    rep = fresh.precompute(union)
    stats = fresh.cache_stats()
    assert (rep.hits, rep.misses, rep.tokens) == (len(union), 0, 0)
    assert stats["disk_hits"] == len(union) and stats["corrupt"] == 0
    for d, (first, second) in zip(sets, want):
        assert fresh.generate(QUESTION, d, strategy="reuse", max_new_tokens=8).token_ids == first
