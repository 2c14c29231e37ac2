"""Triton attention over a pool of KV rows with deferred RoPE and a mask by absolute position.

Flash-attention forward (online softmax in fp32, exp2 domain), one program per (block of queries, q head[, key
split]). Each key tile is gathered through `kv_rows`, rotated in registers at `kv_pos` (rotate-half RoPE kept
as its two halves, so q.k = q1.k1' + q2.k2' with no register shuffles), masked by ``kv_pos[j] <= q_pos[i]``.
When `kv_pos` is sorted, each query block stops at the last key any of its queries can see (checked and searched
inside the kernel). With few query blocks (question rows only) the keys are split across programs
(flash-decoding) and a second small kernel merges the partial softmaxes.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import (FAR_POSITION, LOG2E, dot_in_fp32, dot_precision, emulate_rne,
                     half_pad, load_halves_rotated, round_to, search_steps, sort_block, unit_last_stride,
                     visible_key_end)


@triton.jit
def _attn_fwd_kernel(Q, QPOS, K, V, ROWS, KPOS, COS, SIN, OUT, PART_ACC, PART_ML,
                     M, N, qk_scale, SEARCH_STEPS,
                     s_qm, s_qh, s_kr, s_kh, s_vr, s_vh, s_om, s_oh, s_cos, s_sin,
                     GROUP: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SORT_BLOCK: tl.constexpr,
                     HAS_ROWS: tl.constexpr, ROPE: tl.constexpr, DOT_F32: tl.constexpr,
                     PRECISION: tl.constexpr, EMULATE_RNE: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    hq = tl.num_programs(1)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, HALF_PAD)
    offs_d = tl.arange(0, 2 * HALF_PAD)
    m_ok = offs_m < M
    qpos = tl.load(QPOS + offs_m, mask=m_ok, other=-1)                      # [BM] int64; padding sees nothing

    q_ptr = Q + offs_m[:, None].to(tl.int64) * s_qm + h * s_qh + offs_h[None, :]
    q_mask = m_ok[:, None] & (offs_h < HALF)[None, :]
    q1 = tl.load(q_ptr, mask=q_mask, other=0.0)                             # [BM, HALF_PAD]
    q2 = tl.load(q_ptr + HALF, mask=q_mask, other=0.0)
    if DOT_F32:
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)

    # the keys this program scans: [start, stop) of the ones visible to the block, cut in SPLITS tile ranges
    n_end = visible_key_end(KPOS, N, tl.max(qpos, 0), SEARCH_STEPS, SORT_BLOCK)
    tiles = tl.cdiv(n_end, BLOCK_N)
    per_split = tl.cdiv(tiles, SPLITS)
    start = split * per_split * BLOCK_N
    stop = tl.minimum(n_end, start + per_split * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, 2 * HALF_PAD], tl.float32)
    k_base = K + hk * s_kh
    v_base = V + hk * s_vh
    v_cols = offs_d < 2 * HALF
    for n0 in range(start, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        kpos = tl.load(KPOS + offs_n, mask=n_ok, other=FAR_POSITION)
        if HAS_ROWS:
            rows = tl.load(ROWS + offs_n, mask=n_ok, other=0)
        else:
            rows = offs_n.to(tl.int64)
        k1, k2 = load_halves_rotated(k_base, rows, kpos, n_ok, s_kr, COS, SIN, s_cos, s_sin,
                                     HALF, HALF_PAD, ROPE, EMULATE_RNE)   # [BN, HALF_PAD] each
        if DOT_F32:
            k1 = k1.to(tl.float32)
            k2 = k2.to(tl.float32)
        s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
        s = tl.dot(q2, tl.trans(k2), acc=s, input_precision=PRECISION)
        s = tl.where(kpos[None, :] <= qpos[:, None], s * qk_scale, float("-inf"))   # log2 domain
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)               # rows that saw nothing yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + rows[:, None] * s_vr + offs_d[None, :], mask=n_ok[:, None] & v_cols[None, :],
                    other=0.0)                                              # [BN, D_PAD]
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]                  # a query that sees no key -> 0
        o_ptr = OUT + offs_m[:, None].to(tl.int64) * s_om + h * s_oh + offs_d[None, :]
        tl.store(o_ptr, round_to(out, OUT.dtype.element_ty, EMULATE_RNE), mask=m_ok[:, None] & v_cols[None, :])
    else:
        # partials: acc [SPLITS, M, Hq, D_PAD], (max, sum) [SPLITS, M, Hq, 2], all fp32
        row = (split * M + offs_m.to(tl.int64)) * hq + h
        tl.store(PART_ACC + row[:, None] * (2 * HALF_PAD) + offs_d[None, :], acc, mask=m_ok[:, None])
        tl.store(PART_ML + row * 2, m_i, mask=m_ok)
        tl.store(PART_ML + row * 2 + 1, l_i, mask=m_ok)


@triton.jit
def _attn_merge_kernel(PART_ACC, PART_ML, OUT, M, s_om, s_oh,
                       SPLITS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                       EMULATE_RNE: tl.constexpr):
    """Merges the per-split partial softmaxes of one (query block, q head)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    hq = tl.num_programs(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, 2 * HALF_PAD)
    m_ok = offs_m < M
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for sp in range(SPLITS):
        row = (sp * M + offs_m.to(tl.int64)) * hq + h
        m_all = tl.maximum(m_all, tl.load(PART_ML + row * 2, mask=m_ok, other=float("-inf")))
    m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, 2 * HALF_PAD], tl.float32)
    for sp in range(SPLITS):
        row = (sp * M + offs_m.to(tl.int64)) * hq + h
        w = tl.exp2(tl.load(PART_ML + row * 2, mask=m_ok, other=float("-inf")) - m_use)
        l_sum += w * tl.load(PART_ML + row * 2 + 1, mask=m_ok, other=0.0)
        acc += w[:, None] * tl.load(PART_ACC + row[:, None] * (2 * HALF_PAD) + offs_d[None, :],
                                    mask=m_ok[:, None], other=0.0)
    out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    o_ptr = OUT + offs_m[:, None].to(tl.int64) * s_om + h * s_oh + offs_d[None, :]
    tl.store(o_ptr, round_to(out, OUT.dtype.element_ty, EMULATE_RNE),
             mask=m_ok[:, None] & (offs_d < 2 * HALF)[None, :])


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pick_blocks(m: int, head_dim: int, dtype: torch.dtype, interpreting: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a launch; fixed heuristics, no autotune (shapes vary per
    request, so per-shape tuning would retune all the time). fp32 (exact dots, no tensor cores) gets smaller
    tiles to stay within shared memory."""
    if interpreting:
        return max(16, min(32, triton.next_power_of_2(m))), 16, 1, 1
    wide = head_dim > 128 or dtype == torch.float32
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 or wide else 128
    block_n = 32 if wide else 64
    num_warps = 4 if block_m <= 64 else 8
    return block_m, block_n, num_warps, 2


def pick_splits(programs: int, n: int, block_n: int, device: torch.device) -> int:
    """Key splits so that about two programs per SM are busy, keeping >= 8 key tiles per split."""
    if device.type != "cuda":
        return 1
    want = (2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())) // programs
    return max(1, min(want, n // (8 * block_n), 16))


def launch(q, q_pos, k, v, kv_rows, kv_pos, cos, sin, scale, *, block_m: int | None = None,
           block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
           num_splits: int | None = None):
    """Runs the kernel on validated inputs. Block sizes and key splits may be overridden (tests, benchmarks)."""
    q, k, v, cos, sin = (unit_last_stride(t) for t in (q, k, v, cos, sin))
    m, hq, d = q.shape
    hkv = k.shape[1]
    n = kv_pos.numel()
    out = torch.empty((m, hq, d), dtype=q.dtype, device=q.device)
    if m == 0:
        return out
    if n == 0:
        return out.zero_()
    interpreting = emulate_rne()
    bm, bn, warps, stages = pick_blocks(m, d, q.dtype, interpreting)
    bm, bn = block_m or bm, block_n or bn
    warps, stages = num_warps or warps, num_stages or stages
    blocks = triton.cdiv(m, bm)
    splits = num_splits or pick_splits(blocks * hq, n, bn, q.device)
    hp = half_pad(d)
    q_pos = q_pos.contiguous()
    kv_pos = kv_pos.contiguous()
    rope = cos is not None
    rows = kv_rows.contiguous() if kv_rows is not None else kv_pos  # placeholder pointer when HAS_ROWS is off
    cos_t = cos if rope else k
    sin_t = sin if rope else k
    if splits > 1:
        part_acc = torch.empty((splits, m, hq, 2 * hp), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((splits, m, hq, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out                                   # unused placeholders
    _attn_fwd_kernel[(blocks, hq, splits)](
        q, q_pos, k, v, rows, kv_pos, cos_t, sin_t, out, part_acc, part_ml,
        m, n, float(scale) * LOG2E, search_steps(n),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), cos_t.stride(0), sin_t.stride(0),
        GROUP=hq // hkv, HALF=d // 2, HALF_PAD=hp, BLOCK_M=bm, BLOCK_N=bn, SPLITS=splits, SORT_BLOCK=sort_block(n),
        HAS_ROWS=kv_rows is not None, ROPE=rope, DOT_F32=dot_in_fp32(q.dtype), PRECISION=dot_precision(q.dtype),
        EMULATE_RNE=interpreting, num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        merge_bm = min(32, triton.next_power_of_2(m))
        _attn_merge_kernel[(triton.cdiv(m, merge_bm), hq)](
            part_acc, part_ml, out, m, out.stride(0), out.stride(1),
            SPLITS=splits, HALF=d // 2, HALF_PAD=hp, BLOCK_M=merge_bm, EMULATE_RNE=interpreting, num_warps=4)
    return out
