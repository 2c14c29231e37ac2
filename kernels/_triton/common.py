"""Helpers shared by the triton kernels: launch-side choices and the rotate-on-load of K rows."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import triton_interpreting

LOG2E = 1.4426950408889634
# A position later than any real one: padding keys carry it, so no query ever sees them.
FAR_POSITION = tl.constexpr(2**62)


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether tl.dot operands are cast to fp32: always in the interpreter (its bf16 dot is wrong), and for
    fp32 inputs (then computed with ``input_precision="ieee"``, not tf32)."""
    return triton_interpreting() or dtype == torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact ("ieee") whenever the operands are fp32; for fp16/bf16 operands it does not
    apply (tensor cores multiply them exactly)."""
    return "ieee" if dot_in_fp32(dtype) else "tf32"


def half_pad(head_dim: int) -> int:
    """Padded width of one rotary half (a power of two, at least 16 so tl.dot accepts it on GPU)."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for the triton kernels, got {head_dim}")
    return max(16, triton.next_power_of_2(head_dim // 2))


def emulate_rne() -> bool:
    """The interpreter truncates fp32 -> bf16 casts; GPUs round to nearest even. Kernels emulate the latter
    when interpreting so both paths round like torch."""
    return triton_interpreting()


def unit_last_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels address the last dimension with unit stride: returns t, or a contiguous copy if it is not."""
    return t if t is None or t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


@triton.jit
def round_to(x, dt: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """Casts fp32 `x` to `dt`, rounding to nearest even (made explicit for bf16 when EMULATE_RNE)."""
    if EMULATE_RNE:
        if dt == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dt)


@triton.jit
def add_rn(a, b, EMULATE_RNE: tl.constexpr):
    """fp32 ``a + b`` rounded once, never fused with the multiplications that produced a or b.

    On the GPU the compiler shrinks ``round(x * c)`` to a half-precision multiply and then contracts it with the
    following add into one fused multiply-add (one rounding where torch rounds twice): the add is therefore
    written as PTX ``add.rn.f32``, which neither LLVM nor ptxas fuse. The interpreter adds in numpy: no fusion.
    """
    if EMULATE_RNE:
        return a + b
    else:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _table(ptr, mask, dt: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """Loads a cos/sin tile, rounds it to the rotated tensor's dtype (as HF casts the tables), returns fp32."""
    return round_to(tl.load(ptr, mask=mask, other=0.0).to(tl.float32), dt, EMULATE_RNE).to(tl.float32)


@triton.jit
def tile_mask(row_ok, offs, WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr):
    """Load mask of a [rows, WIDTH_PAD] tile: the row mask alone when no column is padding."""
    if WIDTH == WIDTH_PAD:
        return row_ok[:, None]
    else:
        return row_ok[:, None] & (offs < WIDTH)[None, :]


@triton.jit
def rope_halves(x1, x2, c, s, EMULATE_RNE: tl.constexpr):
    """Rotate-half RoPE of the two halves x1, x2 (storage dtype) with fp32 tables c, s already rounded to that
    dtype: ``(x1 c - x2 s, x2 c + x1 s)``, each product and each sum rounded to the storage dtype as torch does
    (HF's ``x * cos + rotate_half(x) * sin``), so the result is torch's bit for bit."""
    dt = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    if dt == tl.float32:
        # fp32 storage: torch rounds each product and the sum to fp32; only the fusion has to be prevented
        y1 = add_rn(f1 * c, -f2 * s, EMULATE_RNE)
        y2 = add_rn(f2 * c, f1 * s, EMULATE_RNE)
    else:
        y1 = add_rn(round_to(f1 * c, dt, EMULATE_RNE).to(tl.float32),
                    round_to(-f2 * s, dt, EMULATE_RNE).to(tl.float32), EMULATE_RNE)
        y2 = add_rn(round_to(f2 * c, dt, EMULATE_RNE).to(tl.float32),
                    round_to(f1 * s, dt, EMULATE_RNE).to(tl.float32), EMULATE_RNE)
    return round_to(y1, dt, EMULATE_RNE), round_to(y2, dt, EMULATE_RNE)


@triton.jit
def load_halves_rotated(base, rows, pos, n_ok, stride_row, cos_ptr, sin_ptr, stride_cos, stride_sin,
                        HALF: tl.constexpr, HALF_PAD: tl.constexpr, ROPE: tl.constexpr,
                        EMULATE_RNE: tl.constexpr):
    """Loads rows of one head as two halves [BLOCK, HALF_PAD], rotated at `pos` when ROPE.

    Hugging Face convention: ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)`` and
    cos/sin cast to x's dtype. Each product and the sum are rounded to x's dtype, as torch does in that dtype,
    with no fused multiply-add (see `add_rn`), so the result equals the torch reference bit for bit.
    Only the first half of each cos/sin row is read: HF's tables hold the same angles in both halves.
    """
    offs_h = tl.arange(0, HALF_PAD)
    mask = tile_mask(n_ok, offs_h, HALF, HALF_PAD)
    ptr = base + rows[:, None] * stride_row + offs_h[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
    if ROPE:
        dt = x1.dtype
        c = _table(cos_ptr + pos[:, None] * stride_cos + offs_h[None, :], mask, dt, EMULATE_RNE)
        s = _table(sin_ptr + pos[:, None] * stride_sin + offs_h[None, :], mask, dt, EMULATE_RNE)
        x1, x2 = rope_halves(x1, x2, c, s, EMULATE_RNE)
    return x1, x2


@triton.jit
def _is_sorted(KPOS, N, BLOCK: tl.constexpr):
    """True when kv_pos is non-decreasing (scanned in the kernel: no extra launch, no host sync)."""
    offs = tl.arange(0, BLOCK)
    descents = tl.zeros([BLOCK], tl.int32)
    for n0 in range(0, N - 1, BLOCK):
        i = n0 + offs
        ok = i < N - 1
        a = tl.load(KPOS + i, mask=ok, other=0)
        b = tl.load(KPOS + i + 1, mask=ok, other=0)
        descents += (b < a).to(tl.int32)
    return tl.sum(descents, 0) == 0


@triton.jit
def _first_after(KPOS, N, qpos, SEARCH_STEPS):
    """First index of sorted kv_pos whose position is > qpos (binary search)."""
    lo = tl.full([], 0, tl.int32)                     # tensors, not constexprs (triton specializes N == 1)
    hi = tl.full([], 0, tl.int32) + N
    for _ in range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        key = tl.load(KPOS + mid, mask=active & (mid < N), other=0)
        right = key <= qpos
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & (key > qpos), mid, hi)
    return lo


@triton.jit
def visible_key_end(KPOS, N, qmax, SEARCH_STEPS, BLOCK: tl.constexpr):
    """How many leading keys a block of queries (largest position `qmax`) must scan.

    When kv_pos is sorted, the keys after the last one <= qmax are in the future of every query of the block, so
    the scan stops there (binary search); when it is not sorted, all N keys are scanned. Both checks run in the
    kernel: no extra launch, no host sync. SEARCH_STEPS >= ceil(log2(N + 1)).
    """
    return tl.where(_is_sorted(KPOS, N, BLOCK), _first_after(KPOS, N, qmax, SEARCH_STEPS), N)


@triton.jit
def key_bounds(KPOS, N, qmin, qmax, SEARCH_STEPS, BLOCK: tl.constexpr):
    """(n_full, n_end) for a block of queries with positions in [qmin, qmax]: keys [0, n_full) are visible to
    every query of the block (no mask needed), keys [n_end, N) to none (not scanned). Sorted kv_pos: two binary
    searches; otherwise (0, N)."""
    ok = _is_sorted(KPOS, N, BLOCK)
    lo_a = tl.full([], 0, tl.int32)                   # the two searches interleaved: one chain of dependent loads
    hi_a = tl.full([], 0, tl.int32) + N
    lo_b = tl.full([], 0, tl.int32)
    hi_b = tl.full([], 0, tl.int32) + N
    for _ in range(SEARCH_STEPS):
        act_a = lo_a < hi_a
        act_b = lo_b < hi_b
        mid_a = (lo_a + hi_a) // 2
        mid_b = (lo_b + hi_b) // 2
        key_a = tl.load(KPOS + mid_a, mask=act_a & (mid_a < N), other=0)
        key_b = tl.load(KPOS + mid_b, mask=act_b & (mid_b < N), other=0)
        lo_a = tl.where(act_a & (key_a <= qmin), mid_a + 1, lo_a)
        hi_a = tl.where(act_a & (key_a > qmin), mid_a, hi_a)
        lo_b = tl.where(act_b & (key_b <= qmax), mid_b + 1, lo_b)
        hi_b = tl.where(act_b & (key_b > qmax), mid_b, hi_b)
    return tl.where(ok, lo_a, 0), tl.where(ok, lo_b, N)


def search_steps(n: int) -> int:
    """Binary-search iterations that cover n keys."""
    return max(1, int(n).bit_length())


def sort_block(n: int) -> int:
    """Width of the in-kernel sortedness check of kv_pos."""
    return max(16, min(1024, triton.next_power_of_2(max(n, 1))))
