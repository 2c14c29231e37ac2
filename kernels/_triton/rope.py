"""Triton RoPE: one program per (block of tokens, head). The same kernel gathers and rotates key rows for the
attention kernels (`gather_rotated`): row i of the output is row ``rows[i]`` of x rotated at ``pos[i]``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import emulate_rne, half_pad, load_halves_rotated, tile_mask, unit_last_stride


@triton.jit
def _rope_kernel(X, ROWS, POS, COS, SIN, OUT, T, s_xt, s_xh, s_ct, s_st, s_ot, s_oh,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_T: tl.constexpr, GATHER: tl.constexpr,
                 EMULATE_RNE: tl.constexpr):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = offs_t < T
    if GATHER:
        rows = tl.load(ROWS + offs_t, mask=t_ok, other=0)
        pos = tl.load(POS + offs_t, mask=t_ok, other=0)
    else:
        rows = offs_t
        pos = offs_t
    y1, y2 = load_halves_rotated(X + h * s_xh, rows, pos, t_ok, s_xt, COS, SIN, s_ct, s_st,
                                 HALF, HALF_PAD, True, EMULATE_RNE)
    offs_h = tl.arange(0, HALF_PAD)
    mask = tile_mask(t_ok, offs_h, HALF, HALF_PAD)
    ptr = OUT + h * s_oh + offs_t[:, None] * s_ot + offs_h[None, :]
    tl.store(ptr, y1, mask=mask)
    tl.store(ptr + HALF, y2, mask=mask)


def _run(x, rows, pos, cos, sin, out, t):
    h, d = x.shape[1], x.shape[2]
    if t == 0 or h == 0:
        return out
    hp = half_pad(d)
    block_t = max(1, min(64, 4096 // hp, triton.next_power_of_2(t)))
    grid = (triton.cdiv(t, block_t), h)
    gather = rows is not None
    _rope_kernel[grid](x, rows if gather else x, pos if gather else x, cos, sin, out, t,
                       x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), out.stride(-2), out.stride(-3),
                       HALF=d // 2, HALF_PAD=hp, BLOCK_T=block_t, GATHER=gather, EMULATE_RNE=emulate_rne())
    return out


def launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[T, H, D] x rotated by the per-token tables cos/sin [T, D]."""
    x, cos, sin = (unit_last_stride(t) for t in (x, cos, sin))
    t, h, d = x.shape
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    _run(x, None, None, cos, sin, out.transpose(0, 1), t)       # the kernel takes [heads, tokens, D] strides
    return out


def gather_rotated(k: torch.Tensor, kv_rows: torch.Tensor | None, kv_pos: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """Head-major rotated keys [Hkv, N, D] (contiguous): ``k[kv_rows[i]]`` rotated at ``kv_pos[i]``, rounded
    exactly like the rotate-on-load of the attention kernels (and HF), so either path gives identical bits."""
    k, cos, sin = (unit_last_stride(t) for t in (k, cos, sin))
    n = kv_pos.numel()
    rows = kv_rows if kv_rows is not None else torch.arange(n, device=k.device)
    out = torch.empty((k.shape[1], n, k.shape[2]), dtype=k.dtype, device=k.device)
    return _run(k, rows.contiguous(), kv_pos.contiguous(), cos, sin, out, n)
