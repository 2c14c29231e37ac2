"""Checks every Triton kernel of kvfuse.kernels against its torch reference at real shapes, then times them.

Shapes: Llama-3.1-8B attention (Hq 32, Hkv 8, head_dim 128, bf16); N keys in {2k, 8k, 32k} gathered from a pool in
512-token documents placed in shuffled order (as fused cached documents are); M = 64 question rows (the last 64
positions) and M = 15% of N recomputed rows (sorted, the 64 question rows included). Timings are medians of
``triton.testing.do_bench`` (the triton rows also by CUDA-graph replay: GPU time without launch overhead, the
``graph_ms`` column); the attention is also compared with SDPA over keys rotated and gathered beforehand
(contiguous), the ideal the deferred-RoPE kernel competes with, and with rotate-then-SDPA (what an engine without
deferred RoPE does per call).

Usage:
    python benchmarks/kernels_gpu.py --out kernels_gpu.csv [--n 2048 8192 32768] [--m question recompute]
        [--ops attention scores elementwise] [--sweep]

`--sweep` also times a grid of block sizes / warps / stages / key splits / up-front RoPE for the attention and
scores kernels and reports the best one per shape. The run ends with a compact summary table (one line per op
and shape). Exits with status 1 if any correctness check fails.
"""
from __future__ import annotations

import argparse
import csv
import math
import platform
import sys

import torch
import torch.nn.functional as F

HQ, HKV, HEAD_DIM = 32, 8, 128
DOC_TOKENS = 512
QUESTION_ROWS = 64
ROPE_BASE = 500000.0
DTYPE = torch.bfloat16


# ----------------------------------------------------------------------------------------------- cases

