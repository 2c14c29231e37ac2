"""Fused attention and attention scores with key positions read and searched (kv_pos given) vs computed (kv_pos
None: key j at position j, the fused prefills' case), side by side at the engine's shapes, GPU time by CUDA-graph
replay.

Shapes: the question probe (64 rows over N keys) and a 15% fused pass (the recomputed rows, sorted, plus the 64
question rows), at the Qwen2.5-0.5B (14 q / 2 kv heads, head_dim 64) and Llama-3.1-8B (32 / 8, 128) attention
shapes; keys gathered from a pool in shuffled 512-row documents, as the fused prefills read them.

    python benchmarks/positions_as_indices.py --n 2048 8192 32768
"""
from __future__ import annotations

import argparse

import torch

from kvfuse.kernels.attention import fused_attention_triton
from kvfuse.kernels.attn_scores import attention_scores_triton

SHAPES = {"qwen05b": (14, 2, 64, 1e6), "llama8b": (32, 8, 128, 5e5)}


def tables(n: int, d: int, base: float, device):
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
    ang = torch.arange(n, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], -1)
    return emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


def pool_case(n: int, hkv: int, d: int, base: float, g, dev):
    """(k, v, rows, cos, sin): a pool of n + 1024 bf16 K/V rows, the n attended gathered from it in shuffled
    512-row documents (as the fused prefills read them), RoPE tables for n + 64 positions."""
    pool = n + 1024
    k = torch.randn(pool, hkv, d, generator=g).to(torch.bfloat16).to(dev)
    v = torch.randn(pool, hkv, d, generator=g).to(torch.bfloat16).to(dev)
    docs = torch.randperm(pool // 512, generator=g)
    rows = torch.cat([torch.arange(x * 512, x * 512 + 512) for x in docs.tolist()])[:n].to(dev)
    return (k, v, rows, *tables(n + 64, d, base, dev))


def graph_ms(fn, reps: int = 50) -> float:
    """Median-free mean GPU time of one call, replayed from a CUDA graph (no launch overhead)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--shapes", default="qwen05b,llama8b")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    print(f"{'shape':>8} {'N':>6} {'op':>22} {'rows':>5} {'given ms':>9} {'computed ms':>11} {'ratio':>6}")
    for shape in args.shapes.split(","):
        hq, hkv, d, base = SHAPES[shape]
        for n in args.n:
            k, v, rows, cos, sin = pool_case(n, hkv, d, base, g, dev)
            question = torch.arange(n - 64, n, device=dev)
            picked = torch.sort(torch.randperm(n - 64, generator=g)[: int(0.15 * n)]).values.to(dev)
            kv_pos = torch.arange(n, device=dev)
            for label, q_pos in (("probe", question), ("fused 15%", torch.cat([picked, question]))):
                q = torch.randn(q_pos.numel(), hq, d, generator=g).to(torch.bfloat16).to(dev)
                ops = [("attention " + label, lambda p: fused_attention_triton(q, q_pos, k, v, rows, p, cos, sin,
                                                                               d ** -0.5))]
                if label == "probe":
                    ops.append(("scores " + label, lambda p: attention_scores_triton(q, q_pos, k, rows, p, cos, sin,
                                                                                     d ** -0.5)))
                for name, op in ops:
                    given, computed = op(kv_pos), op(None)
                    assert torch.equal(given, computed), f"{shape} {n} {name}: results differ"
                    t_given = graph_ms(lambda: op(kv_pos))
                    t_computed = graph_ms(lambda: op(None))
                    print(f"{shape:>8} {n:>6} {name:>22} {q_pos.numel():>5} {t_given:>9.4f} {t_computed:>11.4f} "
                          f"{t_given / t_computed:>5.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
