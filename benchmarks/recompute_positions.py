"""Where the recomputed rows fall, and so how much attention a fused prefill does, on ttft.py's two layouts.

A recomputed row at position p attends to the p keys before it, so the main pass's attention work is about the
number of recomputed rows times their mean position (blocks of the attention kernel stop at their last row's
position). The row choice depends on the layout and the weights, so equal 512-token documents ("repeated" in
ttft.py) and random 128-1024-token ones ("first-sight", "repeated-random") can cost different attention time for
the same number of rows. Runs anywhere (the CPU at the 0.5B shape takes about a minute, random weights).

    python benchmarks/recompute_positions.py --shape qwen05b --context 8192 --strategies infoflow,cacheblend --device cpu
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttft import build, make_engine, random_layout, request  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen05b")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--strategies", default="infoflow,cacheblend")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model = build(args.shape, args.device)
    n, vocab = args.context, model.config.vocab_size
    engine = make_engine(model, "pool", pool_tokens=2 * n + 2048, scratch=n + 64, cuda_graphs=False)
    layouts = {"equal 512-token documents": request(engine, n, 512, 64, vocab, 0),
               "random 128-1024-token documents": random_layout(engine, n, 64, vocab, 424242)}
    print("| layout | strategy | prompt | recomputed | mean position / prompt | 10/25/50/75/90% positions |")
    print("|---|---|---:|---:|---:|---|")
    for name, (q, docs) in layouts.items():
        engine.precompute(docs)
        for strategy in args.strategies.split(","):
            r = engine.generate(question_ids=q, docs=docs, strategy=strategy, recompute_ratio=args.ratio,
                                max_new_tokens=1)
            pos = sorted(r.recomputed_positions)
            qs = [pos[int(len(pos) * f)] for f in (0.1, 0.25, 0.5, 0.75, 0.9)]
            print(f"| {name} | {strategy} | {r.prompt_tokens} | {len(pos)} | "
                  f"{sum(pos) / (len(pos) * r.prompt_tokens):.3f} | {qs} |", flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
