"""Where fused answers part from full prefill's, and what a guard (GenerationOptions.guard_margin) would do.

Pass 1 (`--out F`, resumable): for each example, full prefill and each strategy answer greedily with their
per-token log-probabilities; one JSON line per (example, strategy) with the answer's token ids and the top-2 gap
(nats) of every token. Pass 2 (always, from F): for each strategy, the token where its answer first departs from
full's (by id) and that token's gap, then the guard simulated for a list of margins: it trips at the first token
whose gap is below the margin; tripping at or before the departure makes the answer full prefill's (greedy, same
prefix), tripping after it leaves the fused answer. Printed: fidelity (F1 to full's answer), the share of answers
handed over (and at the first token), and the mean TTFT relative to full's (fused TTFT, plus full's when the guard
trips at the first token; mid-answer hand-overs cost decode time, not TTFT).

    python benchmarks/guard_margins.py --data ../shared/data --datasets 2wikimqa,hotpotqa,musique --limit 20 \\
        --strategies infoflow,prophetkv,cacheblend --out runs/guard_margins.jsonl
    python benchmarks/guard_margins.py --out docs/quality/guard/margins.jsonl      # pass 2 only, from the file

`--eval-records` reads a `kvfuse eval --guard` records file instead and prints, per slice of the seeded order
(`--slices 0:20,20:40`) and guarded label, the mean (TTFT + decode) over full's, the answers handed over, and the
guard replayed on the first token only (a hand-over at token 0 is kept, a later one is undone: the unguarded
answer), which is what `guard_tokens=1` gives:

    python benchmarks/guard_margins.py --eval-records docs/quality/guard/records.jsonl --data ../shared/data
"""
from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

MARGINS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)


def probe(args) -> None:
    from kvfuse.evaluation.data import load_examples
    from kvfuse.evaluation.runner import load_engine

    out = Path(args.out)
    done = set()
    if out.exists():
        done = {(r["id"], r["strategy"]) for r in map(json.loads, out.read_text().splitlines())}
    engine = load_engine(args.model, device=args.device, adapter=args.adapter)
    examples = load_examples(args.data, datasets=args.datasets.split(","), limit=args.limit)
    with out.open("a") as f:
        for ex in examples:
            engine.precompute(ex.docs)  # untimed: every strategy's TTFT is a warm cache's
            for strat in ["full"] + args.strategies.split(","):
                if (ex.id, strat) in done:
                    continue
                r = engine.generate(ex.question, ex.docs, strategy=strat, recompute_ratio=args.ratio,
                                    max_new_tokens=args.max_new_tokens, temperature=0.0, return_logprobs=True)
                top = r.extra["logprobs"].float().topk(2, dim=-1).values
                f.write(json.dumps({"id": ex.id, "dataset": ex.dataset, "strategy": strat,
                                    "ids": [int(t) for t in r.token_ids], "answer": r.text,
                                    "margin": (top[:, 0] - top[:, 1]).tolist(), "ttft": r.ttft_s,
                                    "prompt_tokens": r.prompt_tokens, "time": time.strftime("%H:%M:%S")}) + "\n")
                f.flush()


def departure(full: dict, fused: dict) -> int | None:
    """The first answer position where the fused tokens differ from full's (an end counts), None if equal."""
    a, b = full["ids"], fused["ids"]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def simulate(path: str, margins=MARGINS) -> str:
    from kvfuse.evaluation.metrics import fidelity

    by = collections.defaultdict(dict)
    for r in map(json.loads, Path(path).read_text().splitlines()):
        by[r["id"]][r["strategy"]] = r
    lines = []
    strategies = sorted({s for v in by.values() for s in v} - {"full"})
    for s in strategies:
        pairs = [(v["full"], v[s]) for v in by.values() if "full" in v and s in v]
        if not pairs:
            continue
        full_ttft = sum(f["ttft"] for f, _ in pairs) / len(pairs)
        parts = collections.Counter()
        gaps = []
        for f, g in pairs:
            d = departure(f, g)
            if d is not None:
                parts["at first token" if d == 0 else "later"] += 1
                if d < len(g["margin"]):
                    gaps.append(g["margin"][d])
        gaps.sort()
        before = [x for f, g in pairs for i, x in enumerate(g["margin"])
                  if (d := departure(f, g)) is None or i < d]  # the fused tokens that agree with full's
        low = {t: sum(x < t for x in before) / max(1, len(before)) for t in (0.5, 1.0)}
        lines.append(f"== {s}: {len(pairs)} answers, {sum(parts.values())} part from full's "
                     f"({parts['at first token']} at the first token); the fused gap where they part, sorted: "
                     f"{' '.join(f'{x:.2f}' for x in gaps)}; of the {len(before)} tokens before any departure, "
                     f"{low[0.5]:.1%} have a gap below 0.5 and {low[1.0]:.1%} below 1")
        lines.append("| guard (nats) | fidelity | equal to full's | handed over | at the first token | TTFT / full |")
        lines.append("|---:|---:|---:|---:|---:|---:|")
        for m in (0.0, *margins):
            fid = same = over = first = ttft = 0.0
            for f, g in pairs:
                d = departure(f, g)
                t = next((i for i, x in enumerate(g["margin"]) if x < m), None)
                ttft += g["ttft"] + (f["ttft"] if t == 0 else 0.0)
                over += t is not None
                first += t == 0
                if t is not None and (d is None or t <= d):
                    fid, same = fid + 1.0, same + 1
                else:
                    fid += fidelity(g["answer"], f["answer"])
                    same += d is None
            n = len(pairs)
            lines.append(f"| {'none' if m == 0 else m} | {100 * fid / n:.1f} | {100 * same / n:.1f}% | "
                         f"{100 * over / n:.1f}% | {100 * first / n:.1f}% | {ttft / n / full_ttft:.2f} |")
    return "\n".join(lines)


