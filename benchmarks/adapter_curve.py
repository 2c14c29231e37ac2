"""Summarises `kvfuse train-adapter` training records: steps, prompts, seconds per prompt, and the mean KL over each
sixth of the run (the last column holds the steps left over when the count is not a multiple of six).

    python benchmarks/adapter_curve.py kvfuse/data/adapters/qwen2.5-coder-0.5b.json docs/quality/adapter_gpu/online_*.json
"""
from __future__ import annotations

import json
import sys


def summary(path: str) -> str:
    rec = json.load(open(path, encoding="utf-8"))
    curve = rec["curve"]
    kls = [c["kl"] for c in curve]
    prompts = sum(len(c.get("prompts", [None])) for c in curve)
    seg = max(1, len(kls) // 6)
    means = [sum(kls[i:i + seg]) / len(kls[i:i + seg]) for i in range(0, len(kls), seg)]
    return (f"{path}: {len(kls)} steps, {prompts} prompts, {rec['seconds'] / max(1, prompts):.2f} s per prompt; "
            f"mean KL per sixth: {' '.join(f'{m:.3f}' for m in means)}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(summary(p))
