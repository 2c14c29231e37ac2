"""Fused gate|up GEMM + SiLU-and-multiply for the prefill MLP of LLaMA/Qwen-style models.

    out = silu(x @ Wg.T) * (x @ Wu.T),   w_gu = cat([Wg, Wu]) of shape [2F, H],  x [T, H],  out [T, F]

One program (or one persistent program per tile) computes a [BM, BN] output tile with two fp32
accumulators: acc_g over rows [n*BN, n*BN + BN) of w_gu and acc_u over rows [F + n*BN, ...). Both
share the x tile. The [T, 2F] intermediate that "GEMM then silu_mul" writes and re-reads never
reaches memory.

Rounding follows transformers (bf16 gate and up from separate GEMMs, then ``F.silu(g) * u``):
g and u are rounded to the storage dtype, silu(g) is computed in fp32 and rounded, the product is
computed in fp32 and rounded once.

Two kernels:
  * ``_gateup_silu_kernel``: plain pointers, one program per tile, grouped (swizzled) tile order.
  * ``_gateup_silu_tma_kernel``: host-side TMA tensor descriptors (Hopper+), persistent grid of
    CTAS_PER_SM programs per SM walking the tiles in the same grouped order, optionally with the
    tile loop flattened (next tile's loads overlap this tile's epilogue) or warp-specialized.
    Out-of-bounds reads are zero-filled and out-of-bounds stores clipped by the copy engine.

Under TRITON_INTERPRET=1 (CPU, tests) tl.dot operands are cast to fp32 (the interpreter's bf16 dot
is wrong) and fp32->bf16 casts are rounded to nearest even explicitly (the interpreter truncates).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvfuse.kernels._triton.common import round_to  # fp32 -> dt rounded to nearest even, as torch
from kvfuse.kernels.dispatch import triton_interpreting as _interpreting

try:  # host-side TMA descriptors (triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - old triton
    TensorDescriptor = None

try:  # accurate expf (the one torch's CUDA silu uses); the interpreter has no libdevice
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    libdevice = None


# --------------------------------------------------------------------------------------------
# Configs. BN is the width of each half (gate and up): a program multiplies a [BM, BK] x tile by
# two [BN, BK] weight tiles, i.e. a [BM, 2*BN] GEMM tile. Shared memory per stage:
# (BM + 2*BN) * BK * 2 bytes (48 KiB for 128/128/64); the TMA kernel adds a [BM, BN] output
# buffer, so 128/128/64 fits 4 stages in Hopper's 227 KiB per block (224 KiB, tight).
# Registers: two [BM, BN] fp32 accumulators are 2*BM*BN/(32*num_warps) registers per thread
# (128 for 128/128 at 8 warps): these configs run at ~255 registers/thread without spills.
# --------------------------------------------------------------------------------------------
def _cfg(name, TMA, BM, BN, BK, num_warps, num_stages, GROUP_M=8, **extra):
    return dict(name=name, TMA=TMA, BM=BM, BN=BN, BK=BK, GROUP_M=GROUP_M, num_warps=num_warps,
                num_stages=num_stages, **extra)


# Persistent TMA kernel options: FLATTEN (overlap the next tile's loads with this tile's epilogue;
# compiled with triton 3.9 for sm_90a, ptxas warns that it serializes the wgmma, C7515),
# WARP_SPECIALIZE (producer/consumer warps), CTAS_PER_SM (persistent programs per SM, so one
# program's epilogue overlaps another's main loop; 2 fit with 128/64/64 and 3 stages: 112 KiB
# shared memory and 32K registers each). Which is fastest on H200 + triton 3.6 is for
# bench_gateup_silu.py to say: none of these has been timed yet.
CONFIGS: list[dict] = [
    _cfg("tma_p_128x128x64_w8_s3", True, 128, 128, 64, 8, 3),
    _cfg("tma_p_128x128x64_w8_s4", True, 128, 128, 64, 8, 4),
    _cfg("tma_pf_128x128x64_w8_s3", True, 128, 128, 64, 8, 3, FLATTEN=True),
    _cfg("tma_pws_128x128x64_w8_s3", True, 128, 128, 64, 8, 3, WARP_SPECIALIZE=True),
    _cfg("tma_p2_128x64x64_w4_s3", True, 128, 64, 64, 4, 3, CTAS_PER_SM=2),
    _cfg("tma_p2_128x64x64_w8_s3", True, 128, 64, 64, 8, 3, CTAS_PER_SM=2),
    _cfg("ptr_128x128x64_w8_s3", False, 128, 128, 64, 8, 3),
    _cfg("ptr_128x128x64_w8_s4", False, 128, 128, 64, 8, 4),
    _cfg("ptr_128x64x64_w4_s3", False, 128, 64, 64, 4, 3),
]
# Default: persistent TMA, 128x(2x128)x64 tile, 3 stages (compiles without ptxas warnings; not yet
# timed against the others). Keys absent from a config take these values.
DEFAULT_CONFIG: dict = dict(CONFIGS[0], FLATTEN=False, WARP_SPECIALIZE=False, CTAS_PER_SM=1, NUM_SMS=None)
_CONFIG_KEYS = set(DEFAULT_CONFIG)


# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def _silu_mul_epilogue(acc_g, acc_u, dt: tl.constexpr, EMULATE_RNE: tl.constexpr, PRECISE: tl.constexpr):
    """round(round(silu(round(g))) * round(u)), every op in fp32, every rounding to dt (as torch)."""
    g = round_to(acc_g, dt, EMULATE_RNE).to(tl.float32)
    u = round_to(acc_u, dt, EMULATE_RNE).to(tl.float32)
    if PRECISE:   # torch: x / (1 + expf(-x)) with an IEEE division
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    a = round_to(tl.math.div_rn(g, 1.0 + e), dt, EMULATE_RNE).to(tl.float32)
    return round_to(a * u, dt, EMULATE_RNE)


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row blocks sweep all column blocks together (x and w tiles reused in L2)."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_m
    pid_n = (tile % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    if DOT_FP32:  # interpreter, or fp32 inputs: exact fp32 products
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


# --------------------------------------------------------------------------------------------
# Kernel 1: plain pointers, one program per output tile
# --------------------------------------------------------------------------------------------
@triton.jit
def _gateup_silu_kernel(X, W, OUT, T, FDIM, H, s_x, s_w, s_o,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                        EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, EMULATE_RNE: tl.constexpr,
                        PRECISE: tl.constexpr):
    num_m = tl.cdiv(T, BM)
    num_n = tl.cdiv(FDIM, BN)
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_m, num_n, GROUP_M)

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    # Out-of-range rows are redirected to row 0 (valid memory, results discarded by the store mask),
    # so the loads need no row mask.
    rows_x = tl.max_contiguous(tl.multiple_of(tl.where(offs_m < T, offs_m, 0), BM), BM)
    rows_g = tl.max_contiguous(tl.multiple_of(tl.where(offs_n < FDIM, offs_n, 0), BN), BN)
    offs_k = tl.arange(0, BK)
    x_ptrs = X + rows_x.to(tl.int64)[:, None] * s_x + offs_k[None, :]          # [BM, BK]
    g_ptrs = W + rows_g.to(tl.int64)[:, None] * s_w + offs_k[None, :]          # [BN, BK]
    u_ptrs = W + (rows_g + FDIM).to(tl.int64)[:, None] * s_w + offs_k[None, :]  # up rows: F + n

    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BK)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            bg = tl.load(g_ptrs)
            bu = tl.load(u_ptrs)
        else:
            k_ok = (offs_k < H - k * BK)[None, :]
            a = tl.load(x_ptrs, mask=k_ok, other=0.0)
            bg = tl.load(g_ptrs, mask=k_ok, other=0.0)
            bu = tl.load(u_ptrs, mask=k_ok, other=0.0)
        acc_g = _dot(a, bg.T, acc_g, DOT_FP32)
        acc_u = _dot(a, bu.T, acc_u, DOT_FP32)
        x_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK

    out = _silu_mul_epilogue(acc_g, acc_u, OUT.dtype.element_ty, EMULATE_RNE, PRECISE)
    o_ptrs = OUT + offs_m.to(tl.int64)[:, None] * s_o + offs_n[None, :]
    tl.store(o_ptrs, out, mask=(offs_m < T)[:, None] & (offs_n < FDIM)[None, :])


# --------------------------------------------------------------------------------------------
# Kernel 2: TMA descriptors, persistent grid
# --------------------------------------------------------------------------------------------
@triton.jit
def _gateup_silu_tma_kernel(x_desc, w_desc, o_desc, T, FDIM, H,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                            NUM_PROGS: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                            DOT_FP32: tl.constexpr, EMULATE_RNE: tl.constexpr, PRECISE: tl.constexpr):
    num_m = tl.cdiv(T, BM)
    num_n = tl.cdiv(FDIM, BN)
    num_tiles = num_m * num_n
    k_tiles = tl.cdiv(H, BK)
    start = tl.program_id(0)
    # The epilogue recomputes its tile's coordinates from its own counter (as triton's persistent
    # matmul tutorial does), which keeps a flattened pipeline simple.
    tile_c = start - NUM_PROGS
    for tile in tl.range(start, num_tiles, NUM_PROGS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BK
            a = x_desc.load([off_m, off_k])
            # Past F the gate tile runs into up rows and the up tile into zero fill: those output
            # columns are clipped by the store.
            bg = w_desc.load([off_n, off_k])
            bu = w_desc.load([FDIM + off_n, off_k])
            acc_g = _dot(a, bg.T, acc_g, DOT_FP32)
            acc_u = _dot(a, bu.T, acc_u, DOT_FP32)
        tile_c += NUM_PROGS
        pid_m, pid_n = _tile_coords(tile_c, num_m, num_n, GROUP_M)
        out = _silu_mul_epilogue(acc_g, acc_u, o_desc.dtype, EMULATE_RNE, PRECISE)
        o_desc.store([pid_m * BM, pid_n * BN], out)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_inputs(x: torch.Tensor, w_gu: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(w_gu, torch.Tensor):
        raise ValueError("x and w_gu must be torch tensors")
    if x.dim() != 2 or w_gu.dim() != 2:
        raise ValueError(f"expected x [T, H] and w_gu [2F, H], got shapes {tuple(x.shape)} and {tuple(w_gu.shape)}")
    if x.shape[1] != w_gu.shape[1]:
        raise ValueError(f"hidden size mismatch: x has H={x.shape[1]}, w_gu has H={w_gu.shape[1]}")
    if w_gu.shape[0] % 2:
        raise ValueError(f"w_gu must hold gate and up rows (2F rows), got an odd row count {w_gu.shape[0]}")
    if x.device != w_gu.device:
        raise ValueError(f"x is on {x.device} but w_gu on {w_gu.device}")
    if x.device.type != "cuda" and not _interpreting():
        raise ValueError(f"gateup_silu_triton needs CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
    if x.dtype != w_gu.dtype:
        raise ValueError(f"dtype mismatch: x is {x.dtype}, w_gu is {w_gu.dtype}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}; expected one of {_DTYPES}")
    if not x.is_contiguous() or not w_gu.is_contiguous():
        raise ValueError("x and w_gu must be contiguous (row-major)")


def _resolve_config(config: dict | None) -> dict:
    cfg = dict(DEFAULT_CONFIG)
    if config:
        unknown = set(config) - _CONFIG_KEYS
        if unknown:
            raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(_CONFIG_KEYS)}")
        cfg.update(config)
    for key in ("BM", "BN", "BK"):
        v = cfg[key]
        if v < 16 or v & (v - 1):
            raise ValueError(f"config {key}={v} must be a power of two >= 16")
    return cfg


def _tma_usable(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base addresses and row strides (so H % 8 == 0 and F % 8 == 0 in bf16)."""
    if TensorDescriptor is None:
        return False
    if not _interpreting() and torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def gateup_silu_triton(x: torch.Tensor, w_gu: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """silu(x @ w_gu[:F].T) * (x @ w_gu[F:].T) in one kernel. x [T, H], w_gu [2F, H] -> [T, F].

    config: a dict from CONFIGS (or a partial dict overriding DEFAULT_CONFIG). A TMA config falls
    back to the pointer kernel when TMA cannot be used (pre-Hopper GPU, misaligned rows).
    """
    _check_inputs(x, w_gu)
    cfg = _resolve_config(config)
    T, H = x.shape
    Fdim = w_gu.shape[0] // 2
    out = torch.empty((T, Fdim), dtype=x.dtype, device=x.device)
    if T == 0 or Fdim == 0:
        return out
    if H == 0:  # empty sum: g = u = 0, silu(0) * 0 = 0
        return out.zero_()

    interp = _interpreting()
    common = dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"],
                  DOT_FP32=interp or x.dtype == torch.float32,
                  EMULATE_RNE=interp, PRECISE=(not interp) and libdevice is not None,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    num_tiles = triton.cdiv(T, cfg["BM"]) * triton.cdiv(Fdim, cfg["BN"])
    if x.device.type == "cuda":
        with torch.cuda.device(x.device):  # triton launches on the current device
            _launch(x, w_gu, out, cfg, common, num_tiles)
    else:
        _launch(x, w_gu, out, cfg, common, num_tiles)
    return out


def _launch(x, w_gu, out, cfg, common, num_tiles):
    T, H = x.shape
    Fdim = out.shape[1]
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    if cfg["TMA"] and _tma_usable(x, w_gu, out):
        x_desc = TensorDescriptor.from_tensor(x, [BM, BK])
        w_desc = TensorDescriptor.from_tensor(w_gu, [BN, BK])
        o_desc = TensorDescriptor.from_tensor(out, [BM, BN])
        n_prog = min((cfg["NUM_SMS"] or _num_sms(x.device)) * cfg["CTAS_PER_SM"], num_tiles)
        _gateup_silu_tma_kernel[(n_prog,)](x_desc, w_desc, o_desc, T, Fdim, H, NUM_PROGS=n_prog,
                                           FLATTEN=cfg["FLATTEN"], WARP_SPECIALIZE=cfg["WARP_SPECIALIZE"], **common)
    else:
        _gateup_silu_kernel[(num_tiles,)](x, w_gu, out, T, Fdim, H, x.stride(0), w_gu.stride(0), out.stride(0),
                                          EVEN_K=H % BK == 0, **common)


def gateup_silu_reference(x: torch.Tensor, w_gu: torch.Tensor) -> torch.Tensor:
    """transformers' MLP activation: F.silu(gate) * up from one packed GEMM.

    With bf16 tensors F.silu computes in fp32 and rounds once, and bf16 * bf16 multiplies in fp32 and
    rounds once, i.e. ``(F.silu(g.float()).to(bf16).float() * u.float()).to(bf16)``.
    """
    g, u = F.linear(x, w_gu).chunk(2, dim=-1)
    return F.silu(g) * u
