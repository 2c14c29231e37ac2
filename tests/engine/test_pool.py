"""The pooled (in-place, zero-copy) KV tier: allocator, equivalence with the host tier, and safety under
eviction pressure."""
from __future__ import annotations

import pytest
import torch
from cases import DOCS, QUESTION

from kvfuse.engine import sources
from kvfuse.engine.store.pool import KVPool


def test_pool_allocator_first_fit_and_merge():
    pool = KVPool(2, 1, 4, doc_rows=10, scratch_rows=4, dtype=torch.float32, device="cpu")
    a, b, c = pool.alloc(3), pool.alloc(3), pool.alloc(3)
    assert (a, b, c) == (0, 3, 6) and pool.alloc(2) is None and pool.free_rows == 1
    pool.free(b, 3)
    assert pool.alloc(4) is None  # 3 + 1 free rows, not contiguous
    pool.free(c, 3)
    assert pool.free_rows == 7 and pool.alloc(7) == 3  # freed neighbours merged into one range
    assert pool.scratch_start == 10


def test_a_pool_that_would_not_fit_is_refused_before_allocating(monkeypatch):
    """On a GPU the pool's rows are checked against the free memory first (RESERVE_SHARE of the device kept for
    prefills): a clear OutOfMemoryError naming the knobs, not a failed allocation."""
    from kvfuse.engine.store import pool as pool_mod

    row = 2 * 2 * 1 * 4 * 4  # K and V, 2 layers, 1 head, head_dim 4, fp32
    monkeypatch.setattr(pool_mod, "_device_memory", lambda device: (1000 * row, 2000 * row))  # free, total
    pool_mod.check_fits(899, row, "cpu")  # 1000 free less 5% of 2000 = 900 rows of room
    pool_mod.check_fits(900, row, "cpu")
    with pytest.raises(torch.OutOfMemoryError, match="901 rows") as err:
        pool_mod.check_fits(901, row, "cpu")
    assert "about 900 rows fit" in str(err.value) and "memory_budget_bytes" in str(err.value)
    allocated = []
    monkeypatch.setattr(pool_mod.torch, "empty", lambda *a, **k: allocated.append(a) or torch.zeros(()))
    with pytest.raises(torch.OutOfMemoryError, match="decode_tokens"):
        KVPool(2, 1, 4, doc_rows=800, scratch_rows=200, dtype=torch.float32, device="cpu")
    assert allocated == []  # neither pool tensor was asked for


def test_an_engine_too_large_for_its_gpu_fails_clearly_at_construction(tiny_engine, monkeypatch):
    from kvfuse.engine.store import pool as pool_mod

    monkeypatch.setattr(pool_mod, "_device_memory", lambda device: (1 << 20, 1 << 30))  # 1 MiB free
    with pytest.raises(torch.OutOfMemoryError, match="memory_budget_bytes"):
        tiny_engine("llama3", kv_tier="pool", memory_budget_bytes=64 << 20, scratch_tokens=512)


def test_fit_rows_shrinks_the_automatic_decode_rows_then_the_documents(monkeypatch, caplog):
    from kvfuse.engine.store import pool as pool_mod

    row = 64
    monkeypatch.setattr(pool_mod, "_device_memory", lambda device: (1000 * row + 100 * row, 2000 * row))  # room 1000
    fit = pool_mod.fit_rows
    assert fit(300, 400, 200, row, "cpu", min_rows=100, shrink_decode=True) == (300, 400)  # 900 fits
    with caplog.at_level("WARNING", logger="kvfuse.engine"):
        assert fit(300, 800, 200, row, "cpu", min_rows=100, shrink_decode=True) == (300, 500)  # decode first
    assert "decode rows" in caplog.text and "memory_budget_bytes" in caplog.text
    assert fit(900, 800, 200, row, "cpu", min_rows=100, shrink_decode=True) == (700, 100)  # then the documents
    assert fit(300, 800, 200, row, "cpu", min_rows=100, shrink_decode=False) == (100, 800)  # decode_tokens was set
    assert fit(300, 800, 950, row, "cpu", min_rows=100, shrink_decode=True) == (100, 100)  # left to check_fits
    monkeypatch.setattr(pool_mod, "_device_memory", lambda device: None)  # not a GPU: as asked
    assert fit(300, 800, 950, row, "cpu", min_rows=100, shrink_decode=True) == (300, 800)


