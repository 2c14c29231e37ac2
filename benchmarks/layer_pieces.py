"""The dense pieces of one decoder layer at a real shape, each way kvfuse could run them, timed side by side.

For a prompt of T rows at a model shape (random bf16 weights): causal attention by every SDPA backend, with K/V
heads repeated beforehand or handed over grouped (GQA); q/k/v as three GEMMs or one over concatenated weights;
the MLP's gate and up as two GEMMs or one, with SiLU-and-multiply in torch or fused. Prints ms per layer (median of
CUDA-event timings) and each variant's ratio to the first one of its group.

    python benchmarks/layer_pieces.py --shapes llama8b,qwen05b --rows 2048,8192
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after site-packages: see kvfuse/__init__.py

SHAPES = {  # hidden, heads, kv heads, head_dim, ffn
    "llama8b": (4096, 32, 8, 128, 14336),
    "qwen05b": (896, 14, 2, 64, 4864),
}


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def attention_rows(t: int, hq: int, hkv: int, d: int) -> list[tuple[str, object]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = "cuda"
    q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16)
    g = hq // hkv
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    rows = []
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def repeated(be=be):
            with sdpa_kernel([be]):
                kr, vr = kh.repeat_interleave(g, dim=1), vh.repeat_interleave(g, dim=1)
                return F.scaled_dot_product_attention(qh, kr, vr, is_causal=True)[0].transpose(0, 1).contiguous()

        def grouped(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)[0].transpose(0, 1)

        def contiguous_heads(be=be):  # head-major inputs made contiguous first
            with sdpa_kernel([be]):
                kr = kh.repeat_interleave(g, dim=1)
                vr = vh.repeat_interleave(g, dim=1)
                return F.scaled_dot_product_attention(qh.contiguous(), kr, vr, is_causal=True)[0].transpose(0, 1)

        rows.append((f"sdpa {name}, K/V repeated", repeated))
        rows.append((f"sdpa {name}, GQA (enable_gqa)", grouped))
        rows.append((f"sdpa {name}, repeated, q contiguous, no out copy", contiguous_heads))
    return rows


def dense_rows(t: int, hidden: int, hq: int, hkv: int, d: int, ffn: int) -> dict[str, list[tuple[str, object]]]:
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(t, hidden, device=dev, dtype=dt)
    wq = torch.randn(hq * d, hidden, device=dev, dtype=dt) * 0.02
    wk = torch.randn(hkv * d, hidden, device=dev, dtype=dt) * 0.02
    wv = torch.randn(hkv * d, hidden, device=dev, dtype=dt) * 0.02
    wqkv = torch.cat([wq, wk, wv])
    wg = torch.randn(ffn, hidden, device=dev, dtype=dt) * 0.02
    wu = torch.randn(ffn, hidden, device=dev, dtype=dt) * 0.02
    wgu = torch.cat([wg, wu])
    wd = torch.randn(hidden, ffn, device=dev, dtype=dt) * 0.02

    def qkv3():
        return F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)

    def qkv1():
        return F.linear(x, wqkv).split([hq * d, hkv * d, hkv * d], dim=-1)

    def mlp_today():
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    def mlp_one_gemm():
        gu = F.linear(x, wgu)
        return F.linear(F.silu(gu[:, :ffn]) * gu[:, ffn:], wd)

    qkv = [("qkv: 3 GEMMs", qkv3), ("qkv: 1 GEMM", qkv1)]
    mlp = [("mlp: gate, up, silu*up, down", mlp_today), ("mlp: one gate|up GEMM, torch silu*up", mlp_one_gemm)]
    try:
        from kvfuse.kernels.silu_mul import silu_mul

        def mlp_fused():
            return F.linear(silu_mul(F.linear(x, wgu)), wd)

        mlp.append(("mlp: one gate|up GEMM, fused silu*up kernel", mlp_fused))
    except ImportError:
        pass
    return {"qkv": qkv, "mlp": mlp}


def tail_rows(t: int, hidden: int, hq: int, hkv: int, d: int) -> dict[str, list[tuple[str, object]]]:
    """The attention call as the plain prefill makes it (v a column view of the packed q/k/v output) and the
    residual add after the output projection, each beside its alternatives."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, dt = "cuda", torch.bfloat16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=dt)
    q = torch.randn(t, hq, d, device=dev, dtype=dt)          # RoPE's output: contiguous token-major
    k = torch.randn(t, hkv, d, device=dev, dtype=dt)
    v_view = qkv[:, (hq + hkv) * d:].view(t, hkv, d)            # a column view, as served
    v = v_view.contiguous()
    h = torch.randn(t, hidden, device=dev, dtype=dt)
    a = torch.randn(t, hq * d, device=dev, dtype=dt)
    wo = torch.randn(hidden, hq * d, device=dev, dtype=dt) * 0.02

    def sdpa(qq, kk, vv):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qq.transpose(0, 1)[None], kk.transpose(0, 1)[None],
                                                  vv.transpose(0, 1)[None], is_causal=True, enable_gqa=True)[0]

    out = sdpa(q, k, v_view).transpose(0, 1)
    print(f"  cudnn output transposed back to [T, H, D]: strides {tuple(out.stride())}, "
          f"contiguous={out.is_contiguous()}")
    attn = [("cudnn, v a column view, out .contiguous() (served)", lambda: sdpa(q, k, v_view).transpose(0, 1).contiguous()),
            ("cudnn, v contiguous, out .contiguous()", lambda: sdpa(q, k, v).transpose(0, 1).contiguous()),
            ("cudnn, v a column view, out as it comes", lambda: sdpa(q, k, v_view).transpose(0, 1)),
            ("cudnn, v contiguous, out as it comes", lambda: sdpa(q, k, v).transpose(0, 1))]
    res = [("residual: h + linear(a, wo) (served)", lambda: h + F.linear(a, wo)),
           ("residual: addmm(h, a, wo.T)", lambda: torch.addmm(h, a, wo.t()))]
    try:
        from kvfuse.kernels.rmsnorm import rms_norm

        ln = torch.ones(hidden, device=dev, dtype=dt)
        res.append(("residual + rmsnorm: h + linear, rms_norm (served)",
                    lambda: rms_norm(h + F.linear(a, wo), ln, 1e-6)))
        res.append(("residual + rmsnorm: addmm, rms_norm", lambda: rms_norm(torch.addmm(h, a, wo.t()), ln, 1e-6)))
    except ImportError:
        pass
    return {"tail attention": attn, "tail residual": res}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama8b,qwen05b")
    ap.add_argument("--rows", default="2048,8192")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for shape in args.shapes.split(","):
        hidden, hq, hkv, d, ffn = SHAPES[shape]
        for t in map(int, args.rows.split(",")):
            groups = {"attention": attention_rows(t, hq, hkv, d), **dense_rows(t, hidden, hq, hkv, d, ffn),
                      **tail_rows(t, hidden, hq, hkv, d)}
            for group, rows in groups.items():
                base = None
                for name, fn in rows:
                    try:
                        ms = timed(fn)
                    except Exception as exc:  # noqa: BLE001  (a backend that refuses the shape is reported)
                        print(f"{shape:8s} T={t:6d}  {name:55s}  refused: {type(exc).__name__}: {str(exc)[:80]}")
                        continue
                    base = base or ms
                    print(f"{shape:8s} T={t:6d}  {name:55s}  {ms:8.3f} ms/layer  {base / ms:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
