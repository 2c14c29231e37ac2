"""Two checks behind docs/quality/sift_coinrag.md's "fidelity does not follow the mass" (issue 12; embedded model, CPU).

For one dev prompt, with sift's marks (cross="marks", so the plans are fixed by the indexes, not by the queries):
1. Containment: at each given layer, does the plan at the larger kernel block keep every (query, key) pair the plan
   at the smaller one keeps? Printed: pairs kept by each, and pairs of the smaller plan missing from the larger.
2. The kernel: at layer 0 (the prompt's own q, k, v), the torch reference of the block-sparse attention against
   masked softmax attention written out here in float32 (rows in chunks, the mask built from the lists by hand):
   the largest absolute difference, per block size.

    python benchmarks/sift_plan_check.py --data ../shared/data --example musique_cacheblend-032 --layers 0,5,12,23

`--masks` instead times, on this CPU, why the torch reference runs lists per KV head as one SDPA call per KV head:
one masked SDPA call with a [T, T] mask, with a [Hq, T, T] mask, and split per KV head (random bf16 q, k, v; the
embedded model's 14 q / 2 kv heads, head dim 64).

    python benchmarks/sift_plan_check.py --masks --tokens 4096
"""
from __future__ import annotations

import argparse

import torch

from kvfuse.engine.api import FusionEngine
from kvfuse.engine.fusion import make_strategy
from kvfuse.engine.prompt import PROMPT_PRESETS
from kvfuse.evaluation.data import read_jsonl
from kvfuse.kernels.block_sparse import block_sparse_attention_reference
from kvfuse.kernels.causal import token_major_sdpa
from kvfuse.kernels.rope import apply_rope


def token_pairs(lists: torch.Tensor, counts: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """[n, n] bool: query i sees key j (j <= i and j's block listed for i's), built row block by row block."""
    out = torch.zeros(n, n, dtype=torch.bool)
    for b in range(lists.shape[0]):
        rows = slice(b * block, min((b + 1) * block, n))
        for kb in lists[b, :int(counts[b])].tolist():
            out[rows, kb * block:min((kb + 1) * block, n)] = True
    return out & torch.tril(torch.ones(n, n, dtype=torch.bool))


def masked_attention(q, k, v, pairs, scale, chunk: int = 256) -> torch.Tensor:
    """Softmax attention in float32 over the allowed pairs ([T, Hq, D] q, [T, Hkv, D] k and v)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, 1)
    vf = v.float().repeat_interleave(group, 1)
    out = []
    for a in range(0, q.shape[0], chunk):
        s = torch.einsum("thd,khd->htk", q[a:a + chunk].float(), kf) * scale
        s = s.masked_fill(~pairs[a:a + chunk][None], float("-inf"))
        out.append(torch.einsum("htk,khd->thd", torch.softmax(s, -1), vf))
    return torch.cat(out)


@torch.inference_mode()
def time_masks(t: int, hq: int = 14, hkv: int = 2, d: int = 64) -> None:
    import time

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, h, d, generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv))
    mask = (torch.rand(hkv, t, t, generator=g) < 0.5) | torch.eye(t, dtype=torch.bool)
    mask &= torch.tril(torch.ones(t, t, dtype=torch.bool))
    group = hq // hkv
    runs = {
        "one [T, T] mask (shared lists)": lambda: token_major_sdpa(q, k, v, 0.125, attn_mask=mask[0]),
        "one [Hq, T, T] mask": lambda: token_major_sdpa(q, k, v, 0.125, attn_mask=mask.repeat_interleave(group, 0)),
        "a call per KV head": lambda: torch.cat([token_major_sdpa(
            q[:, g_ * group:(g_ + 1) * group], k[:, g_:g_ + 1], v[:, g_:g_ + 1], 0.125, attn_mask=mask[g_])
            for g_ in range(hkv)], 1),
    }
    for name, fn in runs.items():
        fn()
        t0 = time.perf_counter()
        fn()
        print(f"{t} tokens, {name}: {time.perf_counter() - t0:.3f} s")


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data")
    ap.add_argument("--masks", action="store_true", help="time the CPU's masked SDPA calls instead")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--example", default="musique_cacheblend-032")
    ap.add_argument("--layers", default="0,5,12,23")
    ap.add_argument("--blocks", default="16,64", help="kernel block sizes, smaller first")
    args = ap.parse_args()
    if args.masks:
        time_masks(args.tokens)
        return 0
    if not args.data:
        ap.error("--data is needed (or --masks)")
    ex = next((e for e in read_jsonl(args.data) if e.id == args.example), None)
    if ex is None:
        raise SystemExit(f"no example {args.example!r} in {args.data}")
    eng = FusionEngine.from_pretrained(device="cpu", disk_cache=False, adapter=None, prompt=PROMPT_PRESETS["qa"])
    layout = eng.layout(ex.question, ex.docs)
    n, layers = layout.n, [int(x) for x in args.layers.split(",")]
    blocks = [int(x) for x in args.blocks.split(",")]
    plans = {}
    for b in blocks:
        strat = make_strategy("sift", kernel_block=b, cross="marks", min_tokens=0, max_density=1.0, on_miss="compute")
        (plan, _, block), rep = eng._sift_plan(layout, strat, None)
        plans[b] = plan
        print(f"{args.example}: {n} tokens, kernel block {block}: density {rep['density']}")
    small, large = blocks[0], blocks[-1]
    print(f"\nlayer | pairs kept at {small} | pairs kept at {large} | pairs of the {small} plan missing at {large}")
    for i in layers:
        got = {b: token_pairs(*plans[b].layer(i), b, n) for b in (small, large)}
        print(f"{i:5d} | {int(got[small].sum()):,} | {int(got[large].sum()):,} | "
              f"{int((got[small] & ~got[large]).sum()):,}")
    dec, spec = eng.decoder, eng.decoder.spec
    cos, sin = eng.runner.rope(n)
    q, k, v = dec.project(0, dec.embed_tokens(layout.ids.to(dec.device)))
    qr, kr = apply_rope(q, cos[:n], sin[:n]), apply_rope(k, cos[:n], sin[:n])
    print(f"\nlayer 0, {q.dtype}: the torch reference against float32 masked attention")
    for b in blocks:
        lists, counts = plans[b].layer(0)
        ref = block_sparse_attention_reference(qr, kr, v, lists, counts, b, spec.scale)
        want = masked_attention(qr, kr, v, token_pairs(lists, counts, b, n), spec.scale)
        print(f"  kernel block {b}: max |difference| {float((ref.float() - want).abs().max()):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
