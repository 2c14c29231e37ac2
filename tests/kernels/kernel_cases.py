"""Helpers for the kernel tests: float64 math references, the tolerance rule, test cases."""
from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")

# Absolute error floors for the tolerance rule, per dtype of the op's inputs.
ERROR_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float64: 1e-12}


def rope_tables(positions: int, head_dim: int, base: float = 10000.0, dtype=torch.float32):
    """HF-layout cos/sin tables [positions, head_dim] (the two halves duplicated)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def max_err(x: torch.Tensor, truth: torch.Tensor) -> float:
    return (x.detach().cpu().double() - truth.detach().cpu().double()).abs().max().item() if x.numel() else 0.0


def assert_rule(out: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype, what: str = "",
                floor: float | None = None):
    """The tolerance rule: the kernel's error against a float64 (or fp32) truth is at most twice that of the
    same-dtype torch reference, plus a small absolute floor."""
    err_out, err_ref = max_err(out, truth), max_err(ref, truth)
    bound = 2 * err_ref + (ERROR_FLOOR[dtype] if floor is None else floor)
    assert err_out <= bound, f"{what}: kernel error {err_out:.3g} > 2 x reference error {err_ref:.3g} + floor"




def rotate_half64(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotated_keys64(k, kv_rows, kv_pos, cos, sin):
    """[N, Hkv, D] float64 keys of the attended rows, rotated exactly (cos/sin first cast to k's dtype, as HF)."""
    rows = torch.arange(kv_pos.numel()) if kv_rows is None else kv_rows.cpu()
    keys = k.cpu()[rows].double()
    if cos is None:
        return keys
    c = cos.cpu()[kv_pos.cpu()].to(k.dtype).double()[:, None, :]
    s = sin.cpu()[kv_pos.cpu()].to(k.dtype).double()[:, None, :]
    return keys * c + rotate_half64(keys) * s


def probs64(q, q_pos, k, kv_rows, kv_pos, cos, sin, scale):
    """[Hq, M, N] float64 attention probabilities by absolute position (rows that see nothing are 0)."""
    keys = rotated_keys64(k, kv_rows, kv_pos, cos, sin)
    group = q.shape[1] // k.shape[1]
    keys = keys.repeat_interleave(group, dim=1)                           # [N, Hq, D]
    scores = torch.einsum("mhd,nhd->hmn", q.cpu().double(), keys) * scale
    visible = kv_pos.cpu()[None, :] <= q_pos.cpu()[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)


def attention64(q, q_pos, k, v, kv_rows, kv_pos, cos, sin, scale):
    """[M, Hq, D] float64 attention: the truth for the tolerance rule."""
    p = probs64(q, q_pos, k, kv_rows, kv_pos, cos, sin, scale)
    rows = torch.arange(kv_pos.numel()) if kv_rows is None else kv_rows.cpu()
    values = v.cpu()[rows].double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.einsum("hmn,nhd->mhd", p, values)


def make_case(m, n, hq, hkv, d, dtype, *, pool_extra=9, seed=0, sorted_pos=True, questions=3):
    """A fused-prompt-like case on CPU: a larger pool, N scattered unsorted rows, key positions with holes,
    queries = some of the keys (selected for recompute) plus question tokens after the last key."""
    g = torch.Generator().manual_seed(seed)
    r = n + pool_extra
    q = torch.randn(m, hq, d, generator=g).to(dtype)
    k = torch.randn(r, hkv, d, generator=g).to(dtype)
    v = torch.randn(r, hkv, d, generator=g).to(dtype)
    kv_rows = torch.randperm(r, generator=g)[:n]
    kv_pos = torch.sort(torch.randperm(2 * n, generator=g)[:n]).values          # holes between documents
    if not sorted_pos:
        kv_pos = kv_pos[torch.randperm(n, generator=g)]
    last = int(kv_pos.max())
    picked = kv_pos[torch.randperm(n, generator=g)[: m - questions]]
    q_pos = torch.cat([picked, last + 1 + torch.arange(questions)])
    cos, sin = rope_tables(last + 1 + questions, d)
    return dict(q=q, q_pos=q_pos, k=k, v=v, kv_rows=kv_rows, kv_pos=kv_pos, cos=cos, sin=sin, scale=d ** -0.5)



def to_device(case: dict, device) -> dict:
    return {key: (val.to(device) if isinstance(val, torch.Tensor) else val) for key, val in case.items()}



def real_case(m: int, n: int, device, seed: int = 0) -> dict:
    """Llama-3.1-8B attention shapes (Hq 32, Hkv 8, D 128, bf16): N keys scattered in a pool, M queries at
    positions taken among the keys."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = 32, 8, 128
    r = n + 512
    k = torch.randn(r, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(r, hkv, d, generator=g).to(torch.bfloat16)
    kv_rows = torch.randperm(r, generator=g)[:n]
    kv_pos = torch.arange(n) + 32
    q_pos = torch.sort(kv_pos[torch.randperm(n, generator=g)[:m]]).values
    q = torch.randn(m, hq, d, generator=g).to(torch.bfloat16)
    cos, sin = rope_tables(n + 64, d, base=500000.0)
    c = dict(q=q, q_pos=q_pos, k=k, v=v, kv_rows=kv_rows, kv_pos=kv_pos, cos=cos, sin=sin, scale=d ** -0.5)
    return to_device(c, device)


def rotated_keys_fp32(k, kv_rows, kv_pos, cos, sin):
    """[N, Hkv, D] fp32 keys rotated as HF does in k's dtype (for truths at real shapes, on the GPU)."""
    keys = k[kv_rows]
    c = cos[kv_pos].to(k.dtype)[:, None]
    s = sin[kv_pos].to(k.dtype)[:, None]
    half = k.shape[-1] // 2
    return (keys * c + torch.cat([-keys[..., half:], keys[..., :half]], -1) * s).float()


def can_compile_for_nvidia() -> bool:
    """True when triton and its NVIDIA backend import (kernels can be compiled for sm_90 without a GPU)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False
    try:
        from triton.backends import backends
    except Exception:
        return False
    return "nvidia" in backends


def run_compile_script(script: str) -> None:
    """Runs a kernel-compiling script in a fresh interpreter; it must print "ok" (skips when ptxas is missing)."""
    import subprocess
    import sys

    import pytest

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "ptxas" in done.stderr and "not found" in done.stderr.lower():
        pytest.skip("ptxas unavailable")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]
