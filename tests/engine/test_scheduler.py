"""The scheduler: many requests decoded together give each the tokens it gets alone; cancellation, admission,
queue bounds, one physical copy of shared documents, pins against eviction, shutdown, asyncio."""
from __future__ import annotations

import asyncio
import itertools
import threading

import pytest
import torch

from kvfuse.engine.types import EngineOverloaded

from cases import DOCS, QUESTION

LONG = [("l1", "The western ridge holds three abandoned copper mines, worked from 1820 until the floods of 1871. "
               "Miners walked from Esk each morning along the river path."),
        ("l2", "Larkspur's first director, Mara Quill, was born in Esk and trained as a surveyor before astronomy.")]

# (strategy, ratio, documents, question, max_new_tokens): mixed strategies, lengths and answer lengths
REQUESTS = [
    ("full", 1.0, DOCS, QUESTION, 12),
    ("reuse", 0.0, DOCS[:2], "Who founded it?", 7),
    ("cacheblend", 0.3, DOCS + LONG, QUESTION, 15),
    ("epic", 0.2, LONG, "Where was Mara Quill born?", 9),
    ("infoflow", 0.15, DOCS[1:] + LONG[:1], "What was mined?", 11),
]


def _solo(engine, req):
    strategy, ratio, docs, question, n = req
    return engine.generate(question, docs, strategy=strategy, recompute_ratio=ratio, max_new_tokens=n).token_ids


def _together(engine, reqs):
    """All requests in flight at once (each stream started before any is drained); tokens per request."""
    streams = [engine.stream(q, d, strategy=s, recompute_ratio=r, max_new_tokens=n) for s, r, d, q, n in reqs]
    firsts = [next(s, None) for s in streams]  # submits each; the scheduler admits one per decode step
    del firsts
    for s in streams:
        for _ in s:
            pass
    return [s.result.token_ids for s in streams]


@pytest.mark.parametrize("tier", ["host", "pool"])
def test_batched_equals_single_in_any_arrival_order(tiny_engine, tier):
    engine = tiny_engine("llama", kv_tier=tier, memory_budget_bytes=32 << 20)
    engine.precompute(DOCS)  # some documents cached before, the others computed by the requests themselves
    solo = [_solo(engine, r) for r in REQUESTS]
    for order in [range(len(REQUESTS)), [4, 2, 0, 3, 1], [1, 3, 4, 0, 2]]:
        order = list(order)
        got = _together(engine, [REQUESTS[i] for i in order])
        assert got == [solo[i] for i in order]
    stats = engine.serving_stats()
    assert stats["peak_batch_size"] >= 3, stats  # they really were decoded together
    assert stats["running"] == 0 and stats["queued"] == 0
    assert not engine.store.memory.pins  # every pin released


def test_batched_equals_single_across_families(tiny_engine):
    for family in ("qwen2", "mistral"):
        engine = tiny_engine(family)
        solo = [_solo(engine, r) for r in REQUESTS[:3]]
        assert _together(engine, REQUESTS[:3]) == solo


def test_sampled_requests_keep_their_own_seeds_in_a_batch(tiny_engine):
    engine = tiny_engine("llama")
    kw = dict(max_new_tokens=10, temperature=0.9, top_p=0.95)
    solo = [engine.generate(QUESTION, DOCS, seed=s, **kw).token_ids for s in (1, 2, 3)]
    streams = [engine.stream(QUESTION, DOCS, seed=s, **kw) for s in (1, 2, 3)]
    for s in streams:
        next(s, None)
    for s in streams:
        list(s)
    assert [s.result.token_ids for s in streams] == solo


def test_one_physical_copy_of_shared_documents(tiny_engine):
    """With the pool tier a document's rows are read in place by every request: a reuse request owns private
    rows only for what it computed (prefix glue, question, answer), never for the documents."""
    engine = tiny_engine("llama", kv_tier="pool", memory_budget_bytes=32 << 20)
    engine.precompute(DOCS)
    host = tiny_engine("llama", kv_tier="host")
    pool = engine.decoding.arena.pool
    free_before = pool.free_rows
    streams = [engine.stream(QUESTION, DOCS, strategy="reuse", max_new_tokens=6) for _ in range(3)]
    for s in streams:
        next(s)
    with engine.scheduler.exclusive():  # between two steps: all three are decoding
        seqs = [r.seq for r in engine.scheduler.running]
        layout = engine.layout(QUESTION, DOCS)
        assert len(seqs) == 3
        for sq in seqs:
            assert sq.shared_rows >= layout.doc_tokens  # documents (and the cached prefix) read in place
        private = sum(sq.slab.size for sq in seqs)
        assert free_before - pool.free_rows == private
        assert private < 3 * layout.n  # a copy per request would need 3 x n rows at least
    for s in streams:
        list(s)
    want = host.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=6).token_ids
    assert all(s.result.token_ids == want for s in streams)
    assert pool.free_rows == free_before


