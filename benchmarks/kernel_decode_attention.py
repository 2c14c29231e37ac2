"""decode_attention on the GPU: the Triton kernel's achieved bandwidth against the copy ceiling, per launch
configuration, beside the torch reference, for batches of sequences at Llama-3.1-8B's attention shape
(32 q heads, 8 kv heads, head_dim 128, bf16), every sequence reading its keys through a row map.

    python benchmarks/kernel_decode_attention.py --batches 1,8,32,128 --context 5184
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after site-packages: see kvfuse/__init__.py


def graphed(fn):
    """fn captured in a CUDA graph (as the engine runs it): the timing is the GPU's, not Python's launches."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def bench(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=5184)
    ap.add_argument("--shared", type=float, default=0.8, help="fraction of each sequence read from shared rows")
    args = ap.parse_args()
    from kvfuse.kernels.decode_attention import decode_attention_reference
    from kvfuse.kernels._triton.decode_attention import launch

    dev = torch.device("cuda")
    hq, hkv, d, n = 32, 8, 128, args.context
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    gbs = 2 * x.numel() / bench(lambda: x.clone(), 10) / 1e9
    del x
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "copy_gbs": round(gbs)}), flush=True)
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device=dev).float() / d))
    ang = torch.outer(torch.arange(n + 8, device=dev).float(), inv)
    cos, sin = (torch.cat([ang, ang], -1).cos().bfloat16(), torch.cat([ang, ang], -1).sin().bfloat16())
    for b in [int(v) for v in args.batches.split(",")]:
        shared = int(n * args.shared)
        rows = b * (n - shared) + shared + 1
        k = torch.randn(rows, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        own = torch.arange(b * (n - shared), device=dev).view(b, -1) + shared
        row_map = torch.cat([torch.arange(shared, device=dev).expand(b, -1), own], 1).contiguous()
        q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
        q_pos = torch.full((b,), n - 1, device=dev)
        byts = b * n * hkv * d * 2 * 2  # K and V rows each sequence reads
        ref = decode_attention_reference(q, q_pos, k, v, row_map, cos, sin, 0.088)
        t_ref = bench(graphed(lambda: decode_attention_reference(q, q_pos, k, v, row_map, cos, sin, 0.088)), 5)
        best = None
        for bn, warps, splits in itertools.product((32, 64, 128), (2, 4, 8), (None, 2, 8, 32)):
            kw = dict(block_n=bn, num_warps=warps, splits=splits)
            out = launch(q, q_pos, k, v, row_map, cos, sin, 0.088, **kw)
            err = (out.float() - ref.float()).abs().max().item()
            t = bench(graphed(lambda: launch(q, q_pos, k, v, row_map, cos, sin, 0.088, **kw)))
            row = dict(batch=b, block_n=bn, warps=warps, splits=splits, ms=round(t * 1e3, 3), gbs=round(byts / t / 1e9),
                       of_copy=round(byts / t / 1e9 / gbs, 2), max_err=round(err, 4))
            print(json.dumps(row), flush=True)
            if best is None or t < best[0]:
                best = (t, row)
        t_def = bench(graphed(lambda: launch(q, q_pos, k, v, row_map, cos, sin, 0.088)))
        print(json.dumps({"batch": b, "default_ms": round(t_def * 1e3, 3), "best": best[1],
                          "torch_reference_ms": round(t_ref * 1e3, 3),
                          "triton_vs_reference": round(t_ref / t_def, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
