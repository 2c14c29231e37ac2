"""Triton SiLU-and-multiply over a packed gate|up row: one program per (row, block of features)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import emulate_rne, round_to


@triton.jit
def _silu_mul_kernel(GU, OUT, F, s_g, s_o, BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F
    g = tl.load(GU + row * s_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * s_g + F + offs, mask=mask, other=0.0).to(tl.float32)
    a = round_to(g / (1.0 + tl.exp(-g)), OUT.dtype.element_ty, EMULATE_RNE).to(tl.float32)  # rounded like torch's
    tl.store(OUT + row * s_o + offs, round_to(a * u, OUT.dtype.element_ty, EMULATE_RNE), mask=mask)


def launch(gu: torch.Tensor) -> torch.Tensor:
    if gu.stride(1) != 1:
        gu = gu.contiguous()
    t, f = gu.shape[0], gu.shape[1] // 2
    out = torch.empty((t, f), dtype=gu.dtype, device=gu.device)
    if t and f:
        block = min(1024, triton.next_power_of_2(f))
        _silu_mul_kernel[(t, triton.cdiv(f, block))](gu, out, f, gu.stride(0), out.stride(0), BLOCK=block,
                                                     EMULATE_RNE=emulate_rne(), num_warps=4)
    return out
