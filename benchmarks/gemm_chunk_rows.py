"""Why the CPU documents pass runs its GEMMs in 256-row chunks (engine/doccache.py DOCUMENT_CHUNK_ROWS).

For the embedded model's MLP shapes (hidden 896, ffn 4864), `--rows` input rows through gate/up then down: one GEMM
over all rows against the same rows in chunks of 64-512 (the last padded), side by side in one run; and whether a
row's result at a fixed shape depends on its place in the call or on its neighbours (the invariance the chunks rely
on), and on the thread count (1 against the process default).

    python benchmarks/gemm_chunk_rows.py --dtype bfloat16
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dt = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    w_gu = torch.randn(9728, 896, generator=g).to(dt)
    w_down = torch.randn(896, 4864, generator=g).to(dt)
    x = torch.randn(args.rows, 896, generator=g).to(dt)

    def mlp(rows):
        return F.linear(F.linear(rows, w_gu)[:, :4864], w_down)

    def chunked(rows, c):
        pad = -rows.shape[0] % c
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        return torch.cat([mlp(rows[a:a + c]) for a in range(0, rows.shape[0], c)])[:rows.shape[0] - pad]

    def timed(fn):
        fn()
        t0 = time.perf_counter()
        for _ in range(args.reps):
            fn()
        return (time.perf_counter() - t0) / args.reps

    whole = timed(lambda: mlp(x))
    print(f"{args.dtype}, {args.rows} rows, {torch.get_num_threads()} threads: one GEMM {whole * 1e3:.1f} ms")
    for c in (64, 128, 256, 512):
        t = timed(lambda c=c: chunked(x, c))
        ref = chunked(x[:c], c)
        moved = torch.cat([torch.randn(37, 896, generator=g).to(dt), x[:c - 37]])
        same = torch.equal(chunked(moved, c)[37:], ref[:c - 37])
        print(f"  chunks of {c:3d}: {t * 1e3:7.1f} ms ({t / whole:4.2f}x one GEMM); a row moved 37 places, new "
              f"neighbours: {'same bits' if same else 'DIFFERENT'}")
    n = torch.get_num_threads()
    a = mlp(x[:256])
    torch.set_num_threads(1)
    b = mlp(x[:256])
    torch.set_num_threads(n)
    print(f"  256 rows at 1 thread against {n}: {'same bits' if torch.equal(a, b) else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
