"""How much of infoflow's deep-probe pick lies inside a cheaper superset: a shallow question probe's top f x budget.

The measurement behind the closing note's "a cheaper probe for issue 16, measured and dropped": if a shallow probe
(a few early layers) could pick a superset that holds nearly all of what the deep probe (layers 16-23 of 24) picks,
the superset could be recomputed through the middle layers and narrowed there by the question's in-pass attention,
with no second deep pass. Prints, per shallow variant and factor f, the mean share of the deep pick (15%) found in
the shallow pick at f x 15%. Examples: the 60th.. of each dataset in the seeded order of the `*.migres.jsonl` files
alone (not the harness's reported split), the embedded model without its adapter, on the CPU.

    python benchmarks/probe_superset_recall.py --sets 2wikimqa,hotpotqa,musique --per-set 4
"""
from __future__ import annotations

import argparse
import glob

from kvfuse import FusionEngine
from kvfuse.engine.fusion.infoflow import InfoFlow
from kvfuse.evaluation.data import read_jsonl, select_examples

VARIANTS = {"L2": (2,), "L4": (4,), "L2-5": (2, 3, 4, 5), "L8": (8,), "L6-9": (6, 7, 8, 9)}
FACTORS = (1, 2, 3)


class _Recorded(InfoFlow):
    """infoflow whose initial pick is kept in `picked` (eager path: not graph-safe)."""

    graph_safe = False
    picked: dict = {}

    def __init__(self, tag: str, **options) -> None:
        super().__init__(**options)
        self.tag = tag

    def initial(self, ctx):
        out = super().initial(ctx)
        _Recorded.picked[self.tag] = set(out.cpu().tolist())
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--sets", default="2wikimqa,hotpotqa,musique")
    ap.add_argument("--per-set", type=int, default=4)
    ap.add_argument("--skip", type=int, default=60)
    ap.add_argument("--ratio", type=float, default=0.15)
    a = ap.parse_args()
    eng = FusionEngine.from_pretrained("qwen2.5-coder-0.5b", adapter=None, links=None, device="cpu")
    examples = [ex for f in sorted(glob.glob(f"{a.data}/*.migres.jsonl")) for ex in read_jsonl(f)]
    chosen = select_examples(examples, datasets=a.sets.split(","), limit=a.per_set, skip=a.skip)
    recall = {(v, f): [] for v in VARIANTS for f in FACTORS}
    for ex in chosen:
        eng.generate(ex.question, ex.docs, strategy=_Recorded("deep"), recompute_ratio=a.ratio, max_new_tokens=1)
        deep = _Recorded.picked["deep"]
        for v, layers in VARIANTS.items():
            for f in FACTORS:
                eng.generate(ex.question, ex.docs, strategy=_Recorded(f"{v}:{f}", layers=layers),
                             recompute_ratio=a.ratio * f, max_new_tokens=1)
                recall[(v, f)].append(len(deep & _Recorded.picked[f"{v}:{f}"]) / max(1, len(deep)))
    for (v, f), xs in recall.items():
        print(f"{v:5s} x{f}: recall of the deep pick {sum(xs) / len(xs):.3f} (n={len(xs)})")


if __name__ == "__main__":
    main()