def rope_tables(positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-layout tables in the model dtype (HF's rotary embedding returns them in x's dtype)."""
    inv_freq = ROPE_BASE ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float32, device=device) / HEAD_DIM)
    angles = torch.arange(positions, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(DTYPE), emb.sin().to(DTYPE)


def make_case(n: int, m: int, device, seed: int = 0) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    docs = math.ceil(n / DOC_TOKENS)
    pool_rows = docs * DOC_TOKENS + 1024
    k = torch.randn(pool_rows, HKV, HEAD_DIM, generator=g).to(DTYPE)
    v = torch.randn(pool_rows, HKV, HEAD_DIM, generator=g).to(DTYPE)
    # each document is a contiguous run of pool rows; the runs are used in shuffled order
    order = torch.randperm(docs, generator=g)
    kv_rows = (order[:, None] * DOC_TOKENS + torch.arange(DOC_TOKENS)[None, :]).reshape(-1)[:n]
    prefix = 32
    kv_pos = torch.arange(n) + prefix
    question = kv_pos[-QUESTION_ROWS:]
    if m <= QUESTION_ROWS:
        q_pos = question[-m:]
    else:
        picked = kv_pos[:-QUESTION_ROWS][torch.randperm(n - QUESTION_ROWS, generator=g)[: m - QUESTION_ROWS]]
        q_pos = torch.sort(torch.cat([picked, question])).values
    q = torch.randn(m, HQ, HEAD_DIM, generator=g).to(DTYPE)
    cos, sin = rope_tables(n + prefix + 8, "cpu")
    case = dict(q=q, q_pos=q_pos, k=k, v=v, kv_rows=kv_rows, kv_pos=kv_pos, cos=cos, sin=sin,
                scale=HEAD_DIM ** -0.5)
    return {key: (val.to(device) if isinstance(val, torch.Tensor) else val) for key, val in case.items()}


def attn_args(c):
    return (c["q"], c["q_pos"], c["k"], c["v"], c["kv_rows"], c["kv_pos"], c["cos"], c["sin"], c["scale"])


def score_args(c):
    return (c["q"], c["q_pos"], c["k"], c["kv_rows"], c["kv_pos"], c["cos"], c["sin"], c["scale"])


# ----------------------------------------------------------------------------------------------- truths

def rotated_keys(c) -> torch.Tensor:
    """[N, Hkv, D] keys rotated as HF does in bf16."""
    keys = c["k"][c["kv_rows"]]
    cos = c["cos"][c["kv_pos"]].to(DTYPE)[:, None]
    sin = c["sin"][c["kv_pos"]].to(DTYPE)[:, None]
    half = HEAD_DIM // 2
    return keys * cos + torch.cat([-keys[..., half:], keys[..., :half]], dim=-1) * sin


def attention_truth(c) -> torch.Tensor:
    """fp32 attention, one q head at a time."""
    keys, values = rotated_keys(c).float(), c["v"][c["kv_rows"]].float()
    visible = c["kv_pos"][None, :] <= c["q_pos"][:, None]
    out = torch.empty(c["q"].shape, dtype=torch.float32, device=c["q"].device)
    group = HQ // HKV
    for h in range(HQ):
        s = (c["q"][:, h].float() @ keys[:, h // group].T) * c["scale"]
        out[:, h] = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ values[:, h // group]
    return out


def scores_truth(c) -> torch.Tensor:
    keys = rotated_keys(c).float()
    visible = c["kv_pos"][None, :] <= c["q_pos"][:, None]
    out = torch.zeros(c["q"].shape[0], keys.shape[0], dtype=torch.float32, device=keys.device)
    group = HQ // HKV
    for h in range(HQ):
        s = (c["q"][:, h].float() @ keys[:, h // group].T) * c["scale"]
        out += torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return out / HQ


def max_err(x, truth) -> float:
    return (x.float() - truth.float()).abs().max().item()


# ----------------------------------------------------------------------------------------------- timing

def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph(fn) -> float | None:
    """Median ms of `fn` replayed as a CUDA graph: GPU time without the Python / launch overhead that `bench`
    includes (at small shapes the two differ by the launch cost). None if `fn` cannot be captured."""
    import triton.testing

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
    except Exception as exc:  # capture is best effort: report and go on
        print(f"  graph capture failed: {type(exc).__name__}: {exc}", flush=True)
        return None


class Results:
    def __init__(self, device_name: str):
        self.rows: list[dict] = []
        self.failures: list[str] = []
        self.device_name = device_name

    def add(self, op, n, m, impl, ms, torch_ms=None, err=None, ref_err=None, ok=None, config="", graph_ms=None):
        self.rows.append(dict(
            op=op, n=n, m=m, impl=impl, config=config, median_ms=round(ms, 4) if ms is not None else "",
            graph_ms=round(graph_ms, 4) if graph_ms is not None else "",
            speedup_vs_torch=round(torch_ms / ms, 2) if ms and torch_ms else "",
            max_abs_err="" if err is None else f"{err:.3g}",
            ref_max_abs_err="" if ref_err is None else f"{ref_err:.3g}",
            check="" if ok is None else ("pass" if ok else "FAIL"), device=self.device_name))
        if ok is False and err is not None:
            self.failures.append(f"{op} n={n} m={m} {impl}: err {err:.3g} vs reference {ref_err:.3g}")
        row = self.rows[-1]
        print(f"{op:<17} {n:>6} {m:>5}  {impl:<22} {row['median_ms']!s:>9} ms  x{row['speedup_vs_torch']!s:<6} "
              f"err {row['max_abs_err']:<9} ref {row['ref_max_abs_err']:<9} {row['check']:<5} {config}", flush=True)

    def summary(self) -> str:
        """One line per (op, N, M): the times side by side, the triton error against the reference's, the check."""
        groups: dict[tuple, dict] = {}
        for row in self.rows:
            groups.setdefault((row["op"], row["n"], row["m"]), {})[row["impl"]] = row
        cols = [("torch_reference", "torch"), ("triton", "triton"), ("triton@graph", "tri-graph"),
                ("triton_best_of_sweep", "best"),
                ("sdpa_mask_prerotated", "sdpa+mask"), ("sdpa_flash_nomask_floor", "flash-floor"),
                ("rotate_then_sdpa", "rot+sdpa")]
        head = f"{'op':<17} {'N':>6} {'M':>5} " + " ".join(f"{label:>11}" for _, label in cols)
        lines = [head + f"  {'x torch':>7}  {'err':>9} {'ref err':>9}  check  config"]
        for (op, n, m), impls in groups.items():
            tri = impls.get("triton", {})
            if tri.get("graph_ms", "") != "":
                impls = dict(impls, **{"triton@graph": dict(median_ms=tri["graph_ms"])})
            times = " ".join(f"{impls[key]['median_ms'] if key in impls else '-':>11}" for key, _ in cols)
            lines.append(f"{op:<17} {n:>6} {m:>5} {times}  {tri.get('speedup_vs_torch', ''):>7}  "
                         f"{tri.get('max_abs_err', '') or '-':>9} {tri.get('ref_max_abs_err', '') or '-':>9}  "
                         f"{tri.get('check', '') or '-':<5}  {tri.get('config', '')}")
        best = [f"{op} n={n} m={m}: {impls['triton_best_of_sweep']['config']}"
                for (op, n, m), impls in groups.items() if "triton_best_of_sweep" in impls]
        if best:
            lines.append("# best sweep configs: " + "; ".join(best))
        return "\n".join(lines)

    def write(self, path: str):
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(self.rows[0].keys()))
            writer.writeheader()
            writer.writerows(self.rows)


