"""Triton attention over a pool of KV rows with deferred RoPE and a mask by absolute position.

Flash-attention forward (online softmax in fp32, exp2 domain, bf16/fp16 tensor-core dots with fp32
accumulators). GQA is packed: one program owns a block of (query, q head) rows of ONE kv head, row r being query
``r // GROUP`` with q head ``hk * GROUP + r % GROUP``, so each K/V tile is loaded (and rotated) once for all the q
heads that read it. Each key tile is gathered through `kv_rows` and masked by ``kv_pos[j] <= q_pos[i]``.

RoPE of the keys, two ways with identical bits (HF's rounding, see `common.rope_halves`):

- on load: each tile is rotated in registers at `kv_pos` (rotate-half kept as its two halves, so
  q.k = q1.k1' + q2.k2' with no register shuffles). Best when few row blocks read each key (question rows).
- once, up front (`prerotate`): with many row blocks every tile would be rotated once per block, so the keys are
  gathered and rotated once into a contiguous [Hkv, N, D] scratch (`rope.gather_rotated`, about one read and
  one write of K) and the kernel reads plain rows with one full-width dot. With very many row blocks the values
  are gathered into a contiguous copy as well (`gather_values`): reading them through `kv_rows` inside the
  kernel was the slower part. Both copies are transient (the size of the attended K / V of one layer).

When `kv_pos` is sorted (checked and searched inside the kernel), a row block stops at the last key any of its
queries can see, and the keys that all its queries see are scanned without the mask. When kv_pos is None (key j at
position j: the fused prefills) positions and bounds are computed, not read: the in-kernel sortedness scan and
binary searches (a chain of dependent loads in every program) are skipped. Heavy (late) row blocks
are launched first. With few row blocks (question rows only) the keys are split across programs
(flash-decoding) and a second small kernel merges the partial softmaxes.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..attention import key_count, positions
from .common import (FAR_POSITION, LOG2E, dot_in_fp32, dot_precision, emulate_rne, half_pad, key_bounds,
                     load_halves_rotated, round_to, search_steps, sort_block, tile_mask, unit_last_stride)
from .rope import gather_rotated

# Finite start of the running max: a row that has seen no key yet keeps it, and exp2 of (it - itself) is 1, so no
# inf - inf appears anywhere (masked scores are -inf and give exp2(-inf) = 0).
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _attend_tile(acc, l_i, m_i, q1, q2, qpos, n0, stop, k_base, v_base, ROWS, KPOS, COS, SIN,
                 s_kr, s_vr, s_cos, s_sin, qk_scale,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROWS: tl.constexpr,
                 K_GATHER: tl.constexpr, ROPE: tl.constexpr, MASKED: tl.constexpr, DOT_F32: tl.constexpr,
                 PRECISION: tl.constexpr, EMULATE_RNE: tl.constexpr, POS_IS_INDEX: tl.constexpr):
    """One key tile [n0, n0 + BLOCK_N) of the online softmax; keys at or past `stop` are padding."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, 2 * HALF_PAD)
    n_ok = offs_n < stop
    if POS_IS_INDEX:                                                        # key j at position j: nothing to read
        kpos = tl.where(n_ok, offs_n.to(tl.int64), FAR_POSITION)
    elif MASKED or ROPE:
        kpos = tl.load(KPOS + offs_n, mask=n_ok, other=FAR_POSITION)
    else:
        kpos = offs_n                                                       # unused: no mask, no rotation
    if HAS_ROWS:
        rows = tl.load(ROWS + offs_n, mask=n_ok, other=0)
    else:
        rows = offs_n.to(tl.int64)
    if K_GATHER:
        k_rows = rows
    else:
        k_rows = offs_n.to(tl.int64)
    d_mask = tile_mask(n_ok, offs_d, 2 * HALF, 2 * HALF_PAD)
    if ROPE:
        k1, k2 = load_halves_rotated(k_base, k_rows, kpos, n_ok, s_kr, COS, SIN, s_cos, s_sin,
                                     HALF, HALF_PAD, True, EMULATE_RNE)   # [BN, HALF_PAD] each
        if DOT_F32:
            k1 = k1.to(tl.float32)
            k2 = k2.to(tl.float32)
        s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
        s = tl.dot(q2, tl.trans(k2), acc=s, input_precision=PRECISION)
    else:
        k = tl.load(k_base + k_rows[:, None] * s_kr + offs_d[None, :], mask=d_mask, other=0.0)   # [BN, D_PAD]
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q1, tl.trans(k), input_precision=PRECISION)
    if MASKED:
        s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)                        # log2 domain (qk_scale > 0)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + rows[:, None] * s_vr + offs_d[None, :], mask=d_mask, other=0.0)   # [BN, D_PAD]
    acc = acc * alpha[:, None]
    if DOT_F32:
        acc = tl.dot(p, v.to(tl.float32), acc=acc, input_precision=PRECISION)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc=acc)
    return acc, l_i, m_new


