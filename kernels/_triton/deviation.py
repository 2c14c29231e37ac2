"""Triton per-token L2 deviation: one program per block of tokens, fp32 sum of squares over H*D."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _deviation_kernel(A, B, OUT, M, F, s_am, s_bm, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_f = tl.arange(0, BLOCK_F)
    m_ok = offs_m < M
    rows_a = A + offs_m[:, None].to(tl.int64) * s_am
    rows_b = B + offs_m[:, None].to(tl.int64) * s_bm
    acc = tl.zeros([BLOCK_M, BLOCK_F], tl.float32)
    for f0 in range(0, F, BLOCK_F):
        ff = f0 + offs_f
        mask = m_ok[:, None] & (ff < F)[None, :]
        a = tl.load(rows_a + ff[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(rows_b + ff[None, :], mask=mask, other=0.0).to(tl.float32)
        diff = a - b
        acc += diff * diff
    tl.store(OUT + offs_m, tl.sqrt_rn(tl.sum(acc, 1)), mask=m_ok)


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """[M, H*D] view with unit stride inside a token (copies only when the layout needs it)."""
    flat = x.reshape(x.shape[0], -1)
    return flat if flat.shape[1] <= 1 or flat.stride(1) == 1 else flat.contiguous()


def launch(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    m = fresh.shape[0]
    out = torch.zeros(m, dtype=torch.float32, device=fresh.device)
    a, b = _token_major(fresh), _token_major(cached)
    f = a.shape[1]
    if m == 0 or f == 0:
        return out
    block_f = min(1024, triton.next_power_of_2(f))
    block_m = max(1, min(16, 4096 // block_f))
    _deviation_kernel[(triton.cdiv(m, block_m),)](a, b, out, m, f, a.stride(0), b.stride(0),
                                                  BLOCK_M=block_m, BLOCK_F=block_f, num_warps=4)
    return out
