"""Host time of the bucketed path's plan (`LayoutGraphs.plan`: the request's shape bucket and packed inputs), per
strategy, on the CPU: it runs on the serving thread before any device work, so it is TTFT.

A 24-layer model of the 0.5B shape's layer count and vocabulary with tiny hidden sizes (the plan depends on the
layout, not on the weights), one random 8k-token layout, the bucketed path forced on the CPU, one intra-op thread
as a GPU engine's scheduler thread has. Median of the calls after the first.

    python benchmarks/plan_host.py --strategies cacheblend,infoflow,reuse --context 8192
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttft import _IdsTokenizer, random_layout  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", default="cacheblend,infoflow,reuse")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=6)
    args = ap.parse_args()
    import transformers

    from kvfuse.engine import bucketed
    from kvfuse.engine.api import FusionEngine
    from kvfuse.engine.config import EngineConfig

    torch.set_num_threads(1)
    vocab, n = 151936, args.context
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=24,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * n,
                                   tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().requires_grad_(False)
    row_bytes = 2 * 24 * 2 * 16 * 4
    engine = FusionEngine(model, _IdsTokenizer(), EngineConfig(
        memory_budget_bytes=3 * (n + 1024) * row_bytes, kv_tier="pool", scratch_tokens=n + 64, bucketed_prefill=True,
        scheduler_cpu_threads=1), model_name="random", model_fingerprint="bench", tokenizer_fingerprint="ids")
    times: list[float] = []
    orig = bucketed.LayoutGraphs.plan

    def plan(self, *a, **k):
        t0 = time.perf_counter()
        out = orig(self, *a, **k)
        times.append((time.perf_counter() - t0) * 1e3)
        return out

    bucketed.LayoutGraphs.plan = plan
    q, docs = random_layout(engine, n, 64, vocab, 1)
    engine.precompute(docs)
    print(f"| strategy | plan ms (median of {args.calls - 1}, {n}-token layout, {len(docs)} documents) |")
    print("|---|---:|")
    for name in args.strategies.split(","):
        times.clear()
        for _ in range(args.calls):
            engine.generate(question_ids=q, docs=docs, strategy=name, recompute_ratio=0.15, max_new_tokens=1)
        print(f"| {name} | {statistics.median(times[1:]):.2f} |", flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
