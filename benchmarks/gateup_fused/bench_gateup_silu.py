"""GPU benchmark: fused gate|up GEMM + SiLU*mul against cuBLAS GEMM + separate SiLU*mul.

    python bench_gateup_silu.py --out results.csv [--shapes 896x4864,4096x14336] [--tokens 2048,8192,32768]

Needs CUDA, torch and triton only (gateup_silu.py must sit next to this file). For each (H, F) and T:
  unfused_torch   F.linear(x, w_gu) -> [T, 2F], then F.silu(gu[:, :F]) * gu[:, F:]   (the baseline)
  unfused_triton  F.linear, then a one-pass Triton silu*mul (read [T, 2F], write [T, F] once)
  gemm_only       F.linear alone: the cuBLAS GEMM floor
  fused:<name>    gateup_silu_triton with each config of CONFIGS
Times are CUDA-event medians over --iters runs after --warmup runs; by default L2 is flushed before
each timed run (the weights of one layer are not in L2 in a real model forward). TFLOP/s counts
2*T*H*2F. Fused outputs are compared with unfused_torch: max |diff| and the fraction of elements more
than one bf16 ulp (of the reference value) apart.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gateup_silu import CONFIGS, gateup_silu_reference, gateup_silu_triton  # noqa: E402


@triton.jit
def _silu_mul_rows(GU, OUT, FDIM, s_g, s_o, BLOCK: tl.constexpr):
    """out[t, :] = silu(gu[t, :F]) * gu[t, F:], rounded like torch (for the unfused_triton row)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < FDIM
    g = tl.load(GU + row * s_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * s_g + FDIM + offs, mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * s_o + offs, (a * u).to(OUT.dtype.element_ty), mask=mask)


def silu_mul_triton(gu: torch.Tensor) -> torch.Tensor:
    t, f = gu.shape[0], gu.shape[1] // 2
    out = torch.empty((t, f), dtype=gu.dtype, device=gu.device)
    block = 1024
    _silu_mul_rows[(t, triton.cdiv(f, block))](gu, out, f, gu.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


def unfused_torch(x, w):
    f = w.shape[0] // 2
    gu = F.linear(x, w)
    return F.silu(gu[:, :f]) * gu[:, f:]


def unfused_triton(x, w):
    return silu_mul_triton(F.linear(x, w))


def time_ms(fn, iters: int, warmup: int, flush: torch.Tensor | None) -> float:
    """Median CUDA-event time of fn() in ms; the L2 flush (if any) runs before the start event."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        if flush is not None:
            flush.zero_()
        torch.cuda._sleep(200_000)   # ~0.1 ms of GPU work queued ahead: the CPU launch cost of fn stays hidden
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(max |out - ref|, fraction differing by more than 1 bf16 ulp of ref, fraction differing at all)."""
    diff = (out.float() - ref.float()).abs()
    exp = torch.frexp(ref.float().abs().clamp_min(2.0 ** -126)).exponent
    ulp = torch.ldexp(torch.ones_like(diff), exp - 8)      # bf16: 8 significant bits
    return diff.max().item(), (diff > ulp).float().mean().item(), (diff > 0).float().mean().item()


def parse_shapes(s: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.lower().split("x")) for item in s.split(",") if item]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="CSV file to write")
    p.add_argument("--shapes", default="896x4864,4096x14336", help="comma-separated HxF")
    p.add_argument("--tokens", default="2048,8192,32768", help="comma-separated T values")
    p.add_argument("--configs", default="", help="comma-separated config names (default: all of CONFIGS)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 between timed runs")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("bench_gateup_silu.py needs a CUDA GPU (and TRITON_INTERPRET unset)")
    dev = torch.device("cuda")
    configs = CONFIGS
    if args.configs:
        wanted = args.configs.split(",")
        configs = [c for c in CONFIGS if c["name"] in wanted]
        missing = set(wanted) - {c["name"] for c in configs}
        if missing:
            sys.exit(f"unknown configs {sorted(missing)}; known: {[c['name'] for c in CONFIGS]}")
    flush = None if args.no_flush else torch.empty(256 * 2 ** 20 // 4, dtype=torch.int32, device=dev)
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}, "
          f"L2 flush {'off' if flush is None else 'on'}, median of {args.iters}")

    fields = ["H", "F", "T", "variant", "ms", "tflops", "speedup_vs_unfused_torch", "speedup_vs_unfused_triton",
              "max_abs_diff", "frac_gt_1ulp", "frac_differ", "error"]
    rows = []
    torch.manual_seed(args.seed)
    for H, Fdim in parse_shapes(args.shapes):
        w = (torch.randn(2 * Fdim, H, device=dev) / H ** 0.5).to(torch.bfloat16)
        for T in [int(t) for t in args.tokens.split(",") if t]:
            x = torch.randn(T, H, device=dev).to(torch.bfloat16)
            flops = 2.0 * T * H * 2 * Fdim
            ref = gateup_silu_reference(x, w)
            base = {}

            def emit(variant, ms, out=None, error=""):
                row = dict(H=H, F=Fdim, T=T, variant=variant, error=error)
                if ms is not None:
                    row.update(ms=f"{ms:.4f}", tflops=f"{flops / ms / 1e9:.1f}",
                               speedup_vs_unfused_torch=f"{base['unfused_torch'] / ms:.3f}",
                               speedup_vs_unfused_triton=f"{base['unfused_triton'] / ms:.3f}")
                msg = ""
                if out is not None:
                    mx, gt1, ne = compare(out, ref)
                    row.update(max_abs_diff=f"{mx:.3g}", frac_gt_1ulp=f"{gt1:.2e}", frac_differ=f"{ne:.2e}")
                    msg = f"  maxdiff {mx:.3g}  >1ulp {gt1:.2e}  differ {ne:.2e}"
                rows.append(row)
                if error:
                    print(f"H={H:5d} F={Fdim:6d} T={T:6d} {variant:30s} ERROR {error}")
                else:
                    print(f"H={H:5d} F={Fdim:6d} T={T:6d} {variant:30s} {ms:8.4f} ms {flops / ms / 1e9:7.1f} TFLOP/s"
                          f"  unfused/this {base['unfused_torch'] / ms:5.3f}{msg}", flush=True)

            base["unfused_torch"] = time_ms(lambda: unfused_torch(x, w), args.iters, args.warmup, flush)
            base["unfused_triton"] = time_ms(lambda: unfused_triton(x, w), args.iters, args.warmup, flush)
            emit("unfused_torch", base["unfused_torch"])
            emit("unfused_triton", base["unfused_triton"], unfused_triton(x, w))
            emit("gemm_only", time_ms(lambda: F.linear(x, w), args.iters, args.warmup, flush))
            for cfg in configs:
                name = "fused:" + cfg["name"]
                try:
                    out = gateup_silu_triton(x, w, cfg)
                    ms = time_ms(lambda: gateup_silu_triton(x, w, cfg), args.iters, args.warmup, flush)
                    emit(name, ms, out)
                except Exception as exc:  # compile failure, out of resources: record and go on
                    emit(name, None, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                finally:
                    out = None
            del x, ref
            torch.cuda.empty_cache()
        del w

    with open(args.out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print(f"# wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
