"""What a question probe costs on the GPU, piece by piece, beside the floors it could reach.

The query-aware strategies (infoflow, prophetkv, qcfuse) choose their rows from the question's attention over the
re-positioned cache: a pass of the question's rows through the layers up to the deepest probed one. For each
strategy and context this prints, in one run:

- the probe's time as a request sees it (graph replay of its bucket, the `selection_s` of a repeated layout);
- the same layer chain with no attention at all (norms and GEMMs of the same rows, captured as one graph): what
  the probe costs if attention and scoring were free;
- the weights' floor: the bytes of those layers' weights over the measured copy bandwidth;
- the probe run eagerly under the profiler: its kernels grouped by name (count, device ms), the attention and
  scoring kernels beside the GEMMs.

    python benchmarks/probe_cost.py --shape llama8b --contexts 2048,8192 --strategies infoflow,prophetkv
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_pieces import timed  # noqa: E402
from ttft import build, ceilings, make_engine, request  # noqa: E402


def _graph_ms(fn) -> float:
    """Median device ms of `fn` captured as one CUDA graph (the engine's own capture, layer_pieces' timing)."""
    from kvfuse.engine.cudagraph import capture_graph

    return timed(capture_graph(fn, "cuda")[0].replay)


def _short(name: str) -> str:
    for key in ("nvjet", "gemm", "cutlass"):
        if key in name:
            return "GEMM " + name.split("(")[0][:48]
    return name.split("(")[0].replace("void ", "")[:60]


def kernel_groups(prof, groups=None) -> dict:
    """Device-side entries of a torch profile (kernels, copies, sets: they carry no CPU time) grouped by short
    name: {name: [count, device ms]}, added to `groups` when given."""
    groups = collections.defaultdict(lambda: [0, 0.0]) if groups is None else groups
    for e in prof.key_averages():
        if e.self_device_time_total > 0 and e.self_cpu_time_total == 0:
            g = groups[_short(e.key)]
            g[0] += e.count
            g[1] += e.self_device_time_total / 1e3
    return groups


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama8b")
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--strategies", default="infoflow,prophetkv")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=16)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from kvfuse.engine import bucketed

    _, gbs = ceilings("cuda")
    model = build(args.shape, "cuda")
    vocab = model.config.vocab_size
    seen = {}
    orig = bucketed.LayoutGraphs._select

    def spy(self, h, inp, strategy, ratio, pool):  # the probe's bucket (rows M_b) and the layers it walks
        seen["mb"], seen["nb"] = h.mb, h.nb
        seen["layers"] = strategy.probe_layers(self.spec.n_layers)
        return orig(self, h, inp, strategy, ratio, pool)

    bucketed.LayoutGraphs._select = spy
    rows = []
    for n in (int(x) for x in args.contexts.split(",")):
        for name in args.strategies.split(","):
            engine = make_engine(model, "pool", pool_tokens=n + 1024, scratch=n + 64)
            q, docs = request(engine, n, 512, args.question_tokens, vocab, seed=1)
            engine.precompute(docs)

            def call():
                return engine.generate(question_ids=q, docs=docs, strategy=name, recompute_ratio=args.ratio,
                                       max_new_tokens=1)

            for _ in range(3):
                call()
            sel = statistics.median(call().selection_s for _ in range(args.reps)) * 1e3
            ttft = statistics.median(call().ttft_s for _ in range(args.reps)) * 1e3
            layout = engine.runner.layout
            dec, spec = layout.dec, layout.spec
            deepest = max(seen["layers"])
            x0 = torch.randn(seen["mb"], spec.hidden, device="cuda", dtype=dec.dtype) * 0.1
            attn = torch.zeros(seen["mb"], spec.n_heads, spec.head_dim, device="cuda", dtype=dec.dtype)

            def dense():
                x = x0
                for i in range(deepest + 1):
                    dec.project(i, x)
                    if i < deepest:
                        x = dec.finish(i, x, attn)
                return x

            dense_ms = _graph_ms(dense)
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for i in range(deepest + 1)
                        for t in vars(dec.layers[i]).values() if isinstance(t, torch.Tensor)}  # packed: views
            w_bytes = sum(storages.values())
            floor_ms = w_bytes / (gbs * 1e9) * 1e3
            # the probe eagerly, under the profiler: its kernels
            layout.graphs = False
            call()
            torch.cuda.synchronize()
            held = []

            def profiled_spy(self, h, inp, strategy, ratio, pool):  # the prefill runs on the engine's own thread
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    out = spy(self, h, inp, strategy, ratio, pool)
                    torch.cuda.synchronize()
                held.append(prof)
                return out

            bucketed.LayoutGraphs._select = profiled_spy
            call()
            bucketed.LayoutGraphs._select = spy
            layout.graphs = True
            groups = kernel_groups(held[0])
            busy = sum(v[1] for v in groups.values())
            launches = sum(v[0] for v in groups.values())
            print(f"\n=== {args.shape} {n} {name}: probe {sel:.2f} ms replayed (TTFT {ttft:.2f} ms, share "
                  f"{sel / ttft:.1%}); layers 0..{deepest} at M_b={seen['mb']} rows, N_b={seen['nb']} keys; same chain "
                  f"without attention {dense_ms:.2f} ms; weights' floor {floor_ms:.2f} ms ({w_bytes / 1e9:.2f} GB at "
                  f"{gbs:.0f} GB/s); eager: {launches} kernels, {busy:.2f} ms busy", flush=True)
            for k, (c, ms) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:args.top]:
                print(f"  {ms:8.3f} ms  {c:5d}x  {k}")
            rows.append((n, name, sel, ttft, dense_ms, floor_ms, busy))
            engine.close()
    print("\n| context | strategy | probe ms (replay) | TTFT ms | share | no-attention chain ms | weights' floor ms |"
          " eager busy ms |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n, name, sel, ttft, dense_ms, floor_ms, busy in rows:
        print(f"| {n} | {name} | {sel:.2f} | {ttft:.2f} | {sel / ttft:.1%} | {dense_ms:.2f} | {floor_ms:.2f} | "
              f"{busy:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
