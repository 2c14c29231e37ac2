"""Paired differences between two strategies of one `kvfuse eval` run: per dataset and macro, the mean change of
fidelity, gold score and KL over the same examples, with a bootstrap 95% interval of the mean change (paired: each
resample draws examples, both strategies' figures of an example together), and how many answers got closer to or
further from full prefill's.

    python benchmarks/paired_delta.py docs/quality/drift/gpu60/records.jsonl infoflow infoflow:drift=0.5

Runs of different adapters live in different folders (each labelled '<strategy>+adapter'); name several files as
PATH=TAG, comma separated, and a file's adapter runs are labelled '<strategy>[TAG]':

    python benchmarks/paired_delta.py docs/quality/ctx_adapter/shipped/records.jsonl=shipped,\
docs/quality/ctx_adapter/gctx/records.jsonl=gctx 'infoflow[shipped]' 'infoflow:doc_context=pool[gctx]'
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import defaultdict


def _ci(diffs: list[float], n_boot: int, seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(n_boot))
    return means[int(0.025 * n_boot)], means[int(0.975 * n_boot) - 1]


def _read(spec: str):
    """The records of `spec`: one path, or PATH=TAG entries (comma separated) whose adapter runs are relabelled
    '<strategy>[TAG]' (their untagged runs, `full` among them, are read as they are)."""
    for item in spec.split(",") if "=" in spec else [spec]:
        path, _, tag = item.partition("=")
        for line in open(path, encoding="utf-8"):
            r = json.loads(line)
            if tag and r["strategy"].endswith("+adapter"):
                r["strategy"] = r["strategy"].removesuffix("+adapter") + f"[{tag}]"
            yield r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", help="a records.jsonl, or PATH=TAG[,PATH=TAG...] (see above)")
    ap.add_argument("base", help="strategy label as recorded, without the '+adapter' suffix")
    ap.add_argument("other")
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", choices=("any", "adapter", "none"), default="any",
                    help="which runs of a file holding both: with the fusion adapter ('+adapter' labels), without, "
                         "or any (default; a strategy run both ways then keeps the one read last)")
    args = ap.parse_args()
    by = defaultdict(dict)  # (dataset, example) -> strategy -> record
    for r in _read(args.records):
        tagged = r["strategy"].endswith("+adapter")
        if (args.runs == "adapter" and not tagged and r["strategy"] != "full") or (args.runs == "none" and tagged):
            continue
        by[(r["dataset"], r["example_id"])][r["strategy"].removesuffix("+adapter")] = r
    rows = defaultdict(list)
    for (ds, _), recs in by.items():
        if args.base in recs and args.other in recs:
            rows[ds].append((recs[args.base], recs[args.other]))
    if not rows:
        print(f"no example has both {args.base!r} and {args.other!r}", file=sys.stderr)
        return 1
    print(f"{args.other} - {args.base}, paired over the same examples (bootstrap 95% interval of the mean change)")
    print("| dataset | n | fidelity change [95% CI] | closer / further from full's answer | gold score change | KL change |")
    print("|---|---:|---:|---:|---:|---:|")
    for ds in sorted(rows) + ["macro"]:
        pairs = [p for d in sorted(rows) for p in rows[d]] if ds == "macro" else rows[ds]
        fid = [100 * (b["fidelity"] - a["fidelity"]) for a, b in pairs]
        sco = [100 * (b["score"] - a["score"]) for a, b in pairs]
        kl = [b["kl"] - a["kl"] for a, b in pairs]
        lo, hi = _ci(fid, args.boot, args.seed)
        up, down = sum(x > 0 for x in fid), sum(x < 0 for x in fid)
        print(f"| {ds} | {len(pairs)} | {statistics.fmean(fid):+.1f} [{lo:+.1f}, {hi:+.1f}] | {up} / {down} | "
              f"{statistics.fmean(sco):+.1f} | {statistics.fmean(kl):+.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
