"""Memory stays bounded under churn: thousands of requests over ever-new documents and ids keep the KV tier
within its budget, the document-id index within its own, and the process's resident memory flat."""
from __future__ import annotations

import gc

import pytest
from cases import QUESTION


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_id_index_is_bounded(tiny_engine):
    engine = tiny_engine("llama", id_index_bytes=20_000)
    store = engine.store
    for i in range(5000):  # ids only: what a corpus-wide precompute of tiny documents records
        store._remember(f"doc-{i:06d}-" + "x" * (i % 50), f"{i:064x}")
        assert store._ids_bytes <= 20_000
    assert 0 < len(store._ids) < 200
    assert "doc-004999-" + "x" * (4999 % 50) in store._ids  # the most recent are kept


@pytest.mark.heavy
def test_budgets_and_rss_hold_over_thousands_of_requests(tiny_engine, tally):
    budget = 400_000  # a few dozen tiny documents
    engine = tiny_engine("llama", memory_budget_bytes=budget, id_index_bytes=50_000)
    common = ("common", "The Larkspur Observatory was built in 1887 on the slopes of Mount Helder.")
    rss, n = [], 2500
    for i in range(n):
        docs = [(f"u{i}-a", f"Note {i}: the lantern maker {i} lived at {i % 97} Harbour Street in Dunmore."),
                common,
                (f"u{i}-b", f"Ledger {i}: {i * 13 % 1000} lanterns were sold in the spring of year {1800 + i % 200}.")]
        r = engine.generate(QUESTION, docs, strategy="reuse" if i % 2 else "cacheblend", max_new_tokens=2)
        assert r.cache_misses >= 2
        stats = engine.cache_stats()
        assert stats["memory_bytes"] <= budget and stats["id_index_bytes"] <= 50_000
        if i % 250 == 249:
            gc.collect()
            rss.append(_rss_bytes())
    tally(None, n)
    growth = rss[-1] - rss[1]  # after the first 500 requests warmed every allocator
    print(f"churn: {n} requests, {engine.cache_stats()['evictions']} evictions, RSS {rss[1] / 2**20:.0f} -> "
          f"{rss[-1] / 2**20:.0f} MiB")
    assert growth < 24 * 2**20, [f"{x / 2**20:.0f}" for x in rss]