@triton.jit
def _attn_fwd_kernel(Q, QPOS, K, V, ROWS, KPOS, COS, SIN, OUT, PART_ACC, PART_ML,
                     M, N, qk_scale, SEARCH_STEPS,
                     s_qm, s_qh, s_kr, s_kh, s_vr, s_vh, s_om, s_oh, s_cos, s_sin,
                     GROUP: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SORT_BLOCK: tl.constexpr,
                     HAS_ROWS: tl.constexpr, K_GATHER: tl.constexpr, ROPE: tl.constexpr, DOT_F32: tl.constexpr,
                     PRECISION: tl.constexpr, EMULATE_RNE: tl.constexpr, POS_IS_INDEX: tl.constexpr,
                     STORE_ML: tl.constexpr):
    pid_r = tl.num_programs(0) - 1 - tl.program_id(0)                     # late (heavy) row blocks first
    hk = tl.program_id(1)
    split = tl.program_id(2)
    hq = tl.num_programs(1) * GROUP
    offs_r = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)                        # packed (query, head of the group)
    r_ok = offs_r < M * GROUP
    offs_m = offs_r // GROUP
    h = hk * GROUP + offs_r % GROUP
    offs_h = tl.arange(0, HALF_PAD)
    offs_d = tl.arange(0, 2 * HALF_PAD)
    qpos = tl.load(QPOS + offs_m, mask=r_ok, other=-1)                      # [BM] int64; padding sees nothing

    q_base = Q + offs_m[:, None].to(tl.int64) * s_qm + h[:, None] * s_qh
    if ROPE:                                                                # halves, as the rotated keys
        q_mask = tile_mask(r_ok, offs_h, HALF, HALF_PAD)
        q1 = tl.load(q_base + offs_h[None, :], mask=q_mask, other=0.0)     # [BM, HALF_PAD]
        q2 = tl.load(q_base + HALF + offs_h[None, :], mask=q_mask, other=0.0)
    else:                                                                   # whole rows, one dot
        q1 = tl.load(q_base + offs_d[None, :], mask=tile_mask(r_ok, offs_d, 2 * HALF, 2 * HALF_PAD), other=0.0)
        q2 = q1
    if DOT_F32:
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)

    # the keys this program scans: [start, stop) of the ones visible to the block, cut in SPLITS tile ranges;
    # the tiles before `full` are visible to every query of the block and skip the mask
    qmin = tl.min(tl.where(r_ok, qpos, FAR_POSITION), 0)
    if POS_IS_INDEX:  # keys 0..qmin seen by every query of the block, none past qmax
        n_full = tl.minimum(tl.maximum(qmin + 1, 0), N).to(tl.int32)
        n_end = tl.minimum(tl.maximum(tl.max(qpos, 0) + 1, 0), N).to(tl.int32)
    else:
        n_full, n_end = key_bounds(KPOS, N, qmin, tl.max(qpos, 0), SEARCH_STEPS, SORT_BLOCK)
    per_split = tl.cdiv(tl.cdiv(n_end, BLOCK_N), SPLITS)
    start = split * per_split * BLOCK_N
    stop = tl.minimum(n_end, start + per_split * BLOCK_N)
    full = tl.minimum(stop, (n_full // BLOCK_N) * BLOCK_N)

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, 2 * HALF_PAD], tl.float32)
    k_base = K + hk * s_kh
    v_base = V + hk * s_vh
    for n0 in range(start, full, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q1, q2, qpos, n0, stop, k_base, v_base, ROWS, KPOS, COS, SIN,
                                     s_kr, s_vr, s_cos, s_sin, qk_scale, HALF, HALF_PAD, BLOCK_N, HAS_ROWS,
                                     K_GATHER, ROPE, False, DOT_F32, PRECISION, EMULATE_RNE, POS_IS_INDEX)
    for n0 in range(tl.maximum(start, full), stop, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q1, q2, qpos, n0, stop, k_base, v_base, ROWS, KPOS, COS, SIN,
                                     s_kr, s_vr, s_cos, s_sin, qk_scale, HALF, HALF_PAD, BLOCK_N, HAS_ROWS,
                                     K_GATHER, ROPE, True, DOT_F32, PRECISION, EMULATE_RNE, POS_IS_INDEX)

    d_ok = offs_d < 2 * HALF
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]                  # a query that sees no key -> 0
        o_ptr = OUT + offs_m[:, None].to(tl.int64) * s_om + h[:, None] * s_oh + offs_d[None, :]
        tl.store(o_ptr, round_to(out, OUT.dtype.element_ty, EMULATE_RNE), mask=r_ok[:, None] & d_ok[None, :])
        if STORE_ML:  # the softmax statistics too, as one split's partials (attention scores normalise by them)
            row = offs_m.to(tl.int64) * hq + h
            tl.store(PART_ML + row * 2, m_i, mask=r_ok)
            tl.store(PART_ML + row * 2 + 1, l_i, mask=r_ok)
    else:
        # partials: acc [SPLITS, M, Hq, D_PAD], (max, sum) [SPLITS, M, Hq, 2], all fp32
        row = (split * M + offs_m.to(tl.int64)) * hq + h
        tl.store(PART_ACC + row[:, None] * (2 * HALF_PAD) + offs_d[None, :], acc, mask=r_ok[:, None])
        tl.store(PART_ML + row * 2, m_i, mask=r_ok)
        tl.store(PART_ML + row * 2 + 1, l_i, mask=r_ok)


