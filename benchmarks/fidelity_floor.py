"""How much of fidelity (F1 of a fused answer against full prefill's) is reachable, read from `kvfuse eval` records.

Three tables, each per dataset and macro:

1. **Full against full.** Full prefill's answers in two record files run on different machines or kernels (a CPU
   run and a GPU run of the same weights, say): how often they agree word for word and their fidelity to each
   other. That is the metric's noise floor: the answers that flip when only rounding changes.
2. **By full's own correctness.** A fused strategy's fidelity over the examples where full prefill's answer is
   right (gold score >= 0.5) and where it is wrong: keeping a right answer is what a user notices; reproducing a
   wrong guess is a near-tie lottery.
3. **By recompute ratio.** A strategy's fidelity at every ratio on record (its ceiling as the budget grows).
4. **The most any hand-over policy can reach within a mean budget** (`--budget B`): serve a request at ratio r or
   hand it to full prefill (recompute 1, fidelity 100), with an oracle that hands over exactly the worst answers.
   At a mean recompute of at most B, that hands over k = floor(n (B - r) / (1 - r)) of n requests; the table gives,
   per set, the best such mix over the ratios on record (the oracle does not pay for a fused pass it discards, so
   a real guard, which must run it first and cannot know which answers are wrong, does worse). A bar above this
   figure cannot be met by any guard, escalation or budget split over these fused points.

    python benchmarks/fidelity_floor.py --pair docs/quality/q60/records.jsonl docs/quality/gpu_empty_cache_1206/records.jsonl \
        --records docs/quality/gpu_empty_cache_1206/records.jsonl --strategy infoflow+adapter

`--records` may be given several times (their runs are read together; the first record of a label and example
wins).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvfuse.evaluation.metrics import fidelity  # noqa: E402


def _load(paths: list[str]) -> dict[tuple[str, str, float], dict[str, dict]]:
    """(strategy label, dataset, ratio) -> example id -> record; the first record wins."""
    out: dict = defaultdict(dict)
    for p in paths:
        for line in open(p, encoding="utf-8"):
            r = json.loads(line)
            out[(r["strategy"], r["dataset"], float(r["ratio"]))].setdefault(r["example_id"], r)
    return out


def _fulls(runs) -> dict[str, dict[str, dict]]:
    got: dict = defaultdict(dict)
    for (label, ds, _), recs in runs.items():
        if label == "full":
            got[ds].update(recs)
    return got


def _mean(xs: list[float]) -> float:
    return 100.0 * sum(xs) / len(xs) if xs else float("nan")


def full_vs_full(a_path: str, b_path: str) -> list[str]:
    a, b = _fulls(_load([a_path])), _fulls(_load([b_path]))
    lines = ["| dataset | n | same answer | fidelity of one to the other |", "|---|---:|---:|---:|"]
    macro_same, macro_fid = [], []
    for ds in sorted(set(a) & set(b)):
        ids = sorted(set(a[ds]) & set(b[ds]))
        if not ids:
            continue
        same = [float(a[ds][i]["answer"] == b[ds][i]["answer"]) for i in ids]
        fid = [fidelity(b[ds][i]["answer"], a[ds][i]["answer"]) for i in ids]
        macro_same.append(_mean(same))
        macro_fid.append(_mean(fid))
        lines.append(f"| {ds} | {len(ids)} | {sum(same):.0f} ({_mean(same):.1f}%) | {_mean(fid):.1f} |")
    if macro_same:
        lines.append(f"| macro | | {sum(macro_same) / len(macro_same):.1f}% | {sum(macro_fid) / len(macro_fid):.1f} |")
    return lines


def by_correctness(runs, strategy: str) -> list[str]:
    fulls = _fulls(runs)
    lines = ["| dataset | ratio | full right: n / fidelity / same answer | full wrong: n / fidelity / same answer |",
             "|---|---:|---:|---:|"]
    for (label, ds, ratio), recs in sorted(runs.items()):
        if label != strategy:
            continue
        cells = []
        for right in (True, False):
            rows = [r for i, r in recs.items() if i in fulls[ds] and (fulls[ds][i]["score"] >= 0.5) == right]
            cells.append(f"{len(rows)} / {_mean([r['fidelity'] for r in rows]):.1f} / "
                         f"{sum(r['answer'] == fulls[ds][r['example_id']]['answer'] for r in rows)}")
        lines.append(f"| {ds} | {ratio:g} | {cells[0]} | {cells[1]} |")
    return lines


def by_ratio(runs, strategy: str) -> list[str]:
    table: dict = defaultdict(dict)
    same: dict = defaultdict(list)
    fulls = _fulls(runs)
    for (label, ds, ratio), recs in runs.items():
        if label == strategy:
            table[ratio][ds] = _mean([r["fidelity"] for r in recs.values()])
            same[ratio].extend(r["answer"] == fulls[ds][i]["answer"] for i, r in recs.items() if i in fulls[ds])
    sets = sorted({ds for row in table.values() for ds in row})
    lines = ["| ratio | " + " | ".join(sets) + " | macro | answers equal to full's |",
             "|---:|" + "---:|" * (len(sets) + 2)]
    for ratio in sorted(table):
        row = table[ratio]
        vals = [row.get(ds) for ds in sets]
        macro = sum(v for v in vals if v is not None) / max(1, sum(v is not None for v in vals))
        lines.append(f"| {ratio:g} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in vals)
                     + f" | {macro:.1f} | {_mean([float(x) for x in same[ratio]]):.1f}% |")
    return lines


def hand_over_bound(runs, strategy: str, budget: float) -> list[str]:
    fulls = _fulls(runs)
    best: dict = {}
    for (label, ds, ratio), recs in runs.items():
        if label != strategy or ratio > budget:
            continue
        f = sorted(r["fidelity"] for i, r in recs.items() if i in fulls[ds])
        if not f:
            continue
        n = len(f)
        k = min(n, int(n * (budget - ratio) / (1 - ratio) + 1e-9)) if ratio < 1 else 0
        value = 100.0 * (sum(f[k:]) + k) / n
        if ds not in best or value > best[ds][0]:
            best[ds] = (value, ratio, k, n, 100.0 * sum(f) / n)
    lines = [f"| dataset | best mix at mean recompute <= {budget:g} | its ratio | handed over (oracle) | "
             "fidelity at that ratio alone |", "|---|---:|---:|---:|---:|"]
    for ds in sorted(best):
        value, ratio, k, n, alone = best[ds]
        lines.append(f"| {ds} | {value:.1f} | {ratio:g} | {k} of {n} | {alone:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", nargs=2, metavar=("A", "B"), help="two record files whose full answers to compare")
    ap.add_argument("--records", action="append", default=[], help="record files of the strategy's runs")
    ap.add_argument("--strategy", default="infoflow+adapter", help="the label the records give the strategy")
    ap.add_argument("--budget", type=float, default=None,
                    help="also print the most any hand-over-to-full policy reaches at this mean recompute (e.g. 0.15)")
    args = ap.parse_args(argv)
    if not args.pair and not args.records:
        ap.error("give --pair A B and/or --records PATH")
    if args.pair:
        print(f"Full prefill against full prefill: {args.pair[0]} vs {args.pair[1]}\n")
        print("\n".join(full_vs_full(*args.pair)), end="\n\n")
    if args.records:
        runs = _load(args.records)
        print(f"{args.strategy}: fidelity by whether full prefill's answer is right (gold score >= 0.5)\n")
        print("\n".join(by_correctness(runs, args.strategy)), end="\n\n")
        print(f"{args.strategy}: fidelity by recompute ratio\n")
        print("\n".join(by_ratio(runs, args.strategy)))
        if args.budget is not None:
            print(f"\n{args.strategy}: the most a hand-over policy reaches at a mean recompute <= {args.budget:g}\n")
            print("\n".join(hand_over_bound(runs, args.strategy, args.budget)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
