"""APE's training-free attention temperature on cached documents: every served cache's keys divided by T (so
each later query's logits over a cached document's keys are scaled by 1/T), then `kvfuse eval` as usual.

    python benchmarks/ape_temperature.py --temperatures 0.9,1.1 --datasets 2wikimqa,hotpotqa --limit 10 \\
        --strategies full,infoflow --out runs/ape

One eval folder per temperature under --out (`T<t>`); T = 1 is the engine as shipped (run `kvfuse eval` with the
same options for it). Only APE's temperature is swept here, not its scaling factor. Rows recomputed by the strategy
carry their fresh keys, unscaled.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvfuse.engine.store.entry import DocKV
from kvfuse.evaluation import add_eval_parser, run_eval
from kvfuse.evaluation.runner import load_engine


def engine_with_temperature(model: str, temperature: float, device: str | None):
    engine = load_engine(model, device=device, prompt="qa", adapter="auto")
    lookup = engine.doc_cache.kvs

    def scaled(docs, strategy=None, doc_ids=None):
        pairs, misses = lookup(docs, strategy, doc_ids)
        return [(ids, DocKV(kv.k / temperature, kv.v, kv.extras)) for ids, kv in pairs], misses

    engine.doc_cache.kvs = scaled
    return engine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--temperatures", default="0.9,1.1")
    p.add_argument("--data", default="../shared/data")
    p.add_argument("--datasets", default="2wikimqa,hotpotqa")
    p.add_argument("--limit", default="10")
    p.add_argument("--strategies", default="full,infoflow")
    p.add_argument("--ratios", default="0.15")
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--device", default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    for t in (float(x) for x in a.temperatures.split(",")):
        out = Path(a.out) / f"T{t:g}"
        parser = argparse.ArgumentParser()
        add_eval_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["eval", "--data", a.data, "--datasets", a.datasets, "--limit", a.limit,
                                  "--strategies", a.strategies, "--ratios", a.ratios, "--model", a.model,
                                  "--out", str(out), "--no-progress"])
        print(f"== T = {t:g}", file=sys.stderr)
        run_eval(args, engine_factory=lambda t=t: engine_with_temperature(a.model, t, a.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