@triton.jit
def _attn_merge_kernel(PART_ACC, PART_ML, OUT, ML_OUT, M, s_om, s_oh,
                       SPLITS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                       EMULATE_RNE: tl.constexpr, STORE_ML: tl.constexpr):
    """Merges the per-split partial softmaxes of one (query block, q head); with STORE_ML also writes the merged
    statistics (max, sum) to ML_OUT [M, Hq, 2]."""
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
    if STORE_ML:
        row = offs_m.to(tl.int64) * hq + h
        tl.store(ML_OUT + row * 2, m_use, mask=m_ok)
        tl.store(ML_OUT + row * 2 + 1, l_sum, mask=m_ok)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# Up-front RoPE (see the module docstring) once each key tile would be rotated on load by at least this many row
# blocks, if the keys are many enough to pay for the extra launch (or the blocks very many); values are then also
# gathered into a contiguous copy when many row blocks read them (H200, Llama-8B shapes: 32k keys x 4915 queries
# 4.4 -> 3.2 ms; gathering them through kv_rows in the kernel is the slower part).
PREROTATE_MIN_BLOCKS = 4
PREROTATE_MIN_KEYS = 4096
GATHER_VALUES_MIN_BLOCKS = 16


def pick_blocks(rows: int, head_dim: int, dtype: torch.dtype, interpreting: bool, kv_heads: int = 1,
                sms: int = 132) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for `rows` packed (query, q head) rows per kv head; fixed
    heuristics, no autotune (shapes vary per request, so per-shape tuning would retune all the time).

    bf16/fp16 with head_dim <= 128 (measured on an H200, Llama-8B shapes): 128 x 128 tiles, 8 warps, 3 stages when
    they still make >= 4 programs per SM, else 64 x 64, 4 warps, 3 stages (more programs; also the best for the
    64 question rows with split keys). fp32 (exact dots, no tensor cores) and head_dim > 128 get smaller tiles to
    stay within shared memory."""
    if interpreting:
        return max(16, min(32, triton.next_power_of_2(rows))), 16, 1, 1
    if head_dim > 128 or dtype == torch.float32:
        return (16 if rows <= 16 else 32 if rows <= 32 else 64), 32, 4, 2
    if rows <= 32:
        return (16 if rows <= 16 else 32), 64, 4, 3
    if triton.cdiv(rows, 128) * kv_heads >= 4 * sms:
        return 128, 128, 8, 3
    return 64, 64, 4, 3


def pick_splits(programs: int, n: int, block_n: int, device: torch.device, min_tiles: int | None = None) -> int:
    """Key splits so that about two programs per SM are busy, keeping >= `min_tiles` key tiles per split: 8, or 4
    when the programs fill at most an eighth of the SMs (the probe's attention on the 0.5B shape over 2k keys: 14
    programs, 1.21x faster with 8 splits than with 4; on the 8B shape, 32 programs, 4 splits stay the best; H100,
    `benchmarks/probe_kernels.py`)."""
    if device.type != "cuda":
        return 1
    sms = sm_count(device)
    if min_tiles is None:
        min_tiles = 4 if programs * 8 <= sms else 8
    want = (2 * sms) // max(programs, 1)
    return max(1, min(want, n // (min_tiles * block_n), 16))


def plan(m: int, hq: int, hkv: int, n: int, head_dim: int, dtype: torch.dtype, device: torch.device, *,
         block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
         num_stages: int | None = None, num_splits: int | None = None, prerotate: bool | None = None,
         gather_values: bool | None = None, rope: bool = True) -> dict:
    """The launch configuration `launch` uses (overrides win): blocks, warps, stages, key splits, up-front RoPE
    and value gather."""
    group = hq // hkv
    sms = sm_count(device) if device.type == "cuda" else 132
    bm, bn, warps, stages = pick_blocks(m * group, head_dim, dtype, emulate_rne(), hkv, sms)
    bm, bn = block_m or bm, block_n or bn
    blocks = triton.cdiv(m * group, bm)
    if prerotate is None:
        prerotate = blocks >= PREROTATE_MIN_BLOCKS and (n >= PREROTATE_MIN_KEYS or blocks >= GATHER_VALUES_MIN_BLOCKS)
    prerotate = bool(prerotate and rope)
    if gather_values is None:
        gather_values = prerotate and blocks >= GATHER_VALUES_MIN_BLOCKS
    return dict(block_m=bm, block_n=bn, num_warps=num_warps or warps, num_stages=num_stages or stages,
                splits=num_splits or pick_splits(blocks * hkv, n, bn, device), blocks=blocks,
                prerotate=prerotate, gather_values=bool(gather_values))


def launch(q, q_pos, k, v, kv_rows, kv_pos, cos, sin, scale, *, stats: bool = False, **overrides):
    """Runs the kernel on validated inputs. Block sizes, warps, stages, key splits and the up-front rotation may
    be overridden (tests, benchmarks): block_m, block_n, num_warps, num_stages, num_splits, prerotate.

    With `stats`, returns (out, ml) instead: ml [1, M, Hq, 2] fp32, the softmax's max (log2 domain: scores times
    scale x log2(e)) and its sum of exp2 of the scores less it, per query and q head (merged over the key splits
    by the merge kernel); a query that saw no key holds (-1e30, 0). `attn_scores.launch(stats=ml)` normalises by
    them instead of recomputing them."""
    q, k, v, cos, sin = (unit_last_stride(t) for t in (q, k, v, cos, sin))
    m, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    n = key_count(k, kv_rows, kv_pos)
    out = torch.empty((m, hq, d), dtype=q.dtype, device=q.device)
    if m == 0 or n == 0:
        out = out.zero_()
        return (out, torch.zeros((1, m, hq, 2), dtype=torch.float32, device=q.device)) if stats else out
    interpreting = emulate_rne()
    rope = cos is not None
    cfg = plan(m, hq, hkv, n, d, q.dtype, q.device, rope=rope, **overrides)
    bm, bn, blocks, splits, prerotate = cfg["block_m"], cfg["block_n"], cfg["blocks"], cfg["splits"], cfg["prerotate"]
    q_pos = q_pos.contiguous()
    by_index = kv_pos is None
    kv_pos = q_pos if by_index else kv_pos.contiguous()  # placeholder pointer when positions are indices
    keys, s_kr, s_kh = k, k.stride(0), k.stride(1)
    if prerotate:
        keys = gather_rotated(k, kv_rows, positions(k, kv_rows, None) if by_index else kv_pos, cos, sin)  # [Hkv, N, D]
        s_kr, s_kh = keys.stride(1), keys.stride(0)
    if cfg["gather_values"] and kv_rows is not None and prerotate:
        v = torch.index_select(v, 0, kv_rows)                               # [N, Hkv, D]: rows 0..N-1
        kv_rows = None
    rows = kv_rows.contiguous() if kv_rows is not None else kv_pos  # placeholder pointer when HAS_ROWS is off
    cos_t = cos if rope else k
    sin_t = sin if rope else k
    hp = half_pad(d)
    if splits > 1:
        part_acc = torch.empty((splits, m, hq, 2 * hp), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((splits, m, hq, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = out                                             # unused placeholder
        part_ml = torch.empty((1, m, hq, 2), dtype=torch.float32, device=q.device) if stats else out
    _attn_fwd_kernel[(blocks, hkv, splits)](
        q, q_pos, keys, v, rows, kv_pos, cos_t, sin_t, out, part_acc, part_ml,
        m, n, float(scale) * LOG2E, search_steps(n),
        q.stride(0), q.stride(1), s_kr, s_kh, v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), cos_t.stride(0), sin_t.stride(0),
        GROUP=group, HALF=d // 2, HALF_PAD=hp, BLOCK_M=bm, BLOCK_N=bn, SPLITS=splits, SORT_BLOCK=sort_block(n),
        HAS_ROWS=kv_rows is not None, K_GATHER=not prerotate, ROPE=rope and not prerotate,
        DOT_F32=dot_in_fp32(q.dtype), PRECISION=dot_precision(q.dtype), EMULATE_RNE=interpreting,
        POS_IS_INDEX=by_index, STORE_ML=stats, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if splits > 1:
        merge_bm = min(32, triton.next_power_of_2(m))
        merged = torch.empty((1, m, hq, 2), dtype=torch.float32, device=q.device) if stats else out
        _attn_merge_kernel[(triton.cdiv(m, merge_bm), hq)](
            part_acc, part_ml, out, merged, m, out.stride(0), out.stride(1),
            SPLITS=splits, HALF=d // 2, HALF_PAD=hp, BLOCK_M=merge_bm, EMULATE_RNE=interpreting, STORE_ML=stats,
            num_warps=4)
        part_ml = merged
    return (out, part_ml) if stats else out
