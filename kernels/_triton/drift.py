"""Triton drift correction (kernels/drift.py): a per-document drift table by atomics, then one corrected row per slot.

`_accumulate`: one program per computed row of a candidate document adds fresh - cached (float32) of K and V into its
document's rows of the table and 1 to its count. `_write`: one program per slot of a document reads its cached K and V
rows, adds alpha / max(count, 1) times its document's table rows and stores the sum, cast to the pool's dtype, at its
destination row. Any strides on every [rows, H, D] tensor; the table is contiguous [2, n_docs, H, D] plus the counts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _at(row, hh, offs_d, s_r, s_h, s_d):
    """Offsets of a [BLOCK_H, BLOCK_D] tile of row `row` of a [rows, H, D] tensor with the given strides."""
    return row * s_r + hh[:, None] * s_h + offs_d[None, :] * s_d


@triton.jit
def _accumulate(K, V, KP, VP, BASE, DOC, TABLE, COUNT, H, D, n_docs,
                s_kr, s_kh, s_kd, s_vr, s_vh, s_vd, s_pr, s_ph, s_pd, s_qr, s_qh, s_qd,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    d = tl.load(DOC + i).to(tl.int64)
    if d >= 0:
        row = tl.load(BASE + i).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + offs_h
            mask = (hh < H)[:, None] & (offs_d < D)[None, :]
            tk = _at(d, hh, offs_d, H * D, D, 1)  # the document's K row of the table; its V row n_docs rows on
            fk = tl.load(K + _at(i, hh, offs_d, s_kr, s_kh, s_kd), mask=mask).to(tl.float32)
            ck = tl.load(KP + _at(row, hh, offs_d, s_pr, s_ph, s_pd), mask=mask).to(tl.float32)
            tl.atomic_add(TABLE + tk, fk - ck, mask=mask)
            fv = tl.load(V + _at(i, hh, offs_d, s_vr, s_vh, s_vd), mask=mask).to(tl.float32)
            cv = tl.load(VP + _at(row, hh, offs_d, s_qr, s_qh, s_qd), mask=mask).to(tl.float32)
            tl.atomic_add(TABLE + n_docs * H * D + tk, fv - cv, mask=mask)
        tl.atomic_add(COUNT + d, 1.0)


@triton.jit
def _write(KP, VP, BASE, DOC, DST, TABLE, COUNT, H, D, n_docs, alpha,
           s_pr, s_ph, s_pd, s_qr, s_qh, s_qd,
           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    d = tl.load(DOC + s).to(tl.int64)
    if d >= 0:
        src = tl.load(BASE + s).to(tl.int64)
        dst = tl.load(DST + s).to(tl.int64)
        scale = alpha / tl.maximum(tl.load(COUNT + d), 1.0)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + offs_h
            mask = (hh < H)[:, None] & (offs_d < D)[None, :]
            tk = _at(d, hh, offs_d, H * D, D, 1)
            ck = tl.load(KP + _at(src, hh, offs_d, s_pr, s_ph, s_pd), mask=mask).to(tl.float32)
            dk = tl.load(TABLE + tk, mask=mask)
            tl.store(KP + _at(dst, hh, offs_d, s_pr, s_ph, s_pd), (ck + dk * scale).to(KP.dtype.element_ty), mask=mask)
            cv = tl.load(VP + _at(src, hh, offs_d, s_qr, s_qh, s_qd), mask=mask).to(tl.float32)
            dv = tl.load(TABLE + n_docs * H * D + tk, mask=mask)
            tl.store(VP + _at(dst, hh, offs_d, s_qr, s_qh, s_qd), (cv + dv * scale).to(VP.dtype.element_ty), mask=mask)


def launch(kpool: torch.Tensor, vpool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fresh_base: torch.Tensor,
           fresh_doc: torch.Tensor, slot_base: torch.Tensor, slot_doc: torch.Tensor, dst: torch.Tensor, n_docs: int,
           alpha: float) -> None:
    _, h, d = kpool.shape
    a, s = k.shape[0], slot_base.shape[0]
    if s == 0 or h == 0 or d == 0:
        return
    table = torch.zeros(2 * n_docs * h * d + n_docs, dtype=torch.float32, device=kpool.device)
    count = table[2 * n_docs * h * d:]
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(h), 4096 // block_d))
    if a:
        _accumulate[(a,)](k, v, kpool, vpool, fresh_base.contiguous(), fresh_doc.contiguous(), table, count, h, d,
                          n_docs, *k.stride(), *v.stride(), *kpool.stride(), *vpool.stride(),
                          BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    _write[(s,)](kpool, vpool, slot_base.contiguous(), slot_doc.contiguous(), dst.contiguous(), table, count, h, d,
                 n_docs, alpha, *kpool.stride(), *vpool.stride(), BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
