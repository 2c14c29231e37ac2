"""Triton row scatter: one program per source row, copying its [H, D] tile (any strides)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scatter_kernel(DST, ROWS, SRC, H, D, s_dr, s_dh, s_dd, s_sr, s_sh, s_sd,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(ROWS + i)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + offs_h
        mask = (hh < H)[:, None] & (offs_d < D)[None, :]
        x = tl.load(SRC + i.to(tl.int64) * s_sr + hh[:, None] * s_sh + offs_d[None, :] * s_sd, mask=mask)
        tl.store(DST + row * s_dr + hh[:, None] * s_dh + offs_d[None, :] * s_dd, x, mask=mask)


def launch(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    m, h, d = src.shape
    if m == 0 or h == 0 or d == 0:
        return
    rows = rows.contiguous()
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(h), 8192 // block_d))
    _scatter_kernel[(m,)](dst, rows, src, h, d, *dst.stride(), *src.stride(), BLOCK_H=block_h, BLOCK_D=block_d,
                          num_warps=4)
