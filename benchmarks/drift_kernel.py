"""The drift correction's write per layer, the torch reference and the Triton kernels side by side (GPU).

A bucket's drift layer writes every candidate slot's corrected K/V row (kernels/drift.py): N prompt slots, 15% of
them computed plus 64 question rows, the documents 512 tokens each. Both versions are timed by CUDA-graph replay
on the same inputs, checked against each other first, and the table gives their times and ratio. Multiply by the
drift layers (from a quarter of the depth: 18 of 24 on the 0.5B shape, 24 of 32 on the 8B one) for a request.

    python benchmarks/drift_kernel.py --n 2048 8192 32768
"""
from __future__ import annotations

import argparse

import torch

from kvfuse.kernels.drift import drift_correct_reference, drift_correct_triton

from positions_as_indices import SHAPES, graph_ms


def case(n: int, kv: int, d: int, device):
    g = torch.Generator(device="cpu").manual_seed(n)
    rows = 2 * n + 8  # cached rows [0, n), scratch rows [n, 2n)
    kpool = torch.randn(rows, kv, d, generator=g).to(device, torch.bfloat16)
    vpool = torch.randn(rows, kv, d, generator=g).to(device, torch.bfloat16)
    doc = torch.arange(n) // 512
    doc[:32] = -1  # the prefix
    doc[-64:] = -1  # the question
    n_docs = int(doc.max()) + 1
    computed = torch.cat([torch.randperm(n - 96, generator=g)[:int(0.15 * n)] + 32, torch.arange(n - 64, n)])
    computed = torch.sort(computed).values
    k = torch.randn(computed.numel(), kv, d, generator=g).to(device, torch.bfloat16)
    v = torch.randn(computed.numel(), kv, d, generator=g).to(device, torch.bfloat16)
    slot_base = torch.arange(n)
    dst = torch.where(doc >= 0, n + torch.arange(n), torch.full((n,), 2 * n + 7))
    args = [t.to(device) for t in (computed, doc[computed], slot_base, doc, dst)]
    return kpool, vpool, k, v, args, n_docs + 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--shapes", default="qwen05b,llama8b")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print("| shape | slots | torch reference ms | triton ms | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        _, kv, d, _ = SHAPES[shape]
        for n in args.n:
            kpool, vpool, k, v, (fb, fd, sb, sd, dst), n_docs = case(n, kv, d, dev)
            pools = {}
            for name, fn in (("torch", drift_correct_reference), ("triton", drift_correct_triton)):
                kp, vp = kpool.clone(), vpool.clone()
                fn(kp, vp, k, v, fb, fd, sb, sd, dst, n_docs, 0.5)
                pools[name] = (kp, vp)
            live = sd >= 0
            for i in range(2):
                a, b = pools["torch"][i][dst[live]].float(), pools["triton"][i][dst[live]].float()
                err = float((a - b).abs().max())
                if err > 0.07:  # bf16 rounding of float32 sums taken in another order
                    raise SystemExit(f"{shape} {n}: triton differs from the reference by {err}")
            kp, vp = kpool.clone(), vpool.clone()
            t_ref = graph_ms(lambda: drift_correct_reference(kp, vp, k, v, fb, fd, sb, sd, dst, n_docs, 0.5))
            t_tri = graph_ms(lambda: drift_correct_triton(kp, vp, k, v, fb, fd, sb, sd, dst, n_docs, 0.5))
            print(f"| {shape} | {n} | {t_ref:.4f} | {t_tri:.4f} | {t_ref / t_tri:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
