"""Would a guard read before the fused prefill be cheaper than the one read after it? (issue 11, guard.md)

The guard (GenerationOptions.guard_margin) hands an answer to full prefill when the fused path's first token is a
near-tie, so a handed-over request pays the fused prefill and a full one. A query-aware strategy (infoflow,
prophetkv, qcfuse) already runs a question probe before its fused prefill: the question's rows through the layers
over the cached documents, nothing recomputed. Run to the last layer, its last row gives reuse's first-token
distribution. A *pre-guard* would read that top-2 gap and, below a margin, serve full prefill straight away: a
handed-over request then pays the probe and a full prefill, not a whole fused prefill and a full one.

This script measures how well reuse's gap predicts the fused answer's departures, and what either guard would give:

    python benchmarks/pre_guard.py --collect docs/quality/guard/reuse_margins.jsonl --data ../shared/data   # pass 1
    python benchmarks/pre_guard.py --margins docs/quality/guard/reuse_margins.jsonl \\
        --records docs/quality/guard/records.jsonl                                                        # pass 2

Pass 1 (resumable): for each example of the reported split (60 per set, the eval harness's seeded order), reuse's
first token and its top-2 gap, with the shipped adapter. Pass 2 joins them with a `kvfuse eval --guard 0.5,1
--guard-tokens 1` records file (full, infoflow 15%, and the first-token-guarded rows) and prints, macro over the
sets: fidelity, the mean TTFT over full's on the CPU that ran the records (a pre-guard's hand-over costs the
probe, `selection_s`, plus full's TTFT), the share handed over; then the same on the H200's ratios (`--fused-rel`:
the strategy's TTFT over full's there, `--probe-share`: its probe's share of its TTFT).
"""
from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path


def collect(out: Path, data: str, datasets: list[str], limit: int, model: str, adapter: str) -> None:
    from kvfuse.evaluation.data import load_examples
    from kvfuse.evaluation.runner import load_engine

    done = {json.loads(x)["id"] for x in out.read_text().splitlines()} if out.exists() else set()
    engine = load_engine(model, device=None, adapter=adapter)
    with out.open("a") as f:
        for ex in load_examples(data, datasets=datasets, limit=limit):
            if ex.id in done:
                continue
            engine.precompute(ex.docs)
            r = engine.generate(ex.question, ex.docs, strategy="reuse", max_new_tokens=1, temperature=0.0,
                                return_logprobs=True)
            top = r.extra["logprobs"].float().topk(2, dim=-1)
            f.write(json.dumps({"id": ex.id, "dataset": ex.dataset, "ids": [int(t) for t in r.token_ids],
                                "margin": float(top.values[0, 0] - top.values[0, 1]), "ttft": r.ttft_s,
                                "time": time.strftime("%H:%M:%S")}) + "\n")
            f.flush()


def _macro(pairs) -> float:
    per = collections.defaultdict(list)
    for ds, v in pairs:
        per[ds].append(v)
    return sum(sum(v) / len(v) for v in per.values()) / len(per)


