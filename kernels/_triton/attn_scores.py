"""Triton attention scores: averaged-over-heads softmax probabilities of query rows over the keys.

Pass 1, one program per (query block, q head, key split): online row max and sum of exp2 scores (the attention
forward without values), one partial per split. Pass 2, one program per (query block, key block): for every kv
head the key tile is gathered and rotated once, then each q head of its group recomputes its scores, normalises
them with the pass-1 statistics (splits merged on the fly) and adds them to one [BLOCK_M, BLOCK_N] fp32
accumulator. Only [M, N] and 2 x [splits, Hq, M] are written; [Hq, M, N] never exists. Given the softmax
statistics of the attention of the same queries over the same keys (`attention.launch(stats=True)`), pass 1 is not
run: a probe layer reads every key twice (attention, probabilities) instead of three times.

Both passes compute every logit with the same code, tile shapes and launch options, so pass 2 recomputes pass 1's
fp32 logits exactly and the normalisation is consistent (the row maximum gives exp2(0) = 1). The keys are
rotated with HF's rounding (`common.rope_halves`), exactly as the torch reference rotates them before upcasting,
so kernel and reference compute the same function and differ only by fp32 summation order. When pass 1 would
rotate every key tile many times (several query blocks times the q heads of a group), the keys are gathered and
rotated once up front instead (`rope.gather_rotated`, identical bits).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention import key_count, positions
from .attention import pick_splits, sm_count
from .common import (FAR_POSITION, LOG2E, dot_in_fp32, dot_precision, emulate_rne,
                     half_pad, load_halves_rotated, search_steps, sort_block, unit_last_stride, visible_key_end)
from .rope import gather_rotated

# Rotate the keys up front once pass 1 would rotate each key tile on load at least this many times (query blocks
# x q heads of a group), if the keys are many enough to pay for the extra launch or the reads very many (H200,
# Llama-8B shapes: 32k keys x 4915 queries 9.4 -> 5.7 ms).
PREROTATE_MIN_READS = 4
PREROTATE_MIN_KEYS = 16384
PREROTATE_ALWAYS_READS = 16


def prerotate_by_default(m: int, block_m: int, group: int, n: int) -> bool:
    reads = triton.cdiv(m, block_m) * group
    return reads >= PREROTATE_MIN_READS and (n >= PREROTATE_MIN_KEYS or reads >= PREROTATE_ALWAYS_READS)


@triton.jit
def _load_q_halves(Q, offs_m, m_ok, h, s_qm, s_qh, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                   DOT_F32: tl.constexpr):
    offs_h = tl.arange(0, HALF_PAD)
    ptr = Q + offs_m[:, None].to(tl.int64) * s_qm + h * s_qh + offs_h[None, :]
    mask = m_ok[:, None] & (offs_h < HALF)[None, :]
    q1 = tl.load(ptr, mask=mask, other=0.0)
    q2 = tl.load(ptr + HALF, mask=mask, other=0.0)
    if DOT_F32:
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
    return q1, q2


@triton.jit
def _scores_tile(q1, q2, k1, k2, qpos, kpos, qk_scale, PRECISION: tl.constexpr):
    """[BM, BN] fp32 scores in the log2 domain, -inf where the key is in the query's future."""
    s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
    s = tl.dot(q2, tl.trans(k2), acc=s, input_precision=PRECISION)
    return tl.where(kpos[None, :] <= qpos[:, None], s * qk_scale, float("-inf"))