def rule(err: float, ref_err: float, floor: float) -> bool:
    """Kernel error vs the truth at most twice the torch reference's, plus a floor."""
    return err <= 2 * ref_err + floor


# ----------------------------------------------------------------------------------------------- ops

def _config_name(cfg: dict) -> str:
    return (f"bm{cfg['block_m']} bn{cfg['block_n']} w{cfg['num_warps']} s{cfg['num_stages']} "
            f"splits{cfg['splits']}" + (" prerot" if cfg.get("prerotate") else "")
            + (" vgather" if cfg.get("gather_values") else ""))


def _sweep(res: Results, op: str, n: int, m: int, t_ref: float, ref_err: float, floor: float, truth, launch, plan,
           grid):
    """Times every override set of `grid` (dicts of launch overrides); reports the best one."""
    best = None
    for overrides in grid:
        cfg = plan(**overrides)
        name = _config_name(cfg)
        fn = lambda: launch(**overrides)
        try:
            e = max_err(fn(), truth)
            t = bench(fn)
        except Exception as exc:  # out of shared memory / registers for this config
            print(f"  sweep {name}: {type(exc).__name__}", flush=True)
            continue
        ok = rule(e, ref_err, floor)
        print(f"  sweep {op} n={n} m={m} {name:<44} {t:8.4f} ms  err {e:.3g} {'pass' if ok else 'FAIL'}",
              flush=True)
        if not ok:
            res.failures.append(f"sweep {op} {name} n={n} m={m}: err {e:.3g}")
        if ok and (best is None or t < best[0]):
            best = (t, name, e)
    if best:
        res.add(op, n, m, "triton_best_of_sweep", best[0], t_ref, best[2], ref_err, True, best[1])


