"""Triton batched decode attention over a row map (flash-decoding with deferred RoPE).

Grid (B, Hkv, SPLITS): a program owns one sequence, one kv head and one slice of the key positions. The GROUP q
heads reading that kv head are the rows of its tiles (padded to 16 for tl.dot), so each key tile is gathered
through the row map and rotated once for all of them. The key loop stops at the sequence's own position (read
from q_pos on the device: no host sync, so a CUDA graph replays it for any length). Partial softmaxes (running
max, sum, unnormalised accumulator; exp2 domain) are merged in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import LOG2E, dot_in_fp32, dot_precision, emulate_rne, half_pad, load_halves_rotated, unit_last_stride

NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _decode_kernel(Q, QPOS, K, V, ROWS, COS, SIN, PART_ACC, PART_ML, qk_scale, split_len,
                   stride_qb, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_rb,
                   stride_cos, stride_sin, stride_ps, stride_pb, stride_ms, stride_mb,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
                   EMULATE_RNE: tl.constexpr):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(QPOS + b).to(tl.int32) + 1
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, n)
    g = tl.arange(0, GROUP_PAD)
    g_ok = g < GROUP
    heads = hk * GROUP + g
    offs_h = tl.arange(0, HALF_PAD)
    q_mask = g_ok[:, None] & (offs_h < HALF)[None, :]
    q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh + offs_h[None, :]
    q1 = tl.load(q_ptr, mask=q_mask, other=0.0)
    q2 = tl.load(q_ptr + HALF, mask=q_mask, other=0.0)
    if DOT_F32:
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
    m_i = tl.zeros([GROUP_PAD], tl.float32) + NEG_BIG
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc1 = tl.zeros([GROUP_PAD, HALF_PAD], tl.float32)
    acc2 = tl.zeros([GROUP_PAD, HALF_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        idx = start + offs_n
        ok = idx < hi
        rows = tl.load(ROWS + b * stride_rb + idx, mask=ok, other=0).to(tl.int64)
        k1, k2 = load_halves_rotated(K + hk * stride_kh, rows, idx, ok, stride_kr, COS, SIN, stride_cos,
                                     stride_sin, HALF, HALF_PAD, True, EMULATE_RNE)
        v1, v2 = load_halves_rotated(V + hk * stride_vh, rows, idx, ok, stride_vr, COS, SIN, stride_cos,
                                     stride_sin, HALF, HALF_PAD, False, EMULATE_RNE)
        if DOT_F32:
            k1 = k1.to(tl.float32)
            k2 = k2.to(tl.float32)
            v1 = v1.to(tl.float32)
            v2 = v2.to(tl.float32)
        s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION) + tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = p.to(v1.dtype)
        acc1 = acc1 * alpha[:, None] + tl.dot(pv, v1, input_precision=PRECISION)
        acc2 = acc2 * alpha[:, None] + tl.dot(pv, v2, input_precision=PRECISION)
        m_i = m_new
    base = sp * stride_ps + b * stride_pb + heads * (2 * HALF_PAD)
    tl.store(PART_ACC + base[:, None] + offs_h[None, :], acc1, mask=g_ok[:, None])
    tl.store(PART_ACC + base[:, None] + HALF_PAD + offs_h[None, :], acc2, mask=g_ok[:, None])
    ml = PART_ML + sp * stride_ms + b * stride_mb + heads * 2
    tl.store(ml, m_i, mask=g_ok)
    tl.store(ml + 1, l_i, mask=g_ok)


@triton.jit
def _merge_kernel(PART_ACC, PART_ML, OUT, splits, stride_ps, stride_pb, stride_ms, stride_mb, stride_ob, stride_oh,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """out[b, h] = sum_s w_s acc_s / sum_s w_s l_s with w_s = 2^(m_s - max m): the partial softmaxes merged."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    ok = s < splits
    ml = PART_ML + s * stride_ms + b * stride_mb + h * 2
    m = tl.load(ml, mask=ok, other=float("-inf"))
    l = tl.load(ml + 1, mask=ok, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    w = tl.where(ok, w, 0.0)
    denom = tl.sum(w * l, 0)
    offs = tl.arange(0, HALF_PAD)
    acc = PART_ACC + s[:, None] * stride_ps + b * stride_pb + h * (2 * HALF_PAD) + offs[None, :]
    a1 = tl.sum(tl.load(acc, mask=ok[:, None], other=0.0) * w[:, None], 0) / denom
    a2 = tl.sum(tl.load(acc + HALF_PAD, mask=ok[:, None], other=0.0) * w[:, None], 0) / denom
    out = OUT + b * stride_ob + h * stride_oh + offs
    tl.store(out, a1.to(OUT.dtype.element_ty), mask=offs < HALF)
    tl.store(out + HALF, a2.to(OUT.dtype.element_ty), mask=offs < HALF)


def plan(b: int, hkv: int, c: int, block_n: int | None = None, splits: int | None = None) -> tuple[int, int, int]:
    """(block_n, split_len, splits): enough programs to fill the GPU (~2 per SM of an H100/H200) for any batch."""
    bn = block_n or (64 if c >= 64 else max(16, triton.next_power_of_2(c)))
    blocks = triton.cdiv(c, bn)
    want = splits or max(1, min(blocks, triton.cdiv(264, max(1, b * hkv))))
    per = triton.cdiv(blocks, want)
    return bn, per * bn, triton.cdiv(blocks, per)


def launch(q, q_pos, k, v, row_map, cos, sin, scale, *, block_n: int | None = None, splits: int | None = None,
           num_warps: int = 4):
    q, k, v, cos, sin = (unit_last_stride(t) for t in (q, k, v, cos, sin))
    b, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    c = row_map.shape[1]
    if b == 0:
        return q.new_empty((0, hq, d))
    hp = half_pad(d)
    bn, split_len, n_splits = plan(b, hkv, c, block_n, splits)
    part_acc = torch.empty((n_splits, b, hq, 2 * hp), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((n_splits, b, hq, 2), dtype=torch.float32, device=q.device)
    rows = row_map.contiguous()
    _decode_kernel[(b, hkv, n_splits)](
        q, q_pos.contiguous(), k, v, rows, cos, sin, part_acc, part_ml, float(scale) * LOG2E, split_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), rows.stride(0),
        cos.stride(0), sin.stride(0), part_acc.stride(0), part_acc.stride(1), part_ml.stride(0), part_ml.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HALF=d // 2, HALF_PAD=hp, BLOCK_N=bn,
        DOT_F32=dot_in_fp32(q.dtype), PRECISION=dot_precision(q.dtype), EMULATE_RNE=emulate_rne(),
        num_warps=num_warps)
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    _merge_kernel[(b, hq)](part_acc, part_ml, out, n_splits, part_acc.stride(0), part_acc.stride(1),
                           part_ml.stride(0), part_ml.stride(1), out.stride(0), out.stride(1),
                           HALF=d // 2, HALF_PAD=hp, SPLITS_PAD=max(2, triton.next_power_of_2(n_splits)),
                           num_warps=1)
    return out
