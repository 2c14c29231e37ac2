"""Triton block-sparse causal attention of a whole prompt (flash-attention forward over listed key blocks).

Grid (NB * CHUNKS, Hkv): a program owns one query block, one chunk of its packed (query, q head) rows and one kv
head, and reads that query block's list (the kv head's own with lists per KV head). GQA is packed as in
`attention.py`: row r of a block is query ``b * BLOCK_SIZE + r // GROUP`` with q head
``hk * GROUP + r % GROUP``, so each K/V tile is loaded once for all the q heads that read it; a block's
BLOCK_SIZE * GROUP rows are cut in CHUNKS chunks of BLOCK_M rows.

The key loop has two parts, both an online softmax in fp32 (exp2 domain):

- the listed blocks before the diagonal (their count per query block, `n_before`, is computed in torch before the
  launch: no host sync): every key of such a block is earlier than every query of block b and inside the prompt,
  so these tiles are scanned with no mask at all;
- the diagonal block, always (the lists are checked to list it), with the causal mask ``key <= query`` and only
  up to the last query of the chunk. Listed blocks after the diagonal are never read (causality hides them).

Heavy (late) query blocks are launched first. fp16/bf16 use tensor-core dots with fp32 accumulators; fp32 inputs
and the interpreter (whose bf16 dot is wrong) use fp32 dots with ``input_precision="ieee"``. Launch parameters are
fixed heuristics (no autotune: prompt lengths vary per request).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import LOG2E, dot_in_fp32, dot_precision, emulate_rne, round_to, tile_mask, unit_last_stride

# Finite start of the running max: a row that has seen no key yet keeps it, and exp2 of (it - itself) is 1, so no
# inf - inf appears anywhere (masked scores are -inf and give exp2(-inf) = 0).
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _load_rows(ptr, n_ok, offs_d, D: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr):
    """A [BN, D_PAD] tile of K or V rows: masked by `n_ok` when MASKED, else only by the head_dim padding."""
    if MASKED:
        x = tl.load(ptr, mask=tile_mask(n_ok, offs_d, D, D_PAD), other=0.0)
    elif D == D_PAD:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=(offs_d < D)[None, :], other=0.0)
    return x


@triton.jit
def _tile(acc, l_i, m_i, q, qi, n0, T, k_base, v_base, s_kt, s_vt, qk_scale,
          D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
          DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """Keys [n0, n0 + BLOCK_N) into the online softmax; MASKED: the causal mask and the end of the prompt."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    rows = offs_n.to(tl.int64)[:, None]
    k = _load_rows(k_base + rows * s_kt + offs_d[None, :], offs_n < T, offs_d, D, D_PAD, MASKED)  # [BN, D_PAD]
    if DOT_F32:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale                  # [BM, BN], log2 domain
    if MASKED:
        s = tl.where(offs_n[None, :] <= qi[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_rows(v_base + rows * s_vt + offs_d[None, :], offs_n < T, offs_d, D, D_PAD, MASKED)  # [BN, D_PAD]
    acc = acc * alpha[:, None]
    if DOT_F32:
        acc = tl.dot(p, v.to(tl.float32), acc=acc, input_precision=PRECISION)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc=acc)
    return acc, l_i, m_new


@triton.jit
def _block_sparse_fwd_kernel(Q, K, V, LISTS, N_BEFORE, OUT, T, qk_scale,
                             s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh, s_lh, s_lb, s_nh,
                             GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNKS: tl.constexpr,
                             D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             DOT_F32: tl.constexpr, PRECISION: tl.constexpr, EMULATE_RNE: tl.constexpr):
    pid = tl.num_programs(0) - 1 - tl.program_id(0)                         # late (heavy) query blocks first
    b = pid // CHUNKS
    chunk = pid % CHUNKS
    hk = tl.program_id(1)
    offs_r = chunk * BLOCK_M + tl.arange(0, BLOCK_M)                        # packed (query, head of the group)
    qi = b * BLOCK_SIZE + offs_r // GROUP
    r_ok = (offs_r < BLOCK_SIZE * GROUP) & (qi < T)
    h = hk * GROUP + offs_r % GROUP
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    q_ptr = Q + qi[:, None].to(tl.int64) * s_qt + h[:, None] * s_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=tile_mask(r_ok, offs_d, D, D_PAD), other=0.0)  # [BM, D_PAD]
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    k_base = K + hk * s_kh
    v_base = V + hk * s_vh
    SUBS: tl.constexpr = BLOCK_SIZE // BLOCK_N                              # key tiles per block
    n_tiles = tl.load(N_BEFORE + hk * s_nh + b) * SUBS                      # (s_lh = s_nh = 0: lists shared by heads)
    for j in range(0, n_tiles):                                             # listed blocks before the diagonal
        kb = tl.load(LISTS + hk * s_lh + b * s_lb + j // SUBS).to(tl.int32)
        n0 = kb * BLOCK_SIZE + (j % SUBS) * BLOCK_N
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, qi, n0, T, k_base, v_base, s_kt, s_vt, qk_scale,
                              D, D_PAD, BLOCK_N, False, DOT_F32, PRECISION)
    q_last = tl.max(tl.where(r_ok, qi, -1), 0)                              # the diagonal, up to the last query
    for n0 in range(b * BLOCK_SIZE, q_last + 1, BLOCK_N):
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, qi, n0, T, k_base, v_base, s_kt, s_vt, qk_scale,
                              D, D_PAD, BLOCK_N, True, DOT_F32, PRECISION)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptr = OUT + qi[:, None].to(tl.int64) * s_ot + h[:, None] * s_oh + offs_d[None, :]
    tl.store(o_ptr, round_to(out, OUT.dtype.element_ty, EMULATE_RNE), mask=r_ok[:, None] & d_ok[None, :])


