"""What the request that makes a shape bucket due for capture costs, against the eager first sighting and a replay.

A bucket runs eagerly the first time it is seen and is due for capture the second time (`engine/bucketed.py`). Two
ways, one engine each, the same layouts to both:

- "capture on the request" (`LayoutGraphs.defer = False`): that request runs once on a side stream (the warm-up),
  its kernels are recorded, and it answers from the warm-up run's outputs (`keep_warm`);
- "capture in idle time" (`defer`, the default): that request runs eagerly and the capture is made when the engine
  is idle (the scheduler's `build_deferred`); the idle column is that capture's wall time, which no request waits
  for unless it arrives meanwhile.

Per round: the bucket graphs are dropped, one never-seen random layout is sent three times (1st eager, 2nd due,
3rd replays); medians over rounds, Hugging Face SDPA full prefill of the same length beside them. Then
(`--warmup-range 1`) `engine.warmup` over (N/2, N): the start-up capture of a server, each of whose requests captures
a bucket on its path.

    python benchmarks/capture_cost.py --shapes llama8b,qwen05b --contexts 2048,8192 --strategies full,infoflow
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))

from ttft import build, hf_prefill, make_engine, random_layout, time_call  # noqa: E402

PHASES = ("eager", "due", "replay")
VARIANTS = {"capture on the request": False, "capture in idle time": True}  # LayoutGraphs.defer
WANT = {  # graph counters (eager runs, captures, replays) each phase moves, idle-time capture included
    False: {"eager": (1, 0, 0), "due": (0, 1, 0), "replay": (0, 0, 1)},
    True: {"eager": (1, 0, 0), "due": (1, 1, 0), "replay": (0, 0, 1)},
}


def layouts_of(engine, strategy: str):
    return engine.runner.layout if strategy == "full" else engine.fused_runner.layout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama8b")
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--strategies", default="full,infoflow")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warmup-range", type=int, default=1,
                    help="1: also time engine.warmup over (N/2, N) per variant (what a server does at start-up)")
    args = ap.parse_args(argv)
    if args.device != "cuda" or not torch.cuda.is_available():
        print("capture_cost.py needs CUDA (graphs are captured on CUDA only)")
        return 1
    rows, warm_s = [], []
    for shape in args.shapes.split(","):
        model = build(shape, args.device)
        vocab = model.config.vocab_size
        for n in (int(c) for c in args.contexts.split(",")):
            n = min(n, model.config.max_position_embeddings - 8)
            ids = torch.randint(100, vocab - 100, (1, n), device=args.device)
            hf_ms = time_call(lambda: hf_prefill(model, ids), 5, 2)[0] * 1e3
            print(f"{shape} {n:6d}  HF SDPA full {hf_ms:8.2f} ms", flush=True)
            engines = {v: make_engine(model, "pool", pool_tokens=n + 1024, scratch=n + 64) for v in VARIANTS}
            for name in args.strategies.split(","):
                times = {v: {p: [] for p in (*PHASES, "idle")} for v in VARIANTS}
                for k in range(args.rounds + 1):  # round 0 warms kernels and allocators, untimed
                    q, docs = random_layout(engines[next(iter(VARIANTS))], n, 64, vocab, seed=1000 * k + 7)
                    order = list(engines.items())
                    for v, eng in (order if k % 2 else order[::-1]):  # each variant goes first every other round
                        eng.precompute(docs)
                        lg = layouts_of(eng, name)
                        lg.defer = VARIANTS[v]
                        lg.reset()
                        got = []
                        for phase in PHASES:
                            before = (lg.eager_runs, lg.captures, lg.replays)
                            r = eng.generate(question_ids=q, docs=docs, strategy=name, recompute_ratio=args.ratio,
                                             max_new_tokens=1)
                            t0 = time.perf_counter()
                            if not eng.wait_for_deferred(600):  # the idle-time capture, if this request left one
                                raise SystemExit(f"{v} {name} {phase}: the deferred capture did not finish")
                            torch.cuda.synchronize()
                            idle_ms = (time.perf_counter() - t0) * 1e3
                            after = (lg.eager_runs, lg.captures, lg.replays)
                            if tuple(a - b for a, b in zip(after, before)) != WANT[VARIANTS[v]][phase]:
                                raise SystemExit(f"{v} {name} {phase}: graph counters moved {before} -> {after}")
                            got.append(r.token_ids)
                            if k:
                                times[v][phase].append(r.ttft_s * 1e3)
                                if phase == "due":
                                    times[v]["idle"].append(idle_ms if VARIANTS[v] else 0.0)
                        if len({tuple(t) for t in got}) != 1:
                            raise SystemExit(f"{v} {name}: the three phases answered differently: {got}")
                        eng.forget([d.id for d in docs])
                if args.warmup_range:  # the server's start-up capture of every bucket of a range
                    # untimed first: the range's new shapes compile their kernels once per process
                    eng = next(iter(engines.values()))
                    for _ in range(2):  # the first compiles, the second is timed
                        layouts_of(eng, name).reset()
                        w = eng.warmup(contexts=(max(64, n // 2 - 64), n), strategies=[name],
                                       question_tokens=(16, 128), ratios=[args.ratio])
                    warm_s.append((shape, n, name, w["seconds"], w["captured"], w["requests"]))
                    print(f"{shape} {n:6d}  {name:9s} engine.warmup: {w['requests']} requests, "
                          f"{w['captured']} graphs, {w['seconds']:.2f} s", flush=True)
                for eng in engines.values():  # free this strategy's graphs (the 8B shape's fill an 80 GB card)
                    layouts_of(eng, name).reset()
                torch.cuda.empty_cache()
                for v in VARIANTS:
                    med = {p: statistics.median(times[v][p]) for p in (*PHASES, "idle")}
                    rows.append((shape, n, name, v, med, hf_ms))
                    print(f"{shape} {n:6d}  {name:9s} {v:22s} eager {med['eager']:8.2f}  due "
                          f"{med['due']:8.2f}  (idle capture {med['idle']:8.2f})  replay {med['replay']:8.2f} ms  "
                          f"(due / eager {med['due'] / med['eager']:.2f}x, HF / due {hf_ms / med['due']:.2f}x)",
                          flush=True)
            del engines
            torch.cuda.empty_cache()
    print("\n| shape | context | strategy | variant | eager ms | due request ms | idle capture ms | replay ms "
          "| HF SDPA ms |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for shape, n, name, v, med, hf_ms in rows:
        print(f"| {shape} | {n} | {name} | {v} | {med['eager']:.2f} | {med['due']:.2f} | {med['idle']:.2f} "
              f"| {med['replay']:.2f} | {hf_ms:.2f} |")
    if warm_s:
        print("\n| shape | context | strategy | engine.warmup s | graphs | requests |")
        print("|---|---:|---|---:|---:|---:|")
        for shape, n, name, sec, cap, req in warm_s:
            print(f"| {shape} | {n} | {name} | {sec:.2f} | {cap} | {req} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
