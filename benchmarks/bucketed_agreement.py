"""Answers of the bucketed prefill (shape-bucket padding, the layout as data) against the exact-size path, on the
embedded model's real weights and real dev questions: the same requests through two engines, tokens compared.

    python benchmarks/bucketed_agreement.py --data ../shared/data/2wikimqa.migres.jsonl --limit 8 --device cpu

On the CPU the bucketed path is forced on (it is off there by default); on CUDA it is the default path, compared with
`bucketed_prefill=False`. Prints one line per (example, strategy) and the share of identical answers.
"""
from __future__ import annotations

import argparse
import json

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="../shared/data/2wikimqa.migres.jsonl")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--strategies", default="infoflow,cacheblend,reuse")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()

    from kvfuse.engine import weights
    from kvfuse.engine.api import FusionEngine
    from kvfuse.engine.config import EngineConfig

    model, tok, info = weights.load_model(args.model, dtype=torch.bfloat16, device=args.device, progress=False)
    engines = {flag: FusionEngine(model, tok, EngineConfig(kv_tier="pool", bucketed_prefill=flag, disk_budget_bytes=0,
                                                           memory_budget_bytes=256 << 20),
                                  model_name=info.name, model_fingerprint=info.fingerprint,
                                  tokenizer_fingerprint=info.tokenizer_fingerprint)
               for flag in (True, False)}
    with open(args.data, encoding="utf-8") as f:
        examples = [json.loads(line) for line in f][:args.limit]
    same = total = 0
    for ex in examples:
        docs = [(p["id"], p["text"]) for p in ex["passages"]]
        for name in args.strategies.split(","):
            r = {flag: e.generate(ex["question"], docs, strategy=name, recompute_ratio=args.ratio,
                                  max_new_tokens=args.max_new_tokens) for flag, e in engines.items()}
            total += 1
            same += r[True].token_ids == r[False].token_ids
            print(f"{name:<11} {r[True].prompt_tokens:5d} tokens  same={r[True].token_ids == r[False].token_ids}  "
                  f"bucketed {r[True].text[:50]!r}  exact {r[False].text[:50]!r}", flush=True)
    print(f"identical answers: {same}/{total} ({args.model}, {args.device}, ratio {args.ratio})")
    for e in engines.values():
        e.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