def run_attention(c, n, m, res: Results, sweep: bool):
    from kvfuse.kernels import fused_attention_reference, fused_attention_triton
    from kvfuse.kernels._triton import attention as tri_attn

    args = attn_args(c)
    truth = attention_truth(c)
    ref = fused_attention_reference(*args)
    out = fused_attention_triton(*args)
    ref_err, err = max_err(ref, truth), max_err(out, truth)
    t_ref = bench(lambda: fused_attention_reference(*args))
    res.add("fused_attention", n, m, "torch_reference", t_ref, t_ref, ref_err, ref_err)
    plan = lambda **o: tri_attn.plan(m, HQ, HKV, n, HEAD_DIM, DTYPE, c["q"].device, **o)
    t_tri = bench(lambda: fused_attention_triton(*args))
    res.add("fused_attention", n, m, "triton", t_tri, t_ref, err, ref_err, rule(err, ref_err, 1e-3),
            _config_name(plan()), graph_ms=bench_graph(lambda: fused_attention_triton(*args)))

    # SDPA over keys rotated and gathered beforehand (not timed): the zero-overhead ideal
    keys = rotated_keys(c).transpose(0, 1)[None].contiguous()                   # [1, Hkv, N, D]
    values = c["v"][c["kv_rows"]].transpose(0, 1)[None].contiguous()
    q4 = c["q"].transpose(0, 1)[None].contiguous()                             # [1, Hq, M, D]
    mask = c["kv_pos"][None, :] <= c["q_pos"][:, None]
    keys_rep = keys.repeat_interleave(HQ // HKV, dim=1)
    values_rep = values.repeat_interleave(HQ // HKV, dim=1)
    sdpa = lambda: F.scaled_dot_product_attention(q4, keys_rep, values_rep, attn_mask=mask, scale=c["scale"])
    sdpa_out = sdpa()[0].transpose(0, 1)
    t_sdpa = bench(sdpa)
    res.add("fused_attention", n, m, "sdpa_mask_prerotated", t_sdpa, t_ref, max_err(sdpa_out, truth), ref_err)
    del keys_rep, values_rep
    flash = lambda: F.scaled_dot_product_attention(q4, keys, values, scale=c["scale"], enable_gqa=True)
    res.add("fused_attention", n, m, "sdpa_flash_nomask_floor", bench(flash), t_ref,
            config="no mask: wrong semantics, speed floor only")

    from kvfuse.kernels import apply_rope_triton

    def rope_then_sdpa():
        rot = apply_rope_triton(c["k"][c["kv_rows"]], c["cos"][c["kv_pos"]], c["sin"][c["kv_pos"]])
        kk = rot.transpose(0, 1)[None].repeat_interleave(HQ // HKV, dim=1)
        vv = c["v"][c["kv_rows"]].transpose(0, 1)[None].repeat_interleave(HQ // HKV, dim=1)
        return F.scaled_dot_product_attention(q4, kk, vv, attn_mask=mask, scale=c["scale"])
    res.add("fused_attention", n, m, "rotate_then_sdpa", bench(rope_then_sdpa), t_ref)

    if sweep:
        if m <= QUESTION_ROWS:
            grid = [dict(block_m=64, block_n=64, num_warps=4, num_stages=3, num_splits=sp_, prerotate=pr_,
                         gather_values=gv_)
                    for sp_ in (4, 8, 16) for pr_, gv_ in ((False, False), (True, False), (True, True))]
        else:
            grid = [dict(block_m=bm_, block_n=bn_, num_warps=8 if bm_ == 128 else 4, num_stages=3, prerotate=pr_,
                         gather_values=pr_)
                    for bm_ in (64, 128) for bn_ in (64, 128) for pr_ in (False, True)]
            # the launch shapes that won the block-sparse kernel's sweep (benchmarks/sift_kernel.py --sweep: 256
            # packed rows per program, or 128 rows with 4 warps and 2 stages), untried here until now
            grid += [dict(block_m=bm_, block_n=64, num_warps=w_, num_stages=st_, prerotate=True, gather_values=True)
                     for bm_, w_, st_ in ((256, 8, 3), (256, 8, 4), (128, 4, 2))]
        _sweep(res, "fused_attention", n, m, t_ref, ref_err, 1e-3, truth,
               lambda **o: tri_attn.launch(*args, **o), plan, grid)


def run_scores(c, n, m, res: Results, sweep: bool):
    from kvfuse.kernels import attention_scores_reference, attention_scores_triton
    from kvfuse.kernels._triton import attn_scores as tri_scores

    args = score_args(c)
    truth = scores_truth(c)
    ref = attention_scores_reference(*args)
    out = attention_scores_triton(*args)
    ref_err, err = max_err(ref, truth), max_err(out, truth)
    t_ref = bench(lambda: attention_scores_reference(*args))
    res.add("attention_scores", n, m, "torch_reference", t_ref, t_ref, ref_err, ref_err)
    bm, bn, warps, stages = tri_scores.pick_blocks(m, HEAD_DIM, DTYPE, False)
    splits = tri_scores.pick_splits(math.ceil(m / bm) * HQ, n, bn, c["q"].device)
    prerot = tri_scores.prerotate_by_default(m, bm, HQ // HKV, n)
    res.add("attention_scores", n, m, "triton", bench(lambda: attention_scores_triton(*args)), t_ref, err, ref_err,
            rule(err, ref_err, 1e-6),
            f"bm{bm} bn{bn} w{warps} s{stages} splits{splits}" + (" prerot" if prerot else ""),
            graph_ms=bench_graph(lambda: attention_scores_triton(*args)))
    if sweep:
        small = m <= QUESTION_ROWS

        def plan(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, num_splits=None, prerotate=None):
            sp = num_splits or tri_scores.pick_splits(math.ceil(m / block_m) * HQ, n, block_n, c["q"].device)
            pr = prerotate if prerotate is not None else prerot
            return dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages, splits=sp,
                        prerotate=pr)
        grid = [dict(block_m=64, block_n=bn_, num_warps=4, num_splits=sp_, prerotate=pr_)
                for bn_ in (64, 128) for sp_ in ((8,) if small else (None,)) for pr_ in (False, True)]
        _sweep(res, "attention_scores", n, m, t_ref, ref_err, 1e-6, truth,
               lambda **o: tri_scores.launch(*args, **o), plan, grid)


def run_elementwise(c, n, res: Results):
    from kvfuse.kernels import (apply_rope_reference, apply_rope_triton, kv_deviation_reference, kv_deviation_triton,
                                scatter_rows_reference, scatter_rows_triton)

    # rope over N gathered key rows
    x = c["k"][c["kv_rows"]]
    cos, sin = c["cos"][c["kv_pos"]], c["sin"][c["kv_pos"]]
    same = torch.equal(apply_rope_triton(x, cos, sin), apply_rope_reference(x, cos, sin))
    t_ref = bench(lambda: apply_rope_reference(x, cos, sin))
    res.add("apply_rope", n, n, "torch_reference", t_ref, t_ref)
    res.add("apply_rope", n, n, "triton", bench(lambda: apply_rope_triton(x, cos, sin)), t_ref, ok=same,
            config="bit-identical" if same else "differs from reference")
    if not same:
        res.failures.append(f"apply_rope n={n}: triton differs from the reference")

    # scatter 15% of the rows into the pool
    g = torch.Generator(device="cpu").manual_seed(1)
    m = max(1, int(0.15 * n))
    rows = torch.randperm(c["k"].shape[0], generator=g)[:m].to(x.device)
    src = torch.randn(m, HKV, HEAD_DIM, generator=g).to(DTYPE).to(x.device)
    a, b = c["k"].clone(), c["k"].clone()
    scatter_rows_reference(a, rows, src)
    scatter_rows_triton(b, rows, src)
    same = torch.equal(a, b)
    t_ref = bench(lambda: scatter_rows_reference(a, rows, src))
    res.add("scatter_rows", n, m, "torch_reference", t_ref, t_ref)
    res.add("scatter_rows", n, m, "triton", bench(lambda: scatter_rows_triton(b, rows, src)), t_ref, ok=same)
    if not same:
        res.failures.append(f"scatter_rows n={n}: triton differs from the reference")

    # deviation of N fresh vs cached rows
    fresh = (x.float() + 0.05 * torch.randn(x.shape, generator=g).to(x.device)).to(DTYPE)
    truth = (fresh.double() - x.double()).flatten(1).norm(dim=1)
    ref = kv_deviation_reference(fresh, x)
    out = kv_deviation_triton(fresh, x)
    ref_err, err = max_err(ref, truth), max_err(out, truth)
    t_ref = bench(lambda: kv_deviation_reference(fresh, x))
    res.add("kv_deviation", n, n, "torch_reference", t_ref, t_ref, ref_err, ref_err)
    res.add("kv_deviation", n, n, "triton", bench(lambda: kv_deviation_triton(fresh, x)), t_ref, err, ref_err,
            rule(err, ref_err, 1e-4))


# ----------------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="CSV file to write")
    parser.add_argument("--n", type=int, nargs="+", default=[2048, 8192, 32768], help="numbers of keys")
    parser.add_argument("--sweep", action="store_true", help="also sweep attention launch configurations")
    parser.add_argument("--ops", nargs="+", default=["attention", "scores", "elementwise"],
                        choices=["attention", "scores", "elementwise"])
    parser.add_argument("--m", nargs="+", default=["question", "recompute"], choices=["question", "recompute"],
                        help="query sets: the 64 question rows, and/or 15%% of N recomputed rows")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    import triton

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    name = f"{props.name} ({props.multi_processor_count} SMs)"
    print(f"# device: {name}; torch {torch.__version__}; triton {triton.__version__}; CUDA {torch.version.cuda}; "
          f"python {platform.python_version()}")
    print(f"# shapes: Hq {HQ}, Hkv {HKV}, head_dim {HEAD_DIM}, {DTYPE}; do_bench medians in ms")
    print(f"{'op':<17} {'N':>6} {'M':>5}  {'impl':<22} {'median':>9}     {'speedup':<7} {'max err':<13} "
          f"{'ref err':<13} check config")
    res = Results(name)
    for n in args.n:
        sizes = {"question": QUESTION_ROWS, "recompute": int(round(0.15 * n))}
        for m in (sizes[key] for key in args.m):
            c = make_case(n, m, device, seed=n + m)
            if "attention" in args.ops:
                run_attention(c, n, m, res, args.sweep)
            if "scores" in args.ops:
                run_scores(c, n, m, res, args.sweep)
            del c
            torch.cuda.empty_cache()
        if "elementwise" in args.ops:
            run_elementwise(make_case(n, 1, device, seed=n), n, res)
    res.write(args.out)
    print(f"# wrote {args.out}")
    print("# summary (median ms)")
    print(res.summary())
    if res.failures:
        print("# FAILED checks:\n#   " + "\n#   ".join(res.failures))
        return 1
    print("# all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
