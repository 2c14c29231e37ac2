"""Where a slow call's time goes: host or device, for many calls of one strategy on new (or one repeated) layout.

For every timed call it records, on the scheduler thread that serves it: the host time of the bucket plan
(`LayoutGraphs.plan`), the host time of `LayoutGraphs.run` (launching the replay), the *device* time of the
replayed graphs (CUDA events around `run` on the serving stream), and the request's TTFT and prefill time as the
engine reports them; with `--clock-log FILE` (an `nvidia-smi ... -lms` sampling started beside it) each call also
gets the SM clock sampled while it ran. A call whose TTFT is high while its device time is not was held up on the
host; one whose device time is high ran on a slow (e.g. still clocking up) GPU.

    nvidia-smi --query-gpu=timestamp,clocks.sm --format=csv,noheader -lms 5 > clocks.csv &
    python benchmarks/ttft_jitter.py --shape qwen05b --context 8192 --strategies reuse,infoflow --reps 30 \\
        --clock-log clocks.csv
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_cost import kernel_groups  # noqa: E402
from ttft import build, make_engine, random_layout, request  # noqa: E402


def read_clocks(path: str) -> list[tuple[float, float]]:
    """(unix seconds, SM MHz) samples from `nvidia-smi --query-gpu=timestamp,clocks.sm --format=csv,noheader`."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            stamp, mhz = (x.strip() for x in line.split(","))
            t = dt.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((t, float(mhz.split()[0])))
        except ValueError:
            continue
    return out


def profile_calls(engine, name, layout_of, ratio, calls: int = 2) -> None:
    """Device kernels of `calls` more requests of the row (`layout_of(j)` -> (question ids, docs); grouped by name:
    count, device ms per call). Each layout's documents are precomputed before its call, outside the profile."""
    from torch.profiler import ProfilerActivity, profile

    groups = None
    for j in range(calls):
        qi, ds = layout_of(j)
        engine.precompute(ds)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(question_ids=qi, docs=ds, strategy=name, recompute_ratio=ratio, max_new_tokens=1)
            torch.cuda.synchronize()
        groups = kernel_groups(prof, groups)
    print(f"--- {name}: device kernels per call")
    for key, (count, ms) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"  {ms / calls:8.3f} ms  {count / calls:6.1f}x  {key}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen05b")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--strategies", default="reuse,infoflow")
    ap.add_argument("--modes", default="repeated,first-sight",
                    help="repeated: one layout of equal 512-token documents, precomputed once; repeated-random: one "
                         "random layout (as first-sight draws them), precomputed once; first-sight: a new random "
                         "layout every call, precomputed just before it")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--gap-ms", type=float, default=0.0, help="host sleep between calls (idle GPU)")
    ap.add_argument("--clock-log", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="after each row, profile two more calls and print their device kernels grouped by name")
    args = ap.parse_args()
    from kvfuse.engine import bucketed

    model = build(args.shape, "cuda")
    vocab = model.config.vocab_size
    n = args.context
    rec: dict = {}
    orig_plan, orig_run = bucketed.LayoutGraphs.plan, bucketed.LayoutGraphs.run

    def plan(self, *a, **k):
        t0 = time.perf_counter()
        out = orig_plan(self, *a, **k)
        rec["plan_ms"] = (time.perf_counter() - t0) * 1e3
        return out

    def run(self, *a, **k):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        out = orig_run(self, *a, **k)
        e.record()
        rec["run_host_ms"] = (time.perf_counter() - t0) * 1e3
        rec["events"] = (s, e)
        return out

    bucketed.LayoutGraphs.plan, bucketed.LayoutGraphs.run = plan, run
    calls = []
    for name in args.strategies.split(","):
        engine = make_engine(model, "pool", pool_tokens=n + 1024, scratch=n + 64)
        q, docs = request(engine, n, 512, 64, vocab, 0)
        engine.precompute(docs)
        rq, rdocs = random_layout(engine, n, 64, vocab, 424242)
        for mode in args.modes.split(","):
            def layout_of(i, mode=mode):
                if mode == "repeated":
                    return q, docs
                if mode == "repeated-random":
                    return rq, rdocs
                return random_layout(engine, n, 64, vocab, 1000 * i + 7)

            for i in range(args.reps + 3):
                qi, ds = layout_of(i)
                engine.precompute(ds)  # a no-op for a layout already cached
                torch.cuda.synchronize()
                if args.gap_ms:
                    time.sleep(args.gap_ms / 1e3)
                rec.clear()
                t0 = time.time()
                r = engine.generate(question_ids=qi, docs=ds, strategy=name, recompute_ratio=args.ratio,
                                    max_new_tokens=1)
                t1 = time.time()
                s, e = rec["events"]
                e.synchronize()
                if i >= 3:  # the first calls run eagerly and capture
                    calls.append(dict(strategy=name, mode=mode, t0=t0, t1=t1, ttft=r.ttft_s * 1e3,
                                      prefill=r.prefill_s * 1e3, plan=rec["plan_ms"],
                                      run_host=rec["run_host_ms"], device=s.elapsed_time(e)))
            if args.profile:
                print(f"({mode})")
                profile_calls(engine, name, lambda j, f=layout_of: f(99_000 + j), args.ratio)
        engine.close()
    clocks = read_clocks(args.clock_log) if args.clock_log else []
    print("| strategy | mode | call | TTFT ms | prefill ms | device ms (graphs) | plan host ms | run host ms | "
          "SM MHz during call (min-max) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for i, c in enumerate(calls):
        inside = [mhz for t, mhz in clocks if c["t0"] - 0.003 <= t <= c["t1"] + 0.003]
        clk = f"{min(inside):.0f}-{max(inside):.0f}" if inside else "-"
        print(f"| {c['strategy']} | {c['mode']} | {i} | {c['ttft']:.2f} | {c['prefill']:.2f} | {c['device']:.2f} | "
              f"{c['plan']:.2f} | {c['run_host']:.2f} | {clk} |")
    print("\nmedian / p90 / max per row:")
    for name in args.strategies.split(","):
        for mode in args.modes.split(","):
            sub = [c for c in calls if c["strategy"] == name and c["mode"] == mode]
            for key in ("ttft", "device", "plan", "run_host"):
                xs = sorted(c[key] for c in sub)
                print(f"  {name:10s} {mode:11s} {key:9s} {statistics.median(xs):7.2f} {xs[int(0.9 * (len(xs) - 1))]:7.2f}"
                      f" {xs[-1]:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