@triton.jit
def _row_stats_kernel(Q, QPOS, K, ROWS, KPOS, COS, SIN, MAX_OUT, SUM_OUT,
                      M, N, qk_scale, SEARCH_STEPS, s_qm, s_qh, s_kr, s_kh, s_cos, s_sin,
                      GROUP: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROWS: tl.constexpr, ROPE: tl.constexpr,
                      DOT_F32: tl.constexpr, PRECISION: tl.constexpr, EMULATE_RNE: tl.constexpr,
                      SORT_BLOCK: tl.constexpr, SPLITS: tl.constexpr, POS_IS_INDEX: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    hq = tl.num_programs(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    qpos = tl.load(QPOS + offs_m, mask=m_ok, other=-1)
    q1, q2 = _load_q_halves(Q, offs_m, m_ok, h, s_qm, s_qh, HALF, HALF_PAD, DOT_F32)
    k_base = K + (h // GROUP) * s_kh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if POS_IS_INDEX:                                                        # key j at position j: no search
        n_end = tl.minimum(tl.maximum(tl.max(qpos, 0) + 1, 0), N).to(tl.int32)
    else:
        n_end = visible_key_end(KPOS, N, tl.max(qpos, 0), SEARCH_STEPS, SORT_BLOCK)
    per_split = tl.cdiv(tl.cdiv(n_end, BLOCK_N), SPLITS)                    # key tiles per split
    start = split * per_split * BLOCK_N
    stop = tl.minimum(n_end, start + per_split * BLOCK_N)
    for n0 in range(start, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        if POS_IS_INDEX:
            kpos = tl.where(n_ok, offs_n.to(tl.int64), FAR_POSITION)
        else:
            kpos = tl.load(KPOS + offs_n, mask=n_ok, other=FAR_POSITION)
        if HAS_ROWS:
            rows = tl.load(ROWS + offs_n, mask=n_ok, other=0)
        else:
            rows = offs_n.to(tl.int64)
        k1, k2 = load_halves_rotated(k_base, rows, kpos, n_ok, s_kr, COS, SIN, s_cos, s_sin,
                                     HALF, HALF_PAD, ROPE, EMULATE_RNE)
        if DOT_F32:
            k1 = k1.to(tl.float32)
            k2 = k2.to(tl.float32)
        s = _scores_tile(q1, q2, k1, k2, qpos, kpos, qk_scale, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(s - m_use[:, None]), 1)
        m_i = m_new
    row = (split * hq + h) * M + offs_m                                     # partials [SPLITS, Hq, M]
    tl.store(MAX_OUT + row, m_i, mask=m_ok)
    tl.store(SUM_OUT + row, l_i, mask=m_ok)


@triton.jit
def _merge_stats(MAX_IN, SUM_IN, h, offs_m, m_ok, s_sp, s_h, s_m, SPLITS: tl.constexpr):
    """Row max and 1 / row sum of head h from the per-split partials at MAX_IN / SUM_IN + split x s_sp + h x s_h +
    row x s_m (0, 0 for a row that sees no key)."""
    m_all = tl.full(offs_m.shape, float("-inf"), tl.float32)
    for sp in range(SPLITS):
        m_all = tl.maximum(m_all, tl.load(MAX_IN + sp * s_sp + h * s_h + offs_m * s_m, mask=m_ok,
                                          other=float("-inf")))
    m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_sum = tl.zeros(offs_m.shape, tl.float32)
    for sp in range(SPLITS):
        row = sp * s_sp + h * s_h + offs_m * s_m
        m_sp = tl.load(MAX_IN + row, mask=m_ok, other=float("-inf"))
        l_sum += tl.load(SUM_IN + row, mask=m_ok, other=0.0) * tl.exp2(m_sp - m_use)
    return m_use, tl.where(l_sum > 0.0, 1.0 / tl.where(l_sum > 0.0, l_sum, 1.0), 0.0)


@triton.jit
def _probs_kernel(Q, QPOS, K, ROWS, KPOS, COS, SIN, MAX_IN, SUM_IN, OUT,
                  M, N, HKV, qk_scale, inv_heads, s_qm, s_qh, s_kr, s_kh, s_cos, s_sin, s_om, s_sp, s_sh, s_sm,
                  GROUP: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROWS: tl.constexpr, ROPE: tl.constexpr,
                  DOT_F32: tl.constexpr, PRECISION: tl.constexpr, EMULATE_RNE: tl.constexpr,
                  SPLITS: tl.constexpr, POS_IS_INDEX: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    qpos = tl.load(QPOS + offs_m, mask=m_ok, other=-1)
    if POS_IS_INDEX:
        kpos = tl.where(n_ok, offs_n.to(tl.int64), FAR_POSITION)
    else:
        kpos = tl.load(KPOS + offs_n, mask=n_ok, other=FAR_POSITION)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if tl.min(kpos, 0) <= tl.max(qpos, 0):                                 # else the whole tile is in the future
        if HAS_ROWS:
            rows = tl.load(ROWS + offs_n, mask=n_ok, other=0)
        else:
            rows = offs_n.to(tl.int64)
        for hk in range(0, HKV):
            k1, k2 = load_halves_rotated(K + hk * s_kh, rows, kpos, n_ok, s_kr, COS, SIN, s_cos, s_sin,
                                         HALF, HALF_PAD, ROPE, EMULATE_RNE)
            if DOT_F32:
                k1 = k1.to(tl.float32)
                k2 = k2.to(tl.float32)
            for g in range(0, GROUP):
                h = hk * GROUP + g
                q1, q2 = _load_q_halves(Q, offs_m, m_ok, h, s_qm, s_qh, HALF, HALF_PAD, DOT_F32)
                s = _scores_tile(q1, q2, k1, k2, qpos, kpos, qk_scale, PRECISION)
                row_max, inv_sum = _merge_stats(MAX_IN, SUM_IN, h, offs_m, m_ok, s_sp, s_sh, s_sm, SPLITS)
                acc += tl.exp2(s - row_max[:, None]) * inv_sum[:, None]
    o_ptr = OUT + offs_m[:, None].to(tl.int64) * s_om + offs_n[None, :]
    tl.store(o_ptr, acc * inv_heads, mask=m_ok[:, None] & n_ok[None, :])


def pick_blocks(m: int, head_dim: int, dtype: torch.dtype, interpreting: bool, n: int = 0,
                sms: int = 132) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); fixed heuristics (no per-shape autotune). Wider key tiles for
    more than 64 query rows (H200: 6.4 -> 5.7 ms at 32k keys x 4915 queries). Shorter query blocks while the
    probabilities pass (one program per query block and key tile) would leave most SMs idle: the probe's 64 rows
    over 2k keys make 32 programs at 64 rows, 128 at 16 (H100: 1.2-1.4x faster, `benchmarks/probe_kernels.py`)."""
    if interpreting:
        return 16, 16, 1, 1
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if head_dim > 128 or dtype == torch.float32 else 64 if m <= 64 else 128
    while block_m > 16 and triton.cdiv(m, block_m) * triton.cdiv(n, block_n) < sms // 2:
        block_m //= 2
    return block_m, block_n, 4, 2


def launch(q, q_pos, k, kv_rows, kv_pos, cos, sin, scale, *, block_m: int | None = None,
           block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
           num_splits: int | None = None, prerotate: bool | None = None, stats: torch.Tensor | None = None):
    """Runs both passes on validated inputs; blocks, key splits of the stats pass and the up-front rotation may
    be overridden. `stats`: the softmax statistics of the attention of the same queries over the same keys
    (`attention.launch(stats=True)`'s second output, [1, M, Hq, 2], or per-split partials [splits, M, Hq, 2]):
    pass 1 is not run and the probabilities are normalised by them."""
    q, k, cos, sin = (unit_last_stride(t) for t in (q, k, cos, sin))
    m, hq, d = q.shape
    hkv = k.shape[1]
    n = key_count(k, kv_rows, kv_pos)
    out = torch.zeros((m, n), dtype=torch.float32, device=q.device)
    if m == 0 or n == 0:
        return out
    interpreting = emulate_rne()
    sms = sm_count(q.device) if q.device.type == "cuda" else 132
    bm, bn, warps, stages = pick_blocks(m, d, q.dtype, interpreting, n, sms)
    bm, bn = block_m or bm, block_n or bn
    warps, stages = num_warps or warps, num_stages or stages
    splits = stats.shape[0] if stats is not None else (num_splits or pick_splits(triton.cdiv(m, bm) * hq, n, bn,
                                                                                    q.device))
    q_pos = q_pos.contiguous()
    by_index = kv_pos is None
    kv_pos = q_pos if by_index else kv_pos.contiguous()  # placeholder pointer when positions are indices
    rope = cos is not None
    if prerotate is None:
        prerotate = prerotate_by_default(m, bm, hq // hkv, n)
    if rope and prerotate:
        pos = positions(k, kv_rows, None) if by_index else kv_pos
        k = gather_rotated(k, kv_rows, pos, cos, sin).transpose(0, 1)      # [N, Hkv, D] view, rows 0..N-1
        kv_rows, cos, sin, rope = None, None, None, False
    rows = kv_rows.contiguous() if kv_rows is not None else kv_pos   # placeholder pointer when HAS_ROWS is off
    cos_t = cos if rope else k
    sin_t = sin if rope else k
    if stats is not None and tuple(stats.shape[1:]) != (m, hq, 2):
        raise ValueError(f"stats must be [splits, {m}, {hq}, 2], got {tuple(stats.shape)}")
    common = dict(GROUP=hq // hkv, HALF=d // 2, HALF_PAD=half_pad(d), BLOCK_M=bm, BLOCK_N=bn,
                  HAS_ROWS=kv_rows is not None, ROPE=rope, DOT_F32=dot_in_fp32(q.dtype),
                  PRECISION=dot_precision(q.dtype), EMULATE_RNE=interpreting, POS_IS_INDEX=by_index,
                  num_warps=warps, num_stages=stages)
    qk_scale = float(scale) * LOG2E
    if stats is None:
        row_max = torch.empty((splits, hq, m), dtype=torch.float32, device=q.device)
        row_sum = torch.empty((splits, hq, m), dtype=torch.float32, device=q.device)
        _row_stats_kernel[(triton.cdiv(m, bm), hq, splits)](
            q, q_pos, k, rows, kv_pos, cos_t, sin_t, row_max, row_sum,
            m, n, qk_scale, search_steps(n), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos_t.stride(0), sin_t.stride(0), SORT_BLOCK=sort_block(n), SPLITS=splits, **common)
        strides = (hq * m, m, 1)
    else:  # [splits, M, Hq, 2]: the max and the sum interleaved
        stats = stats.contiguous()
        row_max, row_sum = stats[..., 0], stats[..., 1]
        strides = (m * hq * 2, 2, hq * 2)
    _probs_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        q, q_pos, k, rows, kv_pos, cos_t, sin_t, row_max, row_sum, out,
        m, n, hkv, qk_scale, 1.0 / hq, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos_t.stride(0), sin_t.stride(0), out.stride(0), *strides, SPLITS=splits, **common)
    return out
