"""How often a bucketed prefill replays a CUDA graph under realistic RAG traffic (host arithmetic, no model).

The bucketed path (engine/bucketed.py) keys a graph by the request's shape bucket: prompt rows N, always-computed
rows M (question, chat glue), recomputed document rows K, and for qcfuse its probe view V. A bucket runs eagerly
the first time it is seen, is captured the second time (a warm-up run, the capture, then the replay) and replays
afterwards while it stays among the kept graphs. The first-sight TTFT benchmark holds the context length and the
question length fixed, so it meets one bucket; real traffic spreads over the product of the four sizes. This
script draws requests (document count, document lengths, question length), computes each one's bucket with the
engine's own `bucket_size` and step constants, runs the keep/capture policy, and prints, over the last requests
of the stream (steady state), the share that replays, runs eagerly or pays a capture, and the computed rows
(M + K buckets) over the real ones. Rules compared: the ones before this change (8/4/8 steps, 24 graphs) and the
engine's current ones.

    python benchmarks/bucket_traffic.py [--requests 3000] [--docs 3-10] [--doc-tokens 128-1024] [--question 10-120]

Model of a request: a 30-token prefix, the documents, the question and 20 tokens of chat glue; the first document
is exact (not a candidate), K = round(ratio * document tokens) capped at the candidates.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import random
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after site-packages: see kvfuse/__init__.py


def _span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def requests(count: int, docs: tuple[int, int], doc_tokens: tuple[int, int], question: tuple[int, int],
             ratio: float, seed: int) -> list[tuple[int, int, int]]:
    """[(n, m, k)] of a random request stream."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        lens = [rng.randint(*doc_tokens) for _ in range(rng.randint(*docs))]
        m = rng.randint(*question) + 20
        n = 30 + sum(lens) + m
        k = min(sum(lens[1:]), round(ratio * sum(lens)))
        out.append((n, m, k))
    return out


def simulate(stream, key, max_graphs: int, tail: int) -> dict:
    """The keep/capture policy of `LayoutGraphs.run` (capture at the second sight; when full, the least recently
    used bucket is dropped; a dropped bucket seen again is captured at once)."""
    kept, seen = collections.OrderedDict(), collections.Counter()
    counts = collections.Counter()
    rows = 0.0
    start = len(stream) - tail
    for i, (n, m, k) in enumerate(stream):
        b = key(n, m, k)
        counted = i >= start
        if counted:
            rows += (b[1] + b[2]) / (m + k)
        if b in kept:
            kept.move_to_end(b)
            counts["replay"] += counted
            continue
        seen[b] += 1
        if seen[b] >= 2:
            if len(kept) >= max_graphs:
                kept.popitem(last=False)  # LayoutGraphs.make_room: the least recently used bucket goes
            kept[b] = True
            counts["capture"] += counted
        else:
            counts["eager"] += counted
    return {"buckets": len({key(*r) for r in stream}), **{k: counts[k] / tail for k in ("replay", "eager", "capture")},
            "rows": rows / tail}


def main() -> int:
    from kvfuse.engine.bucketed import (FUSED_ROW_STEPS, K_STEPS, M_MIN, M_STEPS, LayoutGraphs, bucket_size,
                                        bucket_sizes)

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--tail", type=int, default=1000, help="requests counted at the end of the stream")
    ap.add_argument("--docs", default="3-10")
    ap.add_argument("--doc-tokens", default="128-1024")
    ap.add_argument("--question", default="10-120", help="question tokens")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    stream = requests(args.requests, _span(args.docs), _span(args.doc_tokens), _span(args.question), args.ratio,
                      args.seed)
    defaults = inspect.signature(LayoutGraphs).parameters  # the engine's own defaults, not copies of them
    default_graphs, row_steps = defaults["max_graphs"].default, defaults["row_steps"].default
    rules = {
        "before: M 4/oct from 16, K 8/oct, 24 graphs": (
            lambda n, m, k: (bucket_size(n, 8, 64), bucket_size(m, 4, 16), bucket_size(k, 8, 16)), 24),
        f"now (a probe strategy): N {FUSED_ROW_STEPS}/oct, M {M_STEPS}/oct from {M_MIN}, K {K_STEPS}/oct, "
        f"{default_graphs} graphs": (lambda n, m, k: bucket_sizes("probe", n, m, k, row_steps),
            default_graphs),
    }
    print(f"{args.requests} requests: {args.docs} documents of {args.doc_tokens} tokens, questions of "
          f"{args.question} tokens, ratio {args.ratio}; shares over the last {args.tail}")
    print("| rules | buckets met | replay | eager | capture | computed rows / real |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (key, graphs) in rules.items():
        r = simulate(stream, key, graphs, args.tail)
        print(f"| {name} | {r['buckets']} | {r['replay']:.0%} | {r['eager']:.0%} | {r['capture']:.0%} | "
              f"{r['rows']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
