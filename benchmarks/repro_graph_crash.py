"""Reproduces issue 16's CUDA crash without real weights: with CUDA graphs on, the second `generate` of a
request whose first call computed a missing document fails with "an illegal memory access" (H200, torch 2.11,
Llama-3.1-8B shape, random bf16 weights). The same on 3b71b30, before the reliability/integration changes.

    python benchmarks/repro_graph_crash.py            # crashes at "reuse 1"
    python benchmarks/repro_graph_crash.py --no-graphs  # runs to the end
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ttft  # noqa: E402  (the TTFT benchmark's random-weight model and id-level requests)


def main() -> None:
    graphs = "--no-graphs" not in sys.argv
    model = ttft.build("llama8b", "cuda")
    eng = ttft.make_engine(model, "pool", pool_tokens=4096, scratch=2048 + 64, cuda_graphs=graphs)
    q, docs = ttft.request(eng, 2048, 512, 64, model.config.vocab_size, seed=7)
    eng.precompute(docs[:2])  # the third document is a miss on the first call
    for strat in ("reuse", "cacheblend", "infoflow", "full"):
        for i in range(3):
            r = eng.generate(question_ids=q, docs=docs, strategy=strat, max_new_tokens=8)
            torch.cuda.synchronize()
            print(strat, i, "misses", r.cache_misses, "ttft", f"{r.ttft_s * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
