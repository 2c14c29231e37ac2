"""Where a first-sight request's extra time goes: the same strategy on new random layouts (every call) and on one
repeated layout, both replaying their bucket's graph, with the host profile (cProfile, cumulative) of each.

    python benchmarks/first_sight_overhead.py --shape qwen05b --context 8192 --strategies cacheblend,reuse --reps 8

Prints per call TTFT, prefill and selection time and the graph outcome, then the top functions of each mode.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import time
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttft import build, make_engine, random_layout, request  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen05b")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--strategies", default="cacheblend,reuse")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    dev = "cuda"
    gc_log: list[float] = []  # seconds of each garbage collection, to tell its pauses from the GPU's
    gc_t0 = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            gc_log.append(time.perf_counter() - gc_t0[0])

    gc.callbacks.append(on_gc)

    def alloc_counts():
        st = torch.cuda.memory_stats()
        return (st.get("num_device_alloc", 0), st.get("num_device_free", 0), st.get("num_alloc_retries", 0))

    model = build(args.shape, dev)
    vocab = model.config.vocab_size
    n = args.context
    for name in args.strategies.split(","):
        engine = make_engine(model, "pool", pool_tokens=n + 1024, scratch=n + 64)
        q, docs = request(engine, n, 512, 64, vocab, 0)
        engine.precompute(docs)
        layouts = [random_layout(engine, n, 64, vocab, s) for s in range(args.reps + 3)]
        for mode in ("repeated", "first-sight"):
            prof = cProfile.Profile()
            for i in range(args.reps + 3):
                qi, ds = (q, docs) if mode == "repeated" else layouts[i]
                if mode == "first-sight":
                    engine.precompute(ds)
                torch.cuda.synchronize()
                lg = engine.runner.layout
                before = (lg.replays, lg.captures, lg.eager_runs)
                mem0, gcs = alloc_counts(), len(gc_log)
                timed = i >= 3  # the first calls run the bucket eagerly and capture it
                if timed:
                    prof.enable()
                r = engine.generate(question_ids=qi, docs=ds, strategy=name, recompute_ratio=args.ratio,
                                    max_new_tokens=1)
                if timed:
                    prof.disable()
                how = "/".join(str(b - a) for a, b in zip(before, (lg.replays, lg.captures, lg.eager_runs)))
                mem = "/".join(str(b - a) for a, b in zip(mem0, alloc_counts()))
                pauses = gc_log[gcs:]
                print(f"{name} {mode:11s} call {i}: ttft {r.ttft_s * 1e3:7.2f} ms  prefill {r.prefill_s * 1e3:7.2f}"
                      f"  sel {r.selection_s * 1e3:6.2f}  docs {len(ds):3d}  n {r.prompt_tokens}  r/c/e {how}  cudaMalloc/"
                      f"Free/retries {mem}  gc {len(pauses)} ({sum(pauses) * 1e3:.2f} ms)",
                      flush=True)
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
            print(f"--- {name} {mode}: host profile of {args.reps} calls\n{out.getvalue()}", flush=True)
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
