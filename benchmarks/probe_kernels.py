"""The question probe's attention and scoring kernels at their launch options, side by side (GPU).

The probe of infoflow / prophetkv runs 64 question rows over every key of the prompt at each layer: attention
(`fused_attention`, keys split across programs and merged) and, at the probed layers, the averaged attention
probabilities (`attention_scores`, a statistics pass and a probabilities pass). At these shapes the kernels are
short and their launch options (key splits, tiles, warps, up-front rotation) decide their time. For each shape
and prompt length this times the engine's default options and a sweep of the others, each by CUDA-graph replay,
checks every variant against the default's result, and prints the fastest with its ratio to the default; then
the scores normalised by the attention's own softmax statistics (`attention_and_scores`, no statistics pass)
beside the two calls.

    python benchmarks/probe_kernels.py --n 2048 8192 32768
"""
from __future__ import annotations

import argparse
import itertools

import torch

from kvfuse.kernels._triton import attention as tri_attn
from kvfuse.kernels._triton import attn_scores as tri_scores
from kvfuse.kernels.attention import fused_attention
from kvfuse.kernels.attn_scores import attention_and_scores, attention_scores

from positions_as_indices import SHAPES, graph_ms, pool_case


def _sweep(run, ref, options, tol):
    """Times `run(**opt)` for the default ({}) and every option; returns rows (opt, ms, max error)."""
    out = []
    for opt in [{}] + options:
        try:
            got = run(**opt)
            err = float((got.float() - ref.float()).abs().max())
            if err > tol:
                out.append((opt, float("nan"), err))
                continue
            out.append((opt, graph_ms(lambda: run(**opt)), err))
        except Exception as e:  # an option the kernel cannot take at this shape (shared memory, registers)
            out.append((opt, float("nan"), str(e).splitlines()[0][:60]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--shapes", default="qwen05b,llama8b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--no-sweep", action="store_true", help="only the default options and the shared statistics")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    attn_opts = [dict(num_splits=s, block_m=bm, block_n=bn, num_warps=w, num_stages=st, prerotate=pr)
                 for s, (bm, bn), w, st, pr in itertools.product(
                     (1, 2, 4, 8, 16, 32), ((16, 64), (32, 64), (64, 64), (64, 32), (128, 64)),
                     (4, 8), (3,), (False, True))]
    score_opts = [dict(num_splits=s, block_m=bm, block_n=bn, num_warps=w, num_stages=st, prerotate=pr)
                  for s, (bm, bn), w, st, pr in itertools.product(
                      (1, 2, 4, 8, 16), ((16, 32), (16, 64), (32, 64), (64, 64), (16, 128)),
                      (4,), (2,), (False, True))]
    for shape in args.shapes.split(","):
        hq, hkv, d, base = SHAPES[shape]
        scale = d ** -0.5
        for n in args.n:
            k, v, rows, cos, sin = pool_case(n, hkv, d, base, g, dev)
            q_pos = torch.arange(n - args.rows, n, device=dev)
            q = torch.randn(args.rows, hq, d, generator=g).to(torch.bfloat16).to(dev)

            def attn(**o):
                return tri_attn.launch(q, q_pos, k, v, rows, None, cos, sin, scale, **o)

            def scores(**o):
                return tri_scores.launch(q, q_pos, k, rows, None, cos, sin, scale, **o)

            for label, run, opts, tol in (("attention", attn, attn_opts, 2e-2), ("scores", scores, score_opts, 1e-4)):
                ref = run()
                res = _sweep(run, ref, [] if args.no_sweep else opts, tol)
                base_ms = res[0][1]
                ok = sorted((r for r in res if r[1] == r[1]), key=lambda r: r[1])
                print(f"\n{shape} N={n} {label} ({args.rows} rows): default {base_ms:.4f} ms "
                      f"({len(ok)} of {len(res)} options ran)")
                for opt, ms, err in ok[:args.top]:
                    print(f"   {ms:.4f} ms  {base_ms / ms:4.2f}x  {opt or 'default'}  err {err:.2e}")
            # the scores normalised by the attention's own softmax statistics, beside the two calls
            args_ = (q, q_pos, k, v, rows, None, cos, sin, scale)
            two = graph_ms(lambda: (fused_attention(*args_), attention_scores(q, q_pos, k, rows, None, cos, sin, scale)))
            one = graph_ms(lambda: attention_and_scores(*args_))
            err = float((attention_and_scores(*args_)[1] - attention_scores(q, q_pos, k, rows, None, cos, sin,
                                                                             scale)).abs().max())
            print(f"{shape} N={n} attention + scores: two calls {two:.4f} ms, scores from the attention's "
                  f"statistics {one:.4f} ms ({two / one:4.2f}x; scores differ by {err:.1e})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
