"""An LRU model of the router test's two replica caches (tests/server/test_router.py, affinity vs round robin on a
Zipf workload): how far affinity's hit rate leads round robin's over random hash rings (random replica ports), for
the corpus-tag rule and request count the test uses. No model or server runs: documents are placed by the router's
own `HashRing`, each request goes where the router's affinity rule sends it, and each replica keeps `--cap`
documents, least recently used out.

    python benchmarks/router_affinity_model.py --requests 60 --rule first40     # the old test: lead as low as 0.015
    python benchmarks/router_affinity_model.py --requests 120 --rule most-even  # the test now
"""
from __future__ import annotations

import argparse
import random
import sys
from collections import Counter, OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
from test_router import _zipf_workload  # noqa: E402  (the test's own workload)

from kvfuse.server.router import HashRing  # noqa: E402


def hit_rate(per_replica: list[list[list[int]]], cap: int) -> float:
    hits = misses = 0
    for reqs in per_replica:
        cache: OrderedDict[int, None] = OrderedDict()
        for idx in reqs:
            for d in idx:
                if d in cache:
                    hits += 1
                    cache.move_to_end(d)
                else:
                    misses += 1
                    cache[d] = None
                    while len(cache) > cap:
                        cache.popitem(last=False)
    return hits / (hits + misses)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--rule", choices=("first40", "most-even"), default="most-even")
    ap.add_argument("--cap", type=int, default=12, help="documents each replica's cache holds")
    ap.add_argument("--rings", type=int, default=300)
    a = ap.parse_args()
    wl = _zipf_workload(40, 30, a.requests, 0)
    mentions = [d for idx in wl for d in idx]
    rr = hit_rate([wl[0::2], wl[1::2]], a.cap)
    rng, leads = random.Random(0), []
    for _ in range(a.rings):
        urls = [f"http://127.0.0.1:{rng.randint(20000, 60000)}" for _ in range(2)]
        ring = HashRing(urls)

        def skew(tag: str) -> int:
            c = Counter(ring.owner(f"{tag}-{d}") for d in mentions)
            return max(c.values()) - min(c.values()) if len(c) == 2 else len(mentions)

        tags = [f"affinity{s}" for s in range(200)]
        if a.rule == "most-even":
            tag = min(tags, key=skew)
        else:
            tag = next((t for t in tags if skew(t) <= 0.2 * len(mentions)), tags[-1])
        per = {u: [] for u in urls}
        for idx in wl:
            score = Counter(ring.owner(f"{tag}-{d}") for d in idx)
            pref = ring.preference(f"{tag}-{idx[0]}")
            per[min(urls, key=lambda u: (-score[u], pref.index(u)))].append(idx)
        leads.append(hit_rate(list(per.values()), a.cap) - rr)
    leads.sort()
    print(f"{a.requests} requests, rule {a.rule}, {a.cap} documents per cache, {a.rings} rings: round robin "
          f"{rr:.3f}; affinity's lead min {leads[0]:.3f}, 5th percentile {leads[len(leads) // 20]:.3f}, median "
          f"{leads[len(leads) // 2]:.3f}, max {leads[-1]:.3f}; under 0.05 in {sum(x < 0.05 for x in leads)} rings")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