def test_pinned_documents_survive_eviction_pressure(tiny_engine):
    """While a request decodes over pooled documents, a flood of new documents can't evict their rows."""
    engine = tiny_engine("llama", kv_tier="pool", memory_budget_bytes=1 << 20)
    want = tiny_engine("llama").generate(QUESTION, DOCS[:2], strategy="reuse", max_new_tokens=12).token_ids
    engine.precompute(DOCS[:2])
    s = engine.stream(QUESTION, DOCS[:2], strategy="reuse", max_new_tokens=12)
    next(s)
    flood = [(f"f{i}", f"Filler document number {i} about nothing in particular, repeated. " * 3) for i in range(40)]
    engine.precompute(flood)  # more than the pool holds: evicts everything it may
    assert engine.cache_stats()["evictions"] > 0
    list(s)
    assert s.result.token_ids == want


def test_cancel_frees_the_slot_at_once(tiny_engine):
    engine = tiny_engine("llama")
    pool = engine.decoding.arena.pool
    free_before = pool.free_rows
    long = engine.stream(QUESTION, DOCS, max_new_tokens=200, stop=["\x00never"])
    other = engine.stream("Who founded it?", DOCS[:1], max_new_tokens=5)
    next(long)
    long.close()
    assert long.result.finish_reason in ("cancelled", "stop")
    assert engine.serving_stats()["running"] == 0
    assert "".join(other) == engine.generate("Who founded it?", DOCS[:1], max_new_tokens=5).text
    assert pool.free_rows == free_before


def test_dropped_stream_is_cancelled(tiny_engine):
    import gc

    engine = tiny_engine("llama")
    s = engine.stream(QUESTION, DOCS, max_new_tokens=300)
    next(s)
    del s
    gc.collect()
    done = threading.Event()

    def ok():
        engine.generate("Who founded it?", DOCS[:1], max_new_tokens=3)
        done.set()

    threading.Thread(target=ok, daemon=True).start()
    assert done.wait(60)
    assert engine.serving_stats()["running"] == 0


def test_queue_bound_refuses_with_overloaded(tiny_engine):
    engine = tiny_engine("llama", max_queued_requests=1, max_batch_size=1)
    with engine.scheduler.exclusive():  # the scheduler can't take anything off the queue meanwhile
        first = engine.stream(QUESTION, DOCS, max_new_tokens=3)
        first._start()
        second = engine.stream(QUESTION, DOCS, max_new_tokens=3)
        with pytest.raises(EngineOverloaded) as err:
            next(second)
        assert err.value.retry_after_s > 0
    assert list(first) and first.result.finish_reason in ("stop", "length")


def test_admission_waits_for_rows_instead_of_failing(tiny_engine):
    """An arena that fits one request at a time: the others wait for rows and all finish, in order of arrival."""
    engine = tiny_engine("llama", decode_tokens=200)
    want = _solo(engine, ("full", 1.0, DOCS, QUESTION, 20))
    outs = _together(engine, [("full", 1.0, DOCS, QUESTION, 20)] * 3)
    assert outs == [want] * 3
    assert engine.serving_stats()["peak_batch_size"] == 1
    too_big = engine.stream(QUESTION, DOCS + LONG, max_new_tokens=150)
    with pytest.raises(RuntimeError, match="KV rows"):
        list(too_big)


def test_shutdown_finishes_in_flight_then_refuses(tiny_engine):
    engine = tiny_engine("llama")
    s = engine.stream(QUESTION, DOCS, max_new_tokens=8)
    next(s)
    engine.shutdown(timeout=30)
    rest = list(s)
    assert s.result is not None and s.result.finish_reason in ("stop", "length")
    assert rest is not None
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(QUESTION, DOCS, max_new_tokens=2)


def test_asyncio_requests_run_together(tiny_engine):
    engine = tiny_engine("llama")
    solo = [_solo(engine, r) for r in REQUESTS]

    async def main():
        return await asyncio.gather(*[engine.agenerate(q, d, strategy=s, recompute_ratio=r, max_new_tokens=n)
                                      for s, r, d, q, n in REQUESTS])

    results = asyncio.run(main())
    assert [r.token_ids for r in results] == solo

    async def streamed():
        st = engine.astream(QUESTION, DOCS, max_new_tokens=6)
        return "".join([d async for d in st]), st.result

    text, res = asyncio.run(streamed())
    assert text == res.text
    assert res.token_ids == engine.generate(QUESTION, DOCS, max_new_tokens=6).token_ids


