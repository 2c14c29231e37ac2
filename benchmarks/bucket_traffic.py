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


def simulate(stream, key, max_graphs: int, tail: int, capture_after: int = 2, head: int = 0) -> dict:
    """The keep/capture policy of `LayoutGraphs.run` (capture at sighting `capture_after`; when full, the least
    recently used bucket is dropped; a dropped bucket seen again is captured at once). Shares over the last `tail`
    requests, and (`head_*`) over the first `head` (an engine's start, no graphs yet)."""
    kept, seen = collections.OrderedDict(), collections.Counter()
    counts, first = collections.Counter(), collections.Counter()
    rows = 0.0
    start = len(stream) - tail
    for i, (n, m, k) in enumerate(stream):
        b = key(n, m, k)
        counted = i >= start
        if counted:
            rows += (b[1] + b[2]) / (m + k)
        if b in kept:
            kept.move_to_end(b)
            what = "replay"
        else:
            seen[b] += 1
            if seen[b] >= capture_after:
                if len(kept) >= max_graphs:
                    kept.popitem(last=False)  # LayoutGraphs.make_room: the least recently used bucket goes
                kept[b] = True
                what = "capture"
            else:
                what = "eager"
        counts[what] += counted
        first[what] += i < head
    out = {"buckets": len({key(*r) for r in stream}), **{k: counts[k] / tail for k in ("replay", "eager", "capture")},
           "rows": rows / tail}
    out.update({f"head_{k}": first[k] / max(head, 1) for k in ("replay", "eager", "capture")})
    return out


def mean_ms(r: dict, costs: dict, prefix: str = "") -> float:
    """Mean milliseconds per request of a simulation's shares at the given per-phase costs."""
    return sum(r[prefix + k] * costs[k] for k in ("replay", "eager", "capture"))


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
    ap.add_argument("--head", type=int, default=300, help="requests counted at the start (no graphs yet)")
    ap.add_argument("--costs", default="",
                    help="eager,capture,replay ms of one request (benchmarks/capture_cost.py measures them), and "
                         "optionally the capture's cost when it replays on top of its warm-up run as a fourth value: "
                         "prints the mean ms per request of each rule at the start and in steady state")
    args = ap.parse_args()
    stream = requests(args.requests, _span(args.docs), _span(args.doc_tokens), _span(args.question), args.ratio,
                      args.seed)
    defaults = inspect.signature(LayoutGraphs).parameters  # the engine's own defaults, not copies of them
    default_graphs, row_steps = defaults["max_graphs"].default, defaults["row_steps"].default
    now = f"now (a probe strategy): N {FUSED_ROW_STEPS}/oct, M {M_STEPS}/oct from {M_MIN}, K {K_STEPS}/oct, " \
        f"{default_graphs} graphs"
    rules = {
        "before: M 4/oct from 16, K 8/oct, 24 graphs": (
            lambda n, m, k: (bucket_size(n, 8, 64), bucket_size(m, 4, 16), bucket_size(k, 8, 16)), 24, 2),
        now: (lambda n, m, k: bucket_sizes("probe", n, m, k, row_steps), default_graphs,
              LayoutGraphs.capture_after_default),
        f"{now}, captured at the first sight": (lambda n, m, k: bucket_sizes("probe", n, m, k, row_steps),
                                                 default_graphs, 1),
        f"{now}, captured at the second sight": (lambda n, m, k: bucket_sizes("probe", n, m, k, row_steps),
                                                  default_graphs, 2),
    }
    costs = [float(x) for x in args.costs.split(",")] if args.costs else []
    print(f"{args.requests} requests: {args.docs} documents of {args.doc_tokens} tokens, questions of "
          f"{args.question} tokens, ratio {args.ratio}; shares over the last {args.tail} (in brackets: the first "
          f"{args.head})")
    cost_cols = " | mean ms, start / steady (warm-up answers) | (capture replays too)" if costs else ""
    print("| rules | buckets met | replay | eager | capture | computed rows / real" + cost_cols + " |")
    print("|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if costs else ""))
    for name, (key, graphs, after) in rules.items():
        r = simulate(stream, key, graphs, args.tail, after, args.head)
        line = (f"| {name} | {r['buckets']} | {r['replay']:.0%} ({r['head_replay']:.0%}) | {r['eager']:.0%} "
                f"({r['head_eager']:.0%}) | {r['capture']:.0%} ({r['head_capture']:.0%}) | {r['rows']:.3f}")
        if costs:
            c = dict(zip(("eager", "capture", "replay"), costs))
            old = {**c, "capture": costs[3] if len(costs) > 3 else c["capture"]}
            line += (f" | {mean_ms(r, c, 'head_'):.2f} / {mean_ms(r, c):.2f} | {mean_ms(r, old, 'head_'):.2f} / "
                     f"{mean_ms(r, old):.2f}")
        print(line + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