def eval_records(path: str, data: str, slices: str) -> str:
    from kvfuse.evaluation.data import load_examples

    recs = {(r["example_id"], r["strategy"]): r for r in map(json.loads, Path(path).read_text().splitlines())}
    datasets = sorted({r["dataset"] for r in recs.values()})
    labels = sorted({s for _, s in recs if "+guard" in s})
    lines = []
    for sl in slices.split(","):
        a, b = (int(x) for x in sl.split(":"))
        exs = load_examples(data, datasets=datasets, skip=a, limit=b - a)
        for label in labels:
            plain = label.split("+guard")[0]
            per = collections.defaultdict(lambda: collections.defaultdict(float))
            for e in exs:
                f, u, g = (recs.get((e.id, s)) for s in ("full", plain, label))
                if f is None or u is None or g is None:
                    continue
                d = per[e.dataset]
                at = g.get("guard_escalated_at")
                first = g if at == 0 else u
                d["n"] += 1
                d["handed"] += at is not None
                d["at0"] += at == 0
                d["fid"] += g["fidelity"]
                d["fid1"] += first["fidelity"]
                d["fidu"] += u["fidelity"]
                for key, r in (("", g), ("1", first), ("u", u), ("f", f)):
                    d["ttft" + key] += r["ttft_s"]
                    d["total" + key] += r["ttft_s"] + r["decode_s"]
            if not per:
                continue
            m = lambda k: sum(d[k] / d["n"] for d in per.values()) / len(per)  # noqa: E731  macro over sets
            r = lambda k: sum(d[k] / d[k[:-1] + "f" if k.endswith(("1", "u")) else k + "f"]  # noqa: E731
                              for d in per.values()) / len(per)
            lines.append(
                f"examples {a + 1}-{b}, {label}: handed over {m('handed'):.0%} ({m('at0'):.0%} at the first token); "
                f"fidelity {100 * m('fid'):.1f} (unguarded {100 * m('fidu'):.1f}); "
                f"TTFT / full {r('ttft'):.2f}, (TTFT + decode) / full {r('total'):.2f} (unguarded {r('ttftu'):.2f}, "
                f"{r('totalu'):.2f}); first token only: fidelity {100 * m('fid1'):.1f}, TTFT / full {r('ttft1'):.2f}, "
                f"(TTFT + decode) / full {r('total1'):.2f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="the JSONL of answers and gaps (pass 1 appends to it)")
    p.add_argument("--eval-records", dest="eval_records", help="a `kvfuse eval --guard` records.jsonl (needs --data)")
    p.add_argument("--slices", default="0:20,20:40", help="with --eval-records: slices of each set's seeded order")
    p.add_argument("--data", help="evaluation data (../shared/data); without it, pass 2 only")
    p.add_argument("--datasets", default="2wikimqa,hotpotqa,musique")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--strategies", default="infoflow,prophetkv,cacheblend")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--adapter", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--max-new-tokens", type=int, default=32, dest="max_new_tokens")
    args = p.parse_args()
    if args.eval_records:
        if not args.data:
            p.error("--eval-records needs --data (the slices are drawn from it)")
        print(eval_records(args.eval_records, args.data, args.slices))
        return
    if not args.out:
        p.error("give --out (the probe's record) or --eval-records")
    if args.data:
        probe(args)
    print(simulate(args.out))


if __name__ == "__main__":
    main()
