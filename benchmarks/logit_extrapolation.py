"""Can the fused first token be corrected by extrapolating its logits away from a cheaper pass's? (issue 11,
docs/quality/guard.md)

Most answers that part from full prefill's do so at their first token, at a near-tie. With more recompute the
first-token logits move towards full's; if they moved along one direction, `l_15 + k (l_15 - l_lo)` (l_lo: reuse's
logits, which the probe guard already reads, or a 5% pass's) would land nearer full's for some k > 0.

    python benchmarks/logit_extrapolation.py --collect docs/quality/guard/first_token_logits.jsonl \\
        --data ../shared/data --limit 20                                                    # pass 1, resumable
    python benchmarks/logit_extrapolation.py --report docs/quality/guard/first_token_logits.jsonl   # pass 2

Pass 1: per example (the eval harness's seeded order, first `--limit` per set), the first-token log-probabilities of
full prefill, reuse and infoflow at 5%, 15% and 30% (shipped adapter, the embedded model), each stored at the union
of the five passes' top-64 token ids. Pass 2: how often each pass's, and each extrapolation's, argmax is full's, per
set and macro.
"""
from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

RUNS = (("full", 1.0), ("reuse", 0.0), ("infoflow", 0.05), ("infoflow", 0.15), ("infoflow", 0.3))


def collect(out: Path, data: str, datasets: list[str], limit: int, skip: int, model: str, adapter: str) -> None:
    from kvfuse.evaluation.data import load_examples
    from kvfuse.evaluation.runner import load_engine

    done = {json.loads(x)["id"] for x in out.read_text().splitlines()} if out.exists() else set()
    engine = load_engine(model, device=None, adapter=adapter)
    with out.open("a") as f:
        for ex in load_examples(data, datasets=datasets, limit=limit, skip=skip):
            if ex.id in done:
                continue
            engine.precompute(ex.docs)
            lps = {f"{s}@{r}": engine.next_token_logprobs(ex.question, ex.docs, [0], strategy=s,
                                                          recompute_ratio=r)[0] for s, r in RUNS}
            ids = sorted({int(i) for lp in lps.values() for i in lp.topk(64).indices})
            rec = {"id": ex.id, "dataset": ex.dataset, "union": ids, "time": time.strftime("%H:%M:%S")}
            rec.update({k: [round(float(lp[i]), 4) for i in ids] for k, lp in lps.items()})
            f.write(json.dumps(rec) + "\n")
            f.flush()


def _argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=xs.__getitem__)


def _gap(xs: list[float]) -> float:
    """The top-2 gap of one pass's log-probs (nats)."""
    a, b = sorted(xs, reverse=True)[:2]
    return a - b


def report(path: Path, ks: list[float]) -> None:
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    ref = "full@1.0"

    def agreement(fn) -> tuple[float, dict[str, float]]:
        per: dict[str, list[int]] = collections.defaultdict(list)
        for r in recs:
            per[r["dataset"]].append(int(_argmax(fn(r)) == _argmax(r[ref])))
        means = {d: sum(v) / len(v) for d, v in sorted(per.items())}
        return sum(means.values()) / len(means), means

    def line(label: str, fn) -> None:
        macro, means = agreement(fn)
        sets = " | ".join(f"{v:.2f}" for v in means.values())
        print(f"| {label} | {sets} | {macro:.3f} |")

    sets = sorted({r["dataset"] for r in recs})
    print(f"{len(recs)} examples; first token equal to full prefill's:\n")
    print("| first-token logits | " + " | ".join(sets) + " | macro |")
    print("|---|" + "---:|" * (len(sets) + 1))
    for key in ("reuse@0.0", "infoflow@0.05", "infoflow@0.15", "infoflow@0.3"):
        line(key.replace("@", " @ "), lambda r, key=key: r[key])
    for lo in ("reuse@0.0", "infoflow@0.05"):
        for k in ks:
            line(f"infoflow @ 0.15 + {k:g} (infoflow @ 0.15 - {lo.replace('@', ' @ ')})",
                 lambda r, lo=lo, k=k: [a + k * (a - b) for a, b in zip(r["infoflow@0.15"], r[lo])])
    print("\n| full's own top-2 gap (nats) | examples | infoflow 15% agrees | infoflow 30% agrees |\n|---|---:|---:|---:|")
    for lo, hi in ((0, 0.25), (0.25, 0.5), (0.5, 1), (1, 2), (2, float("inf"))):
        sel = [r for r in recs if lo <= _gap(r[ref]) < hi]
        if sel:
            agree = {k: sum(_argmax(r[k]) == _argmax(r[ref]) for r in sel) / len(sel)
                     for k in ("infoflow@0.15", "infoflow@0.3")}
            print(f"| {lo:g}-{hi:g} | {len(sel)} | {agree['infoflow@0.15']:.2f} | {agree['infoflow@0.3']:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--collect", type=Path, help="write (append, resumable) the first-token log-probs here")
    ap.add_argument("--report", type=Path, help="read them and print the agreement table")
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--datasets", default="2wikimqa,hotpotqa,musique")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--adapter", default="auto")
    ap.add_argument("--k", default="0.1,0.25,0.5,1,2", help="extrapolation factors")
    args = ap.parse_args()
    if not (args.collect or args.report):
        ap.error("give --collect and/or --report")
    if args.collect:
        collect(args.collect, args.data, args.datasets.split(","), args.limit, args.skip, args.model, args.adapter)
    if args.report:
        report(args.report, [float(k) for k in args.k.split(",")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
