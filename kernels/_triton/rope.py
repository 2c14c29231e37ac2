"""Triton RoPE: one program per (block of tokens, head)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import emulate_rne, half_pad, load_halves_rotated, unit_last_stride


@triton.jit
def _rope_kernel(X, COS, SIN, OUT, T, s_xt, s_xh, s_ct, s_st, s_ot, s_oh,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                 EMULATE_RNE: tl.constexpr):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = offs_t < T
    y1, y2 = load_halves_rotated(X + h * s_xh, offs_t, offs_t, t_ok, s_xt, COS, SIN, s_ct, s_st,
                                 HALF, HALF_PAD, True, EMULATE_RNE)
    offs_h = tl.arange(0, HALF_PAD)
    mask = t_ok[:, None] & (offs_h < HALF)[None, :]
    ptr = OUT + h * s_oh + offs_t[:, None] * s_ot + offs_h[None, :]
    tl.store(ptr, y1, mask=mask)
    tl.store(ptr + HALF, y2, mask=mask)


def launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x, cos, sin = (unit_last_stride(t) for t in (x, cos, sin))
    t, h, d = x.shape
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t == 0 or h == 0:
        return out
    hp = half_pad(d)
    block_t = max(1, min(64, 4096 // hp, triton.next_power_of_2(t)))
    grid = (triton.cdiv(t, block_t), h)
    _rope_kernel[grid](x, cos, sin, out, t, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                       out.stride(0), out.stride(1), HALF=d // 2, HALF_PAD=hp, BLOCK_T=block_t,
                       EMULATE_RNE=emulate_rne())
    return out
