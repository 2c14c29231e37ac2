"""Where a fused prefill spends its time on the GPU: host synchronisations, launch overhead, top kernels.

Builds the same random-weight model as benchmarks/ttft.py, then for each strategy:
- runs one request with torch's sync debug mode on and lists every place that synchronised the host;
- times the call on the host clock and on device events, and counts kernel launches (torch.profiler);
- prints the top device kernels.

    python benchmarks/profile_gpu.py --shape llama8b --context 8192 --out profile.txt
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttft import build, make_engine, request  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama8b")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--strategies", default="reuse,cacheblend,infoflow")
    ap.add_argument("--tier", default="pool")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--cuda-graphs", type=int, default=1,
                    help="0: run the padded (bucketed) path eagerly, so the profiler lists every kernel")
    ap.add_argument("--top", type=int, default=14, help="kernels listed per strategy")
    args = ap.parse_args()
    model = build(args.shape, "cuda")
    engine = make_engine(model, args.tier, pool_tokens=args.context + 1024, scratch=args.context + 64,
                         cuda_graphs=bool(args.cuda_graphs))
    q, docs = request(engine, args.context, 512, 64, model.config.vocab_size, seed=1)
    engine.precompute(docs)
    for name in args.strategies.split(","):
        call = lambda: engine.generate(question_ids=q, docs=docs, strategy=name, recompute_ratio=args.ratio,  # noqa
                                       max_new_tokens=1)
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        sites = collections.Counter()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            orig = warnings.showwarning
            call()
        torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            if "synchroniz" in str(w.message).lower():
                sites[f"{Path(w.filename).name}:{w.lineno}"] += 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = call()
        host = time.perf_counter() - t0
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                            "cuLaunchKernelEx", "cudaMemcpyAsync"))
        dev_total = sum(e.self_device_time_total for e in events) / 1e3
        print(f"\n=== {name}: ttft {r.ttft_s * 1e3:.2f} ms (host {host * 1e3:.2f}), device busy {dev_total:.2f} ms, "
              f"launches {launches}, selection {r.selection_s * 1e3:.2f} ms")
        print("syncs:", dict(sites) or "none")
        print(events.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
