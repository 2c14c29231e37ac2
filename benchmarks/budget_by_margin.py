"""Would a per-request recompute budget, set by the question probe's first-token gap, beat a fixed 15% at the same
mean recompute? (issue 11, docs/quality/guard.md)

The probe guard (`guard_at="probe"`) reads reuse's top-2 first-token gap before the fused prefill and hands a
near-tie to full prefill, which lifts fidelity but raises the mean recompute far above 15%. The same gap could
instead *spend* a fixed mean budget unevenly: a low ratio where the gap is wide, a high one where it is narrow.
This script replays that policy over records measured at several ratios, with no new runs:

    python benchmarks/budget_by_margin.py --records docs/quality/adapter_gpu/ratios_records.jsonl \\
        --margins docs/quality/guard/reuse_margins.jsonl

For every strategy in the records, each two-level policy (ratio `lo` where the gap is at least T, `hi` below it; the
levels are the ratios on record plus 0, reuse, and 1, full prefill's own answer) whose mean recompute stays within
`--budget`, ranked by macro fidelity, beside the fixed ratio. The examples must be in both files (the reported
split: 60 per set).
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
from pathlib import Path


def load(records: Path, margins: Path):
    gap = {}
    for line in margins.read_text().splitlines():
        m = json.loads(line)
        g = m["margin"]
        gap[m["id"]] = g[0] if isinstance(g, list) else g
    fid: dict[str, dict] = collections.defaultdict(lambda: collections.defaultdict(dict))
    dataset = {}
    for line in records.read_text().splitlines():
        r = json.loads(line)
        name = r["strategy"].split("+")[0]
        if name == "full" or r.get("fidelity") is None:
            continue
        dataset[r["example_id"]] = r["dataset"]
        if name == "reuse":
            fid["*reuse"][r["example_id"]][0.0] = r["fidelity"]
        else:
            fid[name][r["example_id"]][float(r["ratio"])] = r["fidelity"]
    return gap, fid, dataset


def policy_score(ids, dataset, table, choose):
    per = collections.defaultdict(list)
    spent = []
    for i in ids:
        r = choose(i)
        per[dataset[i]].append(table[i][r])
        spent.append(r)
    means = {d: sum(v) / len(v) for d, v in sorted(per.items())}
    return sum(means.values()) / len(means), sum(spent) / len(spent), means


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", required=True, help="kvfuse eval records with the strategies at several ratios")
    ap.add_argument("--margins", required=True, help="reuse's first-token gaps (benchmarks/pre_guard.py --collect)")
    ap.add_argument("--budget", type=float, default=0.15, help="the mean recompute a policy may spend")
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args()
    gap, fid, dataset = load(Path(args.records), Path(args.margins))
    reuse = fid.pop("*reuse", {})
    for name, per_example in sorted(fid.items()):
        ids = [i for i in per_example if i in gap and i in reuse and args.budget in per_example[i]]
        if not ids:
            continue
        table = {i: {**per_example[i], 0.0: reuse[i][0.0], 1.0: 1.0} for i in ids}
        levels = sorted(set.intersection(*(set(t) for t in table.values())))
        fixed = policy_score(ids, dataset, table, lambda i: args.budget)
        print(f"{name}: {len(ids)} examples, levels {levels}; fixed {args.budget:.0%}: fidelity {fixed[0]:.3f}")
        found = []
        for lo, hi in itertools.combinations(levels, 2):
            for t in sorted({round(gap[i], 4) for i in ids}):
                f, spent, means = policy_score(ids, dataset, table, lambda i: lo if gap[i] >= t else hi)
                if spent <= args.budget + 1e-9:
                    found.append((f, spent, lo, hi, t, means))
        found.sort(key=lambda x: -x[0])
        for f, spent, lo, hi, t, means in found[:args.top]:
            sets = ", ".join(f"{d} {v:.3f}" for d, v in means.items())
            print(f"  {lo:.0%} at gap >= {t:g}, else {hi:.0%}: fidelity {f:.3f} at mean recompute {spent:.1%} ({sets})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
