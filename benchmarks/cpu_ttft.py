"""CPU TTFT of strategies on one real dev example, side by side in one run (embedded default model).

Precomputes the example's passages, then times each strategy `--reps` times, interleaved, and reports the
best (least disturbed) TTFT and the ratio to `full`. Also times Hugging Face transformers' own SDPA prefill
of the same token ids as the external baseline.

    python benchmarks/cpu_ttft.py --data ../shared/data/musique.migres.jsonl --index 0
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--strategies", default="full,reuse,cacheblend,epic,infoflow,prophetkv")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kvfuse.engine.api import FusionEngine
    from kvfuse.engine.fusion import available

    with open(args.data, encoding="utf-8") as f:
        ex = [json.loads(line) for line in f if line.strip()][args.index]
    docs = [(p["id"], f"{p['title']}\n{p['text']}" if p.get("title") else p["text"]) for p in ex["passages"]]
    engine = FusionEngine.from_pretrained(args.model, device="cpu", disk_cache=False)
    rep = engine.precompute(docs)
    names = [s for s in args.strategies.split(",") if s in available()]
    ids = engine.layout(ex["question"], docs).ids[None]
    print(f"{ex['id']}: {len(docs)} passages, {ids.shape[1]} prompt tokens; precompute {rep.misses} docs "
          f"{rep.tokens} tokens in {rep.seconds:.1f} s; torch {torch.__version__}, {args.threads} threads", flush=True)

    def hf():
        t0 = time.perf_counter()
        with torch.inference_mode():
            engine.hf_model(ids, logits_to_keep=1, use_cache=False)
        return time.perf_counter() - t0

    best: dict[str, float] = {}
    last = {}
    for _ in range(args.reps):
        best["HF SDPA full"] = min(best.get("HF SDPA full", 1e9), hf())
        for s in names:
            r = engine.generate(ex["question"], docs, strategy=s, recompute_ratio=args.ratio, max_new_tokens=12)
            best[s] = min(best.get(s, 1e9), r.ttft_s)
            last[s] = r
    print(f"\n| row | TTFT s | vs kvfuse full | vs HF | recomputed doc tokens | answer |")
    print("|---|---:|---:|---:|---:|---|")
    print(f"| HF SDPA full | {best['HF SDPA full']:.2f} | | 1.00 | | |")
    for s in names:
        r = last[s]
        label = s if s in ("full", "reuse") else f"{s}@{args.ratio:.0%}"
        print(f"| {label} | {best[s]:.2f} | {best['full'] / best[s]:.2f}x | {best['HF SDPA full'] / best[s]:.2f}x | "
              f"{r.recomputed_tokens}/{r.doc_tokens} | {r.text.strip()[:60]!r} |")
    print(f"gold: {ex['answers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
