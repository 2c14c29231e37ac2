"""Every triton kernel compiles for a Hopper GPU (sm_90) down to a cubin, without a GPU.

The interpreter runs the kernels' logic on CPU but accepts code that the GPU compiler rejects (globals that are
not constexpr, loop-carried type changes, unsupported dot shapes); this catches those on any machine. It runs in
a subprocess because this test session has the interpreter switched on.
"""
from __future__ import annotations

import pytest

from kernel_cases import can_compile_for_nvidia, run_compile_script

_SCRIPT = r"""
import os
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvfuse.kernels._triton import attention, attn_scores, deviation, drift, rope, scatter

def build(fn, pointers, constexprs, floats=(), warps=4, stages=2):
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    assert kernel.asm.get("cubin"), fn.__name__

bf, f32, i64 = "*bf16", "*fp32", "*i64"
attn_ptrs = dict(Q=bf, QPOS=i64, K=bf, V=bf, ROWS=i64, KPOS=i64, COS=bf, SIN=bf, OUT=bf, PART_ACC=f32, PART_ML=f32)
attn_c = dict(GROUP=4, HALF=64, HALF_PAD=64, BLOCK_M=128, BLOCK_N=64, SPLITS=1, SORT_BLOCK=1024, HAS_ROWS=True,
              K_GATHER=True, ROPE=True, DOT_F32=False, PRECISION="tf32", EMULATE_RNE=False, POS_IS_INDEX=False,
              STORE_ML=False)
build(attention._attn_fwd_kernel, attn_ptrs, attn_c, ("qk_scale",), warps=8, stages=3)
build(attention._attn_fwd_kernel, attn_ptrs, dict(attn_c, BLOCK_M=64, POS_IS_INDEX=True, STORE_ML=True), ("qk_scale",),
      warps=4, stages=3)                                              # one split, its softmax statistics stored
build(attention._attn_fwd_kernel, attn_ptrs, dict(attn_c, POS_IS_INDEX=True), ("qk_scale",), warps=8, stages=3)
build(attention._attn_fwd_kernel, attn_ptrs, dict(attn_c, BLOCK_M=64, SPLITS=8, POS_IS_INDEX=True), ("qk_scale",),
      warps=4, stages=3)                                              # positions computed, split keys (the probe)
build(attention._attn_fwd_kernel, attn_ptrs, dict(attn_c, BLOCK_N=128, K_GATHER=False, ROPE=False), ("qk_scale",),
      warps=8, stages=3)                                              # keys rotated up front
build(attention._attn_fwd_kernel, attn_ptrs, dict(attn_c, BLOCK_M=64, K_GATHER=False, ROPE=False, HAS_ROWS=False),
      ("qk_scale",), warps=4, stages=3)                               # keys rotated, values gathered up front
build(attention._attn_fwd_kernel, attn_ptrs, dict(attn_c, BLOCK_M=64, SPLITS=8), ("qk_scale",), warps=4, stages=3)
build(attention._attn_fwd_kernel, attn_ptrs, dict(attn_c, BLOCK_M=16, SPLITS=4, HAS_ROWS=False, ROPE=False),
      ("qk_scale",))
build(attention._attn_fwd_kernel, attn_ptrs, dict(attn_c, GROUP=3, HALF=12, HALF_PAD=16, BLOCK_M=64, SPLITS=4),
      ("qk_scale",))                                                  # padded halves, odd group
fp32_ptrs = {k: (f32 if v == bf else v) for k, v in attn_ptrs.items()}
build(attention._attn_fwd_kernel, fp32_ptrs, dict(attn_c, BLOCK_M=64, BLOCK_N=32, DOT_F32=True, PRECISION="ieee"),
      ("qk_scale",))
for store_ml in (False, True):
    build(attention._attn_merge_kernel, dict(PART_ACC=f32, PART_ML=f32, OUT=bf, ML_OUT=f32),
          dict(SPLITS=4, HALF=64, HALF_PAD=64, BLOCK_M=32, EMULATE_RNE=False, STORE_ML=store_ml))
score_ptrs = dict(Q=bf, QPOS=i64, K=bf, ROWS=i64, KPOS=i64, COS=f32, SIN=f32, MAX_OUT=f32, SUM_OUT=f32, MAX_IN=f32,
                  SUM_IN=f32, OUT=f32)
score_c = dict(GROUP=4, HALF=64, HALF_PAD=64, BLOCK_M=64, BLOCK_N=64, HAS_ROWS=True, ROPE=True, DOT_F32=False,
               PRECISION="tf32", EMULATE_RNE=False, SPLITS=4, POS_IS_INDEX=False)
build(attn_scores._row_stats_kernel, score_ptrs, dict(score_c, SORT_BLOCK=1024), ("qk_scale",))
build(attn_scores._probs_kernel, score_ptrs, score_c, ("qk_scale", "inv_heads"))
build(attn_scores._row_stats_kernel, score_ptrs, dict(score_c, SORT_BLOCK=1024, POS_IS_INDEX=True), ("qk_scale",))
build(attn_scores._probs_kernel, score_ptrs, dict(score_c, POS_IS_INDEX=True), ("qk_scale", "inv_heads"))
build(attn_scores._row_stats_kernel, score_ptrs, dict(score_c, BLOCK_N=128, SPLITS=1, SORT_BLOCK=1024, HAS_ROWS=False,
                                                      ROPE=False), ("qk_scale",))
build(attn_scores._probs_kernel, score_ptrs, dict(score_c, BLOCK_N=128, SPLITS=1, HAS_ROWS=False, ROPE=False),
      ("qk_scale", "inv_heads"))
for gather in (False, True):
    build(rope._rope_kernel, dict(X=bf, ROWS=i64, POS=i64, COS=f32, SIN=f32, OUT=bf),
          dict(HALF=64, HALF_PAD=64, BLOCK_T=32, GATHER=gather, EMULATE_RNE=False))
build(rope._rope_kernel, dict(X="*fp16", ROWS=i64, POS=i64, COS=f32, SIN=f32, OUT="*fp16"),
      dict(HALF=12, HALF_PAD=16, BLOCK_T=32, GATHER=True, EMULATE_RNE=False))
build(scatter._scatter_kernel, dict(DST=bf, ROWS=i64, SRC=bf), dict(BLOCK_H=8, BLOCK_D=128))
build(deviation._deviation_kernel, dict(A=bf, B=bf, OUT=f32), dict(BLOCK_M=4, BLOCK_F=1024))
build(drift._accumulate, dict(K=bf, V=bf, KP=bf, VP=bf, BASE=i64, DOC=i64, TABLE=f32, COUNT=f32),
      dict(BLOCK_H=8, BLOCK_D=128))
build(drift._write, dict(KP=bf, VP=bf, BASE=i64, DOC=i64, DST=i64, TABLE=f32, COUNT=f32), dict(BLOCK_H=8, BLOCK_D=128),
      ("alpha",))
print("ok")
"""


@pytest.mark.skipif(not can_compile_for_nvidia(), reason="needs triton with its NVIDIA backend")
def test_kernels_compile_for_sm90():
    run_compile_script(_SCRIPT)