def pick_blocks(rows: int, block_size: int, head_dim: int, dtype: torch.dtype, interpreting: bool
                ) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for `rows` = block_size * GROUP packed rows per query block;
    fixed heuristics (as `attention.pick_blocks`). BLOCK_N divides block_size (both powers of two)."""
    if interpreting:
        return min(64, triton.next_power_of_2(rows)), 16, 1, 1
    if head_dim > 128 or dtype == torch.float32:
        return min(64, triton.next_power_of_2(rows)), min(block_size, 32), 4, 2
    # a whole 64-row block of a GROUP-4 model (256 packed rows) per program: 1.24x over 128-row chunks at the 8B
    # shape, 32k, dense and at density 0.35 (`benchmarks/sift_kernel.py --sweep`, docs/gpu/README.md)
    bm = min(256, triton.next_power_of_2(rows))
    return bm, min(block_size, 64), (8 if bm >= 128 else 4), 3


def plan(t: int, hq: int, hkv: int, block_size: int, head_dim: int, dtype: torch.dtype, *,
         block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
         num_stages: int | None = None) -> dict:
    """The launch configuration `launch` uses (overrides win)."""
    rows = block_size * (hq // hkv)
    bm, bn, warps, stages = pick_blocks(rows, block_size, head_dim, dtype, emulate_rne())
    bm, bn = block_m or bm, block_n or bn
    for name, x in (("block_m", bm), ("block_n", bn)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {x}")
    if bn > block_size:
        raise ValueError(f"block_n ({bn}) must divide block_size ({block_size})")
    return dict(block_m=bm, block_n=bn, num_warps=num_warps or warps, num_stages=num_stages or stages,
                chunks=triton.cdiv(rows, bm), n_blocks=triton.cdiv(t, block_size))


def launch(q, k, v, block_lists, block_counts, block_size, scale, **overrides):
    """Runs the kernel on validated inputs (see `block_sparse.check_inputs`)."""
    q, k, v = (unit_last_stride(x) for x in (q, k, v))
    t, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0 or hq == 0 or d == 0:
        return out
    cfg = plan(t, hq, hkv, block_size, d, q.dtype, **overrides)
    nb = cfg["n_blocks"]
    lists = block_lists.contiguous()
    per_head = lists.dim() == 3
    m = lists.shape[-1]
    idx = torch.arange(nb, device=q.device)
    valid = torch.arange(m, device=q.device) < block_counts.long()[..., None]
    n_before = (valid & (lists.long() < idx[:, None])).sum(-1, dtype=torch.int32)  # listed blocks before b
    _block_sparse_fwd_kernel[(nb * cfg["chunks"], hkv)](
        q, k, v, lists, n_before, out, t, float(scale) * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lists.stride(0) if per_head else 0, lists.stride(-2), n_before.stride(0) if per_head else 0,
        GROUP=hq // hkv, BLOCK_SIZE=block_size, CHUNKS=cfg["chunks"], D=d, D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], DOT_F32=dot_in_fp32(q.dtype),
        PRECISION=dot_precision(q.dtype), EMULATE_RNE=emulate_rne(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