def test_closing_a_stream_twice_at_once_never_hangs(tiny_engine):
    """Two closers of one stream (a server's shutdown and the response's own end, or two threads) both return:
    the end of the request reaches every reader, not only the one that took it from the queue."""
    engine = tiny_engine("llama")

    async def two_acloses():
        st = engine.astream(QUESTION, DOCS, max_new_tokens=200)
        assert await anext(st)
        await asyncio.wait_for(asyncio.gather(st.aclose(), st.aclose()), 60)
        await asyncio.wait_for(st.aclose(), 5)  # and once more, after the end
        return st

    st = asyncio.run(two_acloses())
    assert st.result is not None and st.result.finish_reason == "cancelled"

    s = engine.stream(QUESTION, DOCS, max_new_tokens=200)
    next(s)
    closers = [threading.Thread(target=s.close, daemon=True) for _ in range(2)]
    for t in closers:
        t.start()
    for t in closers:
        t.join(60)
    assert not any(t.is_alive() for t in closers), "a close() never returned"
    assert s.result is not None and s.result.finish_reason == "cancelled"
    assert list(s) == []


def test_a_process_exits_cleanly_after_requests(tmp_path):
    """The scheduler thread ends with the interpreter: no abort at exit, even with a stream left open."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    script = tmp_path / "run.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(tests)!r})\n"
        "import fixtures\n"
        "from cases import DOCS, QUESTION\n"
        "m, t, i = fixtures.load_tiny('llama', dtype=torch.float32)\n"
        "e = fixtures.engine_from(m, t, i)\n"
        "print(len(e.generate(QUESTION, DOCS, max_new_tokens=4).token_ids))\n"
        "s = e.stream(QUESTION, DOCS, max_new_tokens=200)\n"
        "next(s)\n")  # exits with the stream still decoding
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "terminate called" not in out.stderr


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama3"])
def test_incremental_detokenizer_equals_a_full_decode(family):
    """The scheduler's per-token text (the tokenizers library's incremental decoder) equals a full decode of the
    same tokens, multi-byte characters split across tokens included; a tokenizer without a fast backend falls
    back to full decodes."""
    from fixtures import load_tiny

    from kvfuse.engine.scheduler import _Detokenizer

    _, tok, _ = load_tiny(family, dtype=torch.float32)
    for text in ["The observatory was built in 1887 — née Café ☃ 日本語 🎉.", "  two spaces\n\nand\ttabs", "x" * 40]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        d = _Detokenizer(tok)
        seen = [d.add(t) for t in ids]
        assert d.stream is not None
        assert seen[-1] == tok.decode(ids, skip_special_tokens=True)
        assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))  # text only grows: deltas are never taken back

    class Plain:  # no fast backend
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    d = _Detokenizer(Plain())
    assert d.stream is None and [d.add(t) for t in (5, 6)][-1] == "5 6"


def _collected(ref, seconds: float = 10.0) -> bool:
    """Whether the object behind `ref` is garbage-collected within `seconds` (the scheduler thread may hold it to
    the end of the iteration that served the last request)."""
    import gc
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        gc.collect()
        if ref() is None:
            return True
        time.sleep(0.02)
    return False


def test_an_engine_its_user_drops_is_freed_and_its_thread_ends():
    """The scheduler's thread holds its engine weakly between iterations: an engine that served requests and is
    then dropped (never closed) is collected with its KV pool, and the thread ends. It used to live on in the
    thread's frame, so every engine a process ever made kept its pool (on a GPU, until memory ran out)."""
    import weakref

    from fixtures import engine_from, load_tiny

    model, tok, info = load_tiny("llama", dtype=torch.float32)
    engine = engine_from(model, tok, info, kv_tier="pool")
    for s, r, d, q, n in REQUESTS[:3]:
        engine.generate(q, d, strategy=s, recompute_ratio=r, max_new_tokens=n)
    thread = engine.scheduler._thread
    assert thread is not None and thread.is_alive()
    ref, pool = weakref.ref(engine), weakref.ref(engine.store.memory.pool.k)
    del engine
    assert _collected(ref), "the dropped engine is still alive"
    assert _collected(pool), "its KV pool is still alive"
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_process_that_drops_an_engine_and_exits_at_once_exits_cleanly(tmp_path):
    """The thread of a collected engine ends on its own; the interpreter's exit waits for it (a thread still
    tearing down while the interpreter finalised aborted the process: exit status 134)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent.parent
    script = tmp_path / "drop.py"
    script.write_text(
        "import gc, sys\n"
        f"sys.path.insert(0, {str(here)!r})\n"
        "import torch\n"
        "from fixtures import engine_from, load_tiny\n"
        "from cases import DOCS, QUESTION\n"
        "model, tok, info = load_tiny('llama', dtype=torch.float32)\n"
        "e = engine_from(model, tok, info, kv_tier='pool')\n"
        "e.generate(QUESTION, DOCS, strategy='infoflow', recompute_ratio=0.3, max_new_tokens=3)\n"
        "del e\n"
        "gc.collect()\n"
        "print('dropped')\n")
    for _ in range(3):  # the abort depended on timing: it hit most runs
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert done.returncode == 0 and "dropped" in done.stdout, done.stderr[-2000:]