def test_an_engine_is_sized_to_the_gpu_it_finds(tiny_engine, monkeypatch):
    """The default decode rows that would not fit a (faked) small GPU are shrunk to one context window, and the
    engine then serves what an unshrunk engine serves."""
    from kvfuse.engine.store import pool as pool_mod

    plain = tiny_engine("llama3", kv_tier="pool", memory_budget_bytes=1 << 20, scratch_tokens=512)
    p = plain.decoding.arena.pool
    window = min(plain.context_window, 32768)
    room = p.doc_rows + p.scratch_rows - window // 2  # the default decode rows (two windows) do not fit
    free = -(-room * p.row_bytes * 100 // 95)
    monkeypatch.setattr(pool_mod, "_device_memory", lambda device: (free, free))
    small = tiny_engine("llama3", kv_tier="pool", memory_budget_bytes=1 << 20, scratch_tokens=512)
    q = small.decoding.arena.pool
    assert q.doc_rows + q.scratch_rows <= room and q.doc_rows < p.doc_rows
    assert q.doc_rows >= window  # one longest request still fits
    a = plain.generate(QUESTION, DOCS, strategy="infoflow", recompute_ratio=0.3, max_new_tokens=6)
    b = small.generate(QUESTION, DOCS, strategy="infoflow", recompute_ratio=0.3, max_new_tokens=6)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
@pytest.mark.parametrize("strategy,ratio", [("reuse", 0.0), ("cacheblend", 0.3), ("epic", 0.2)])
def test_pooled_tier_equals_host_tier(family, strategy, ratio, tiny_engine, monkeypatch):
    host = tiny_engine(family, kv_tier="host")
    pooled = tiny_engine(family, kv_tier="pool", memory_budget_bytes=64 << 20, scratch_tokens=512)
    used = []
    real = sources.make_source
    monkeypatch.setattr("kvfuse.engine.runner.make_source",
                        lambda *a, **k: used.append(real(*a, **k)) or used[-1])
    a = host.generate(QUESTION, DOCS, strategy=strategy, recompute_ratio=ratio, max_new_tokens=5,
                      return_logprobs=True)
    b = pooled.generate(QUESTION, DOCS, strategy=strategy, recompute_ratio=ratio, max_new_tokens=5,
                        return_logprobs=True)
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(a.extra["logprobs"], b.extra["logprobs"], rtol=1e-5, atol=1e-5)
    b2 = pooled.generate(QUESTION, DOCS, strategy=strategy, recompute_ratio=ratio, max_new_tokens=5)
    assert b2.cache_hits == len(DOCS) and b2.token_ids == a.token_ids
    assert isinstance(used[-1], sources.PooledSource)  # warm pooled request: documents used in place


def test_pool_under_pressure_never_serves_overwritten_rows(tiny_engine):
    """A pool that holds about two documents: a three-document request must still be exact (its own
    entries are held, so nothing it uses is evicted and overwritten mid-request)."""
    host = tiny_engine("llama", kv_tier="host")
    probe = tiny_engine("llama", kv_tier="pool", memory_budget_bytes=64 << 20, scratch_tokens=512)
    spec = probe.decoder.spec
    row = 2 * spec.n_layers * spec.n_kv_heads * spec.head_dim * 4
    doc_len = max(len(probe.prompts.encode_document(__import__("kvfuse.engine.types", fromlist=["x"])
                                                     .Document(i, t))) for i, t in DOCS)
    prefix = len(probe.prompts.prefix_ids)
    small = tiny_engine("llama", kv_tier="pool", memory_budget_bytes=(prefix + 2 * doc_len + 4) * row,
                        scratch_tokens=512)
    for _ in range(2):
        a = host.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=4, return_logprobs=True)
        b = small.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=4, return_logprobs=True)
        torch.testing.assert_close(a.extra["logprobs"], b.extra["logprobs"], rtol=1e-5, atol=1e-5)
    other = [(f"o{i}", f"Unrelated note number {i} about tides, ferries and harbour lights.") for i in range(3)]
    small.generate(QUESTION, other, strategy="reuse", max_new_tokens=2)  # churn the pool
    b = small.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=4, return_logprobs=True)
    torch.testing.assert_close(a.extra["logprobs"], b.extra["logprobs"], rtol=1e-5, atol=1e-5)
    assert small.cache_stats()["evictions"] > 0


def test_share_rows_fills_the_card_to_its_share(monkeypatch):
    """Whatever is held now (weights, other processes) counts against the share; the decode and scratch rows are
    taken from it before the documents'."""
    from kvfuse.engine.store import pool as pool_mod

    row = 64
    monkeypatch.setattr(pool_mod, "_device_memory", lambda device: (600 * row, 1000 * row))  # 400 rows in use
    assert pool_mod.share_rows(0.9, row, "cpu", other_rows=100) == 900 - 400 - 100
    assert pool_mod.share_rows(1.0, row, "cpu", other_rows=0) == 600
    assert pool_mod.share_rows(0.3, row, "cpu", other_rows=0) == 0  # more than the share is in use already
    monkeypatch.setattr(pool_mod, "_device_memory", lambda device: None)
    assert pool_mod.share_rows(0.9, row, "cpu", other_rows=100) is None  # not a GPU