def simulate(margins: Path, records: Path, strategy: str, pre: list[float], fused_rel: float,
             probe_share: float) -> None:
    reuse = {r["id"]: r for r in map(json.loads, margins.read_text().splitlines())}
    rows = collections.defaultdict(dict)
    for r in map(json.loads, records.read_text().splitlines()):
        rows[r["example_id"]][r["strategy"]] = r
    guarded = sorted({s for v in rows.values() for s in v if s.startswith(strategy + "+") and s.endswith("/1")})
    ex = [(i, v) for i, v in rows.items() if i in reuse and "full" in v and strategy in v
          and all(g in v for g in guarded)]
    if not ex:
        raise SystemExit("no example is in both files")
    full_t = collections.defaultdict(list)
    for _, v in ex:
        full_t[v["full"]["dataset"]].append(v["full"]["ttft_s"])
    full_mean = {ds: sum(t) / len(t) for ds, t in full_t.items()}

    def line(name, pick):
        fid, cpu, cuda, hand = [], [], [], []
        for i, v in ex:
            ds = v["full"]["dataset"]
            f, c, g, h = pick(i, v)
            fid.append((ds, f))
            cpu.append((ds, c / full_mean[ds]))
            cuda.append((ds, g))
            hand.append((ds, h))
        print(f"| {name} | {100 * _macro(fid):.1f} | {_macro(cpu):.3f} | {_macro(cuda):.3f} | "
              f"{100 * _macro(hand):.1f}% |")

    base = strategy
    print(f"{len(ex)} examples; {strategy}; H200 figures derived from fused/full {fused_rel} and a probe share "
          f"of {probe_share}\n")
    print("| policy | fidelity (macro) | TTFT / full, CPU (these records) | TTFT / full, H200 (derived) | handed over |")
    print("|---|---:|---:|---:|---:|")
    line(base, lambda i, v: (v[base]["fidelity"], v[base]["ttft_s"], fused_rel, 0))
    for g in guarded:  # a first-token guard after the fused prefill: a hand-over recomputes every document row
        line(f"{g} (after the fused prefill)", lambda i, v, g=g: (
            (v[g]["fidelity"], v[g]["ttft_s"], fused_rel + 1, 1) if v[g]["recompute_fraction"] > 0.5
            else (v[g]["fidelity"], v[g]["ttft_s"], fused_rel, 0)))
    for m in pre:
        line(f"pre-guard {m:g} (reuse's gap, before it)", lambda i, v, m=m: (
            (1.0, v[base]["selection_s"] + v["full"]["ttft_s"], probe_share * fused_rel + 1, 1)
            if reuse[i]["margin"] < m else (v[base]["fidelity"], v[base]["ttft_s"], fused_rel, 0)))
    dep = sorted(reuse[i]["margin"] for i, v in ex if v[base]["token_ids"][:1] != v["full"]["token_ids"][:1])
    agree = sorted(reuse[i]["margin"] for i, v in ex if v[base]["token_ids"][:1] == v["full"]["token_ids"][:1])
    print(f"\n{len(dep)} answers part from full's at the first token; reuse's gap there: "
          + " ".join(f"{x:.2f}" for x in dep))
    print(f"reuse's gap where the first token agrees: median {agree[len(agree) // 2]:.2f}, "
          f"below 1 nat for {100 * sum(x < 1 for x in agree) / len(agree):.0f}%")
    share = [v[base]["selection_s"] / v[base]["ttft_s"] for _, v in ex if v[base]["ttft_s"] > 0]
    print(f"{base}'s probe share of its TTFT in these records (selection_s / ttft_s, mean): "
          f"{sum(share) / len(share):.3f}  (kvfuse front --probe-share cpu=...)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--collect", help="pass 1: write reuse's first-token gaps to this JSONL (resumable)")
    p.add_argument("--data", default="../shared/data")
    p.add_argument("--datasets", default="2wikimqa,hotpotqa,musique")
    p.add_argument("--limit", type=int, default=60)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--adapter", default="auto")
    p.add_argument("--margins", help="pass 2: the JSONL pass 1 wrote")
    p.add_argument("--records", default="docs/quality/guard/records.jsonl")
    p.add_argument("--strategy", default="infoflow+adapter", help="the records' label of the unguarded strategy")
    p.add_argument("--pre", default="0.25,0.5,0.75,1,1.5", help="pre-guard margins (nats)")
    p.add_argument("--fused-rel", type=float, default=0.652, dest="fused_rel",
                   help="the strategy's TTFT over full's on the H200 (docs/gpu/ttft_ratios_05b.csv, 0.5B 8k)")
    p.add_argument("--probe-share", type=float, default=0.18, dest="probe_share",
                   help="its probe's share of its TTFT there (docs/gpu/README.md)")
    a = p.parse_args()
    if a.collect:
        collect(Path(a.collect), a.data, a.datasets.split(","), a.limit, a.model, a.adapter)
    if a.margins:
        simulate(Path(a.margins), Path(a.records), a.strategy, [float(x) for x in a.pre.split(",")], a.fused_rel,
                 a.probe_share)


if __name__ == "__main__":
    main()
