"""block_sparse_attention: the torch reference against plain causal attention (dense lists) and against masked
softmax attention built by hand in float64 (sparse lists), the Triton kernel (interpreter on CPU) against both,
and the input checks."""
from __future__ import annotations

import pytest
import torch

from kvfuse.kernels.block_sparse import (block_sparse_attention, block_sparse_attention_reference,
                                         dense_block_lists, mask_from_block_lists)
from kvfuse.kernels.causal import causal_attention

from kernel_cases import assert_rule, can_compile_for_nvidia, run_compile_script


def _qkv(t, hq, hkv, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    return q, k, v


def _sparse_lists(n_blocks, seed=0, keep=0.5, future=False, pad=7, dtype=torch.int64):
    """Random lists: each earlier block kept with probability `keep` (never block 0 for the last block), the
    diagonal always; `future` also lists some later blocks (causality hides them); rows padded to a common width
    with garbage values that must never be read (-5 and 10**6, alternately)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(n_blocks):
        chosen = [kb for kb in range(b) if torch.rand((), generator=g).item() < keep] + [b]
        if b == n_blocks - 1 and b > 0 and chosen[0] == 0:
            chosen = chosen[1:]                             # the last block never sees block 0: really sparse
        if future:
            chosen += [kb for kb in range(b + 1, n_blocks) if torch.rand((), generator=g).item() < keep]
        rows.append(chosen)
    width = max(len(r) for r in rows) + pad
    lists = torch.tensor([r + [(-5 if i % 2 else 10**6) for i in range(width - len(r))] for r in rows], dtype=dtype)
    counts = torch.tensor([len(r) for r in rows], dtype=dtype)
    return lists, counts


def _mask_by_hand(lists, counts, block_size, t):
    """[T, T] bool built row by row from the lists, independently of `mask_from_block_lists`."""
    mask = torch.zeros(t, t, dtype=torch.bool)
    for b in range(lists.shape[0]):
        for kb in lists[b, :int(counts[b])].tolist():
            for i in range(b * block_size, min((b + 1) * block_size, t)):
                mask[i, kb * block_size:min((kb + 1) * block_size, i + 1)] = True
    return mask


def _attention64(q, k, v, mask, scale):
    """Masked softmax attention with plain matmuls in float64 ([T, Hq, D])."""
    group = q.shape[1] // k.shape[1]
    qd = q.cpu().double().transpose(0, 1)                                        # [Hq, T, D]
    kd = k.cpu().double().repeat_interleave(group, dim=1).transpose(0, 1)
    vd = v.cpu().double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qd @ kd.transpose(1, 2)) * scale
    mask = mask.cpu()[None] if mask.dim() == 2 else mask.cpu().repeat_interleave(group, dim=0)  # per KV head
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vd).transpose(0, 1)


def _n_blocks(t, block_size):
    return -(-t // block_size)


def test_dense_block_lists():
    lists, counts = dense_block_lists(4)
    assert lists.dtype == counts.dtype == torch.int32
    assert counts.tolist() == [1, 2, 3, 4]
    for b in range(4):
        assert lists[b, :b + 1].tolist() == list(range(b + 1))
    assert dense_block_lists(0)[0].shape == (0, 0)


@pytest.mark.parametrize("t,block_size", [(37, 16), (100, 16), (64, 32), (5, 16)])
def test_mask_from_block_lists_matches_hand_built(t, block_size):
    nb = _n_blocks(t, block_size)
    dense = mask_from_block_lists(*dense_block_lists(nb), block_size, t)
    assert torch.equal(dense, torch.ones(t, t, dtype=torch.bool).tril())
    for seed in range(3):
        lists, counts = _sparse_lists(nb, seed=seed, future=seed == 2)
        got = mask_from_block_lists(lists, counts, block_size, t)
        assert torch.equal(got, _mask_by_hand(lists, counts, block_size, t))


@pytest.mark.parametrize("t,hq,hkv,d,block_size", [(37, 4, 2, 16, 16), (100, 4, 2, 32, 16), (100, 4, 4, 16, 32),
                                                   (37, 6, 2, 32, 8)])
def test_reference_dense_lists_equal_causal_attention(t, hq, hkv, d, block_size):
    q, k, v = _qkv(t, hq, hkv, d, seed=t)
    lists, counts = dense_block_lists(_n_blocks(t, block_size))
    got = block_sparse_attention_reference(q, k, v, lists, counts, block_size, 0.25)
    assert got.shape == (t, hq, d) and got.dtype == q.dtype
    torch.testing.assert_close(got, causal_attention(q, k, v, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,hq,hkv,d,block_size,seed", [(37, 4, 2, 16, 16, 0), (100, 4, 2, 32, 16, 1),
                                                        (100, 6, 3, 16, 8, 2), (70, 2, 2, 16, 32, 3)])
def test_reference_sparse_lists_equal_float64_masked_attention(t, hq, hkv, d, block_size, seed):
    q, k, v = _qkv(t, hq, hkv, d, seed=seed)
    lists, counts = _sparse_lists(_n_blocks(t, block_size), seed=seed, future=seed == 2)
    truth = _attention64(q, k, v, _mask_by_hand(lists, counts, block_size, t), 0.3)
    got = block_sparse_attention_reference(q, k, v, lists, counts, block_size, 0.3)
    torch.testing.assert_close(got.double(), truth, rtol=1e-5, atol=1e-5)
    # the sparse result is not the dense one: the lists matter
    assert not torch.allclose(got, causal_attention(q, k, v, 0.3), atol=1e-3)


def test_dropping_a_listed_block_changes_exactly_its_query_block():
    t, block_size = 70, 16
    q, k, v = _qkv(t, 4, 2, 16, seed=5)
    lists, counts = dense_block_lists(_n_blocks(t, block_size))
    base = block_sparse_attention_reference(q, k, v, lists, counts, block_size, 0.3)
    dropped, dropped_counts = lists.clone(), counts.clone()
    dropped[3, 1:3] = lists[3, 2:4].clone()                 # row 3: [0, 1, 2, 3] -> [0, 2, 3]
    dropped_counts[3] = 3
    out = block_sparse_attention_reference(q, k, v, dropped, dropped_counts, block_size, 0.3)
    rows = slice(3 * block_size, t)
    assert not torch.allclose(out[rows], base[rows], atol=1e-3)                     # the wrong mask shows
    torch.testing.assert_close(out[:3 * block_size], base[:3 * block_size])          # other blocks untouched
    truth = _attention64(q, k, v, _mask_by_hand(lists, counts, block_size, t), 0.3)
    assert not torch.allclose(out.double(), truth, atol=1e-3)


def _per_head_lists(n_blocks, heads, seed):
    """[heads, NB, M] lists (each head its own random sparse rows, padded to one width) and [heads, NB] counts."""
    made = [_sparse_lists(n_blocks, seed=seed + h, pad=h) for h in range(heads)]
    width = max(lists.shape[1] for lists, _ in made)
    lists = torch.stack([torch.nn.functional.pad(lists, (0, width - lists.shape[1]), value=-3) for lists, _ in made])
    return lists, torch.stack([c for _, c in made])


@pytest.mark.parametrize("t,hq,hkv,block_size", [(70, 4, 2, 16), (100, 6, 3, 16), (37, 2, 2, 16)])
def test_lists_per_kv_head_give_each_group_its_own_mask(t, hq, hkv, block_size):
    q, k, v = _qkv(t, hq, hkv, 16, seed=t)
    lists, counts = _per_head_lists(_n_blocks(t, block_size), hkv, seed=t)
    assert not all(torch.equal(lists[0], lists[h]) for h in range(hkv))        # really different per head
    mask = torch.stack([_mask_by_hand(lists[h], counts[h], block_size, t) for h in range(hkv)])
    truth = _attention64(q, k, v, mask, 0.3)
    got = block_sparse_attention_reference(q, k, v, lists, counts, block_size, 0.3)
    torch.testing.assert_close(got.double(), truth, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mask_from_block_lists(lists, counts, block_size, t), mask)
    shared = block_sparse_attention_reference(q, k, v, lists[0], counts[0], block_size, 0.3)
    group = hq // hkv
    torch.testing.assert_close(got[:, :group], shared[:, :group])              # head 0's group: head 0's lists
    assert not torch.allclose(got[:, group:], shared[:, group:], atol=1e-3)     # the others: their own


def test_bad_per_head_lists_are_refused():
    q, k, v = _qkv(37, 4, 2, 16)
    lists, counts = _per_head_lists(3, 2, seed=0)
    for args, match in (((lists[:1], counts[:1]), r"block_lists must be .*kv heads, 2"),
                        ((lists, counts[0]), r"block_counts must be \[Hkv=2, NB=3\]"),
                        ((lists, counts[:, :2]), r"block_counts must be \[Hkv=2, NB=3\]")):
        with pytest.raises(ValueError, match=match):
            block_sparse_attention(q, k, v, *args, 16, 0.3, backend="torch")
    no_diag = lists.clone()
    no_diag[1, 2, :int(counts[1, 2])] = torch.arange(int(counts[1, 2]))  # head 1, row 2: 0, 1, .. (no 2 if short)
    counts2 = counts.clone()
    counts2[1, 2] = 2
    with pytest.raises(ValueError, match="kv head 1 row 2 must list its diagonal block 2"):
        block_sparse_attention(q, k, v, no_diag, counts2, 16, 0.3, backend="torch")


# --- triton (interpreter on CPU, the GPU with CUDA) ---------------------------------------------------------------

TRITON_CASES = [  # (T, Hq, Hkv, D, block_size, lists, overrides)
    (37, 4, 2, 16, 16, "dense", {}),
    (70, 4, 2, 16, 16, "sparse", {}),
    (70, 6, 3, 16, 16, "sparse", {}),                       # GROUP 3: padded rows
    (69, 2, 2, 8, 32, "sparse", {}),                        # head_dim padding, two key tiles per block
    (65, 4, 2, 16, 16, "future", dict(block_m=16)),         # two row chunks per block; later blocks listed
    (1, 4, 2, 16, 16, "dense", {}),
    (70, 4, 2, 16, 16, "per_head", {}),                     # lists per KV head
    (65, 6, 3, 16, 16, "per_head", dict(block_m=16)),       # per KV head, padded rows, two chunks per block
    # 256-row programs (the CUDA default for GROUP >= 4 at blocks of 64) at shapes these tests reach: GROUP 7 (the
    # 0.5B model's), 112 packed rows per block; GROUP 4, 128 rows
    (100, 14, 2, 16, 16, "sparse", dict(block_m=256)),
    (150, 8, 2, 16, 32, "sparse", dict(block_m=256)),
]


def _lists_for(kind, nb, seed, heads=1):
    if kind == "dense":
        return dense_block_lists(nb)
    if kind == "per_head":
        return _per_head_lists(nb, heads, seed)
    return _sparse_lists(nb, seed=seed, future=kind == "future", dtype=torch.int32 if seed % 2 else torch.int64)


@pytest.mark.parametrize("case", TRITON_CASES, ids=str)
def test_triton_matches_reference(case, triton_device):
    from kvfuse.kernels.block_sparse import block_sparse_attention_triton

    t, hq, hkv, d, block_size, kind, overrides = case
    q, k, v = _qkv(t, hq, hkv, d, seed=t)
    lists, counts = _lists_for(kind, _n_blocks(t, block_size), seed=t, heads=hkv)
    want = block_sparse_attention_reference(q, k, v, lists, counts, block_size, 0.3)
    dev = [x.to(triton_device) for x in (q, k, v, lists, counts)]
    got = block_sparse_attention_triton(*dev, block_size, 0.3, **overrides)
    assert got.shape == (t, hq, d) and got.dtype == q.dtype and got.device.type == triton_device.type
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    mask = (_mask_by_hand(lists, counts, block_size, t) if lists.dim() == 2 else
            torch.stack([_mask_by_hand(lists[h], counts[h], block_size, t) for h in range(hkv)]))
    truth = _attention64(q, k, v, mask, 0.3)
    torch.testing.assert_close(got.cpu().double(), truth, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_triton_half_precision_against_float64(dtype, triton_device):
    from kvfuse.kernels.block_sparse import block_sparse_attention_triton

    t, block_size = 70, 16
    q, k, v = _qkv(t, 4, 2, 16, seed=3, dtype=dtype)
    lists, counts = _sparse_lists(_n_blocks(t, block_size), seed=3)
    truth = _attention64(q, k, v, _mask_by_hand(lists, counts, block_size, t), 0.25)
    ref = block_sparse_attention_reference(q, k, v, lists, counts, block_size, 0.25)
    out = block_sparse_attention_triton(*[x.to(triton_device) for x in (q, k, v, lists, counts)], block_size, 0.25)
    assert out.dtype == dtype
    assert_rule(out, ref, truth, dtype, f"triton {dtype}")


def test_backend_argument(triton_device):
    t, block_size = 37, 16
    q, k, v = _qkv(t, 4, 2, 16)
    lists, counts = _sparse_lists(_n_blocks(t, block_size), seed=1)
    want = block_sparse_attention_reference(q, k, v, lists, counts, block_size, 0.3)
    assert torch.equal(block_sparse_attention(q, k, v, lists, counts, block_size, 0.3, backend="torch"), want)
    dev = [x.to(triton_device) for x in (q, k, v, lists, counts)]
    got = block_sparse_attention(*dev, block_size, 0.3, backend="triton")
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


# --- input checks --------------------------------------------------------------------------------------------------

def _good(t=37, hq=4, hkv=2, d=16, block_size=16):
    q, k, v = _qkv(t, hq, hkv, d)
    lists, counts = _sparse_lists(_n_blocks(t, block_size), seed=0)
    return q, k, v, lists, counts


def test_bad_inputs_are_refused():
    q, k, v, lists, counts = _good()

    def refused(match, *args, block_size=16, **kw):
        with pytest.raises(ValueError, match=match):
            block_sparse_attention(*args, block_size, 0.3, backend="torch", **kw)

    refused("q heads not a multiple of kv heads", q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1),
            lists, counts)
    refused("disagree", q, k[:30], v[:30], lists, counts)                            # T differs
    refused("disagree", q, k[..., :8], v[..., :8], lists, counts)                   # head_dim differs
    refused("v must have k's shape", q, k, v[:, :1], lists, counts)
    refused(r"\[T, heads, head_dim\]", q[0], k, v, lists, counts)
    refused("dtype", q.double(), k, v, lists, counts)
    refused("dtype", q.long(), k.long(), v.long(), lists, counts)
    refused("device", q, k, v, lists.to("meta"), counts)
    refused("device", q, k.to("meta"), v, lists, counts)
    refused(r"block_lists must be \[NB=3", q, k, v, lists[:2], counts)
    refused("int32/int64", q, k, v, lists.float(), counts)
    refused(r"block_counts must be \[NB=3", q, k, v, lists, counts[:2])
    too_many = counts.clone()
    too_many[1] = lists.shape[1] + 1
    refused(r"block_counts must be in \[1, M=", q, k, v, lists, too_many)
    zero = counts.clone()
    zero[2] = 0
    refused(r"block_counts must be in \[1, M=", q, k, v, lists, zero)
    outside = lists.clone()
    outside[2, 0] = -1
    refused(r"outside \[0, NB=3\)", q, k, v, outside, counts)
    outside[2, 0] = 3
    refused(r"outside \[0, NB=3\)", q, k, v, outside, counts)
    unsorted, unsorted_counts = torch.tensor([[0, 0, 0], [0, 1, 0], [2, 1, 0]]), torch.tensor([1, 2, 3])
    refused("strictly ascending", q, k, v, unsorted, unsorted_counts)
    duplicated = torch.tensor([[0, 0], [1, 1], [2, 0]])
    refused("strictly ascending", q, k, v, duplicated, torch.tensor([1, 2, 1]))
    no_diag = torch.tensor([[0, 0], [0, 1], [0, 1]])
    refused("row 2 must list its diagonal block 2", q, k, v, no_diag, torch.tensor([1, 2, 2]))
    refused("block_size", q, k, v, lists, counts, block_size=0)
    refused("block_size", q, k, v, lists, counts, block_size=16.0)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        block_sparse_attention(q, k, v, lists, counts, 16, 0.3, backend="bogus")
    with pytest.raises(ValueError, match="block_counts"):
        mask_from_block_lists(lists, zero, 16, 37)


def test_triton_refuses_block_sizes_it_cannot_tile():
    from kvfuse.kernels.block_sparse import block_sparse_attention_triton

    q, k, v, _, _ = _good()
    for block_size in (8, 24):
        lists, counts = dense_block_lists(_n_blocks(37, block_size))
        with pytest.raises(ValueError, match="power of two >= 16"):
            block_sparse_attention_triton(q, k, v, lists, counts, block_size, 0.3)


# --- the kernel compiles for a Hopper GPU (sm_90), without a GPU (see test_kernel_gpu_compile.py) -----------------

_COMPILE = r"""
import os
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvfuse.kernels._triton import block_sparse

fn = block_sparse._block_sparse_fwd_kernel
def build(ptr, lists, constexprs, warps, stages):
    pointers = dict(Q=ptr, K=ptr, V=ptr, OUT=ptr, LISTS=lists, N_BEFORE="*i32")
    signature = {n: ("constexpr" if n in constexprs else pointers.get(n, "fp32" if n == "qk_scale" else "i32"))
                 for n in fn.arg_names}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    assert kernel.asm.get("cubin")

c = dict(GROUP=4, BLOCK_SIZE=64, CHUNKS=2, D=128, D_PAD=128, BLOCK_M=128, BLOCK_N=64, DOT_F32=False,
         PRECISION="tf32", EMULATE_RNE=False)
build("*bf16", "*i32", c, 8, 3)
build("*fp16", "*i64", dict(c, GROUP=3, D=96, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=16, CHUNKS=1), 4, 3)
build("*fp32", "*i32", dict(c, BLOCK_M=64, BLOCK_N=32, CHUNKS=4, DOT_F32=True, PRECISION="ieee"), 4, 2)
print("ok")
"""


@pytest.mark.skipif(not can_compile_for_nvidia(), reason="needs triton with its NVIDIA backend")
def test_kernel_compiles_for_sm90():
    run_compile_script(_COMPILE)