def test_an_engine_grows_its_document_rows_to_the_gpu_share(tiny_engine, monkeypatch):
    """With gpu_memory_share on a (faked) GPU the documents get every row the share leaves beside the decode and
    scratch rows, whatever memory_budget_bytes says, and the memory tier's budget is those rows; the engine then
    serves what a plain one serves."""
    from kvfuse.engine.store import pool as pool_mod

    plain = tiny_engine("llama3", kv_tier="pool", memory_budget_bytes=1 << 20, scratch_tokens=512)
    p = plain.decoding.arena.pool
    rb = p.row_bytes
    other = p.doc_rows - (1 << 20) // rb + p.scratch_rows  # decode + scratch rows of that engine
    total, used = 40000 * rb, 3000 * rb
    monkeypatch.setattr(pool_mod, "_device_memory", lambda device: (total - used, total))
    big = tiny_engine("llama3", kv_tier="pool", memory_budget_bytes=1 << 20, scratch_tokens=512,
                      gpu_memory_share=0.5)
    q = big.decoding.arena.pool
    assert q.doc_rows + q.scratch_rows == 20000 - 3000  # the card at half its memory once the pool is made
    docs = q.doc_rows - (other - p.scratch_rows)
    assert docs == 20000 - 3000 - other and docs * rb > 1 << 20
    assert big.store.memory.budget == docs * rb
    a = plain.generate(QUESTION, DOCS, strategy="infoflow", recompute_ratio=0.3, max_new_tokens=6)
    b = big.generate(QUESTION, DOCS, strategy="infoflow", recompute_ratio=0.3, max_new_tokens=6)
    assert a.token_ids == b.token_ids
    # a share already used up leaves one longest request's rows (then the usual fitting, here: it fits)
    monkeypatch.setattr(pool_mod, "_device_memory", lambda device: (total // 2, total))
    small = tiny_engine("llama3", kv_tier="pool", memory_budget_bytes=1 << 20, scratch_tokens=512,
                        gpu_memory_share=0.1)
    assert small.store.memory.budget == min(small.context_window, 32768) * rb


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5, float("nan"), True, "0.5"])
def test_a_bad_gpu_memory_share_is_refused(share):
    from kvfuse.engine.config import EngineConfig

    with pytest.raises(ValueError, match="gpu_memory_share"):
        EngineConfig(gpu_memory_share=share)


def test_a_slab_is_one_range_when_it_can_be_and_scattered_when_not():
    from kvfuse.engine.decode import Arena, Slab

    pool = KVPool(1, 1, 4, doc_rows=40, scratch_rows=4, dtype=torch.float32, device="cpu")
    evicted = []
    arena = Arena(pool, evict=lambda: evicted.append(1) and False)  # nothing to evict
    parts = [pool.alloc(5) for _ in range(7)]  # rows 1-35 (the dummy row is 0), 4 free at the end
    for start in parts[::2]:
        pool.free(start, 5)  # holes of 5 rows: 4 of them, and the 4 at the end
    assert pool.free_rows == 24
    one = arena.alloc(5)
    assert one.ranges == ((1, 5),)
    slab = arena.alloc(12)  # no hole that long: three ranges, nothing evicted
    assert slab.size == 12 and len(slab.ranges) == 3 and not evicted
    assert slab.rows("cpu").tolist() == [*range(11, 16), *range(21, 26), *range(31, 33)]
    assert arena.alloc(8) is None and evicted  # 7 free in all: eviction asked, nothing freed, refused
    head, tail = slab.split(7)
    assert head.rows("cpu").tolist() == slab.rows("cpu")[:7].tolist() and tail.size == 5
    assert slab.split(0)[0].size == 0 and slab.split(12)[1] == Slab(())
    arena.free(slab)
    arena.free(one)
    assert pool.free_rows == 24


def test_a_fragmented_arena_still_serves_a_long_request(tiny_engine):
    """Free rows scattered in holes shorter than the prompt: the request takes several ranges (before, it needed one
    contiguous range and failed, or evicted documents to make one) and answers as an unfragmented engine does."""
    plain = tiny_engine("qwen2", kv_tier="pool", memory_budget_bytes=1 << 20, scratch_tokens=512)
    frag = tiny_engine("qwen2", kv_tier="pool", memory_budget_bytes=1 << 20, scratch_tokens=512)
    pool = frag.decoding.arena.pool
    kw = dict(strategy="cacheblend", recompute_ratio=0.3, max_new_tokens=6)
    frag.precompute(DOCS)
    n = frag.layout(QUESTION, DOCS).n
    taken = []
    while True:  # fill the arena with blocks of 16 rows, then free every other one: no hole of n rows is left
        start = pool.alloc(16)
        if start is None:
            break
        taken.append(start)
    for start in taken[::2]:
        pool.free(start, 16)
    assert pool.alloc(n) is None and pool.free_rows > n + 6
    docs_before = len(frag.store.memory)
    a, b = plain.generate(QUESTION, DOCS, **kw), frag.generate(QUESTION, DOCS, **kw)
    assert a.token_ids == b.token_ids and b.cache_hits == len(DOCS)
    assert len(frag.store.memory) == docs_before  # no document evicted to make room
    free = pool.free_rows
    for start in taken[1::2]:
        pool.free(start, 16)
    assert pool.free_rows == free + 16 * len(taken[1::2])  # the request gave its rows back
