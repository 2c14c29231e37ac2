"""fused_attention: triton (interpreter on CPU) vs torch reference vs float64 math, masking by absolute position,
deferred RoPE."""
from __future__ import annotations

import pytest
import torch

from kvfuse.kernels import fused_attention, fused_attention_reference, fused_attention_triton
from kvfuse.kernels.attention import mask_kind

from kernel_cases import (assert_rule, attention64, make_case, real_case, requires_cuda, rope_tables,
                          rotated_keys64, rotated_keys_fp32, to_device)

SHAPES = [  # (M, N, Hq, Hkv, D)
    (5, 23, 4, 2, 16),
    (17, 70, 4, 2, 32),
    (11, 41, 6, 2, 32),
    (9, 37, 4, 4, 16),
]


def _args(c):
    return (c["q"], c["q_pos"], c["k"], c["v"], c["kv_rows"], c["kv_pos"], c["cos"], c["sin"], c["scale"])


@pytest.mark.parametrize("shape,dtype", [(s, dt) for s in SHAPES for dt in (torch.float32, torch.float16)]
                         + [(SHAPES[1], torch.bfloat16)], ids=str)
def test_triton_and_reference_against_float64(shape, dtype, triton_device):
    m, n, hq, hkv, d = shape
    c = make_case(m, n, hq, hkv, d, dtype, seed=m * n)
    truth = attention64(*_args(c))
    ref = fused_attention_reference(*_args(c))
    out = fused_attention_triton(*_args(to_device(c, triton_device)))
    assert out.shape == (m, hq, d) and out.dtype == dtype
    assert_rule(out, ref, truth, dtype, f"triton {shape} {dtype}")
    assert_rule(ref, ref, truth, dtype, f"reference {shape} {dtype}")


@pytest.mark.parametrize("variant", ["rows_none", "no_rope", "unsorted_pos", "noncontiguous", "head_dim_24"])
def test_variants(variant, triton_device):
    dtype = torch.float32
    d = 24 if variant == "head_dim_24" else 32                             # 24: halves padded to 16 lanes
    c = make_case(13, 31, 4, 2, d, dtype, seed=7, sorted_pos=variant != "unsorted_pos")
    if variant == "rows_none":
        c["kv_rows"] = None
    if variant == "no_rope":
        c["cos"] = c["sin"] = None
    if variant == "noncontiguous":      # pools with a padded head stride, q with a padded token stride
        c["k"] = torch.cat([c["k"], torch.zeros_like(c["k"])], dim=1)[:, ::2]
        c["v"] = torch.cat([c["v"], torch.zeros_like(c["v"])], dim=2)[:, :, : c["q"].shape[2]]
        c["q"] = torch.cat([c["q"], c["q"]], dim=0)[::2]
        assert not (c["k"].is_contiguous() or c["v"].is_contiguous() or c["q"].is_contiguous())
    truth = attention64(*_args(c))
    ref = fused_attention_reference(*_args(c))
    out = fused_attention_triton(*_args(to_device(c, triton_device)))
    assert_rule(out, ref, truth, dtype, variant)
    assert_rule(ref, ref, truth, dtype, variant)


def _bottom_right_attention64(q, k, v, scale):
    """Index-based causal mask aligned to the bottom-right corner (query i sees keys j <= i + N - M): the
    mask of two public CacheBlend implementations, wrong for selected tokens in the middle of the prompt."""
    m, n = q.shape[0], k.shape[0]
    scores = torch.einsum("mhd,nhd->hmn", q.double(), k.double()) * scale
    visible = torch.arange(n)[None, :] <= torch.arange(m)[:, None] + (n - m)
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hmn,nhd->mhd", p, v.double())


def test_mask_is_by_absolute_position_not_bottom_right(triton_device):
    g = torch.Generator().manual_seed(3)
    n, h, d = 40, 2, 16
    k = torch.randn(n, h, d, generator=g)
    v = torch.randn(n, h, d, generator=g)
    kv_pos = torch.arange(n)
    q_pos = torch.tensor([3, 8, 15, 22, 30])                 # recomputed tokens in the middle of the prompt
    q = torch.randn(q_pos.numel(), h, d, generator=g)
    scale = d ** -0.5
    truth = attention64(q, q_pos, k, v, None, kv_pos, None, None, scale)
    wrong = _bottom_right_attention64(q, k, v, scale)
    assert (truth - wrong).abs().max() > 0.1                 # the two masks really differ here
    for out in (fused_attention_reference(q, q_pos, k, v, None, kv_pos, None, None, scale),
                fused_attention_triton(q.to(triton_device), q_pos.to(triton_device), k.to(triton_device),
                                       v.to(triton_device), None, kv_pos.to(triton_device), None, None, scale)):
        out = out.cpu().double()
        assert torch.allclose(out, truth, atol=1e-5)
        assert (out - wrong).abs().max() > 0.1
    # query 0 (position 3) must ignore everything after key 3: changing later keys changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[4:] += 5.0
    v2[4:] -= 5.0
    a = fused_attention_reference(q[:1], q_pos[:1], k, v, None, kv_pos, None, None, scale)
    b = fused_attention_reference(q[:1], q_pos[:1], k2, v2, None, kv_pos, None, None, scale)
    assert torch.equal(a, b)


def test_deferred_rope_equals_explicitly_rotated_keys(triton_device):
    c = make_case(12, 29, 4, 2, 32, torch.float32, seed=11)
    rotated = rotated_keys64(c["k"], c["kv_rows"], c["kv_pos"], c["cos"], c["sin"]).float()   # [N, Hkv, D]
    explicit = dict(c, k=rotated, v=c["v"][c["kv_rows"]], kv_rows=None, cos=None, sin=None)
    for fn, dev in ((fused_attention_reference, "cpu"), (fused_attention_triton, triton_device)):
        deferred = fn(*_args(to_device(c, dev))).cpu()
        direct = fn(*_args(to_device(explicit, dev))).cpu()
        assert torch.allclose(deferred, direct, atol=1e-5), fn.__name__


def test_query_that_sees_no_key_gets_zeros(triton_device):
    c = make_case(6, 25, 4, 2, 16, torch.float32, seed=5)
    c["q_pos"] = c["q_pos"].clone()
    c["q_pos"][0] = int(c["kv_pos"].min()) - 1
    ref = fused_attention_reference(*_args(c))
    out = fused_attention_triton(*_args(to_device(c, triton_device))).cpu()
    for x in (ref, out):
        assert torch.isfinite(x).all()
        assert torch.equal(x[0], torch.zeros_like(x[0]))
    assert torch.allclose(ref, out, atol=1e-5)


@pytest.mark.parametrize("kind", ["causal", "all", "explicit"])
def test_reference_mask_shortcuts_match_math(kind):
    """The reference drops the mask or uses is_causal only when that is exactly the absolute-position mask."""
    g = torch.Generator().manual_seed(1)
    n, hq, hkv, d = 19, 4, 2, 16
    k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    kv_pos = torch.arange(n) + 4
    q_pos = {"causal": kv_pos, "all": torch.tensor([30, 31]), "explicit": torch.tensor([7, 30, 5])}[kind]
    q = torch.randn(q_pos.numel(), hq, d, generator=g)
    assert mask_kind(q_pos, kv_pos) == kind
    cos, sin = rope_tables(40, d)
    out = fused_attention_reference(q, q_pos, k, v, None, kv_pos, cos, sin, d ** -0.5)
    truth = attention64(q, q_pos, k, v, None, kv_pos, cos, sin, d ** -0.5)
    assert torch.allclose(out.double(), truth, atol=1e-5)


def test_full_prefill_equals_plain_causal_sdpa():
    g = torch.Generator().manual_seed(2)
    n, h, d = 21, 2, 16
    q, k, v = (torch.randn(n, h, d, generator=g) for _ in range(3))
    pos = torch.arange(n)
    out = fused_attention_reference(q, pos, k, v, None, pos, None, None, d ** -0.5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True).transpose(0, 1)
    assert torch.allclose(out, sdpa, atol=1e-6)


def test_public_op_dispatches_to_torch_on_cpu():
    c = make_case(5, 23, 4, 2, 16, torch.float32)
    assert torch.equal(fused_attention(*_args(c)), fused_attention_reference(*_args(c)))
    assert torch.equal(fused_attention(*_args(c), backend="torch"), fused_attention_reference(*_args(c)))


def test_input_validation():
    c = make_case(5, 23, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        fused_attention_reference(*_args(dict(c, q=torch.randn(5, 3, 16))))
    with pytest.raises(ValueError, match="both"):
        fused_attention_reference(*_args(dict(c, sin=None)))
    with pytest.raises(ValueError, match="kv_rows"):
        fused_attention_reference(*_args(dict(c, kv_rows=c["kv_rows"][:-1])))
    with pytest.raises(ValueError, match="dtype"):
        fused_attention_reference(*_args(dict(c, v=c["v"].half())))


try:  # a probe kernel for the in-kernel key bound (module level: triton resolves names through globals)
    import triton
    import triton.language as tl

    from kvfuse.kernels._triton.common import key_bounds, search_steps, sort_block, visible_key_end

    @triton.jit
    def _probe_key_end(KPOS, QMAX, OUT, N, STEPS, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        tl.store(OUT + i, visible_key_end(KPOS, N, tl.load(QMAX + i), STEPS, BLOCK))

    @triton.jit
    def _probe_key_bounds(KPOS, QMIN, QMAX, OUT, N, STEPS, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        full, end = key_bounds(KPOS, N, tl.load(QMIN + i), tl.load(QMAX + i), STEPS, BLOCK)
        tl.store(OUT + 2 * i, full)
        tl.store(OUT + 2 * i + 1, end)
except ImportError:
    triton = None


def test_visible_key_end_searches_sorted_positions_and_scans_all_otherwise(triton_device):
    def ends(kv_pos, qmax):
        kv_pos, qmax = torch.tensor(kv_pos, device=triton_device), torch.tensor(qmax, device=triton_device)
        out = torch.zeros(qmax.numel(), dtype=torch.int32, device=triton_device)
        n = kv_pos.numel()
        _probe_key_end[(qmax.numel(),)](kv_pos, qmax, out, n, search_steps(n), BLOCK=sort_block(n))
        return out.tolist()

    sorted_pos = [0, 1, 2, 5, 6, 9, 10, 11]
    assert ends(sorted_pos, [5, 10, 0, -1, 11, 99, 7]) == [4, 7, 1, 0, 8, 8, 5]
    assert ends([3, 0, 1, 2, 5, 6, 9, 10], [5, 0]) == [8, 8]
    assert ends([4], [3, 4]) == [0, 1]


def test_key_bounds_split_keys_into_unmasked_and_masked_ranges(triton_device):
    def bounds(kv_pos, qmin, qmax):
        kv_pos = torch.tensor(kv_pos, device=triton_device)
        lo, hi = torch.tensor(qmin, device=triton_device), torch.tensor(qmax, device=triton_device)
        out = torch.zeros(2 * lo.numel(), dtype=torch.int32, device=triton_device)
        n = kv_pos.numel()
        _probe_key_bounds[(lo.numel(),)](kv_pos, lo, hi, out, n, search_steps(n), BLOCK=sort_block(n))
        return [tuple(pair) for pair in out.view(-1, 2).tolist()]

    sorted_pos = [0, 1, 2, 5, 6, 9, 10, 11]
    assert bounds(sorted_pos, [2, -1, 6, 11], [9, 0, 6, 99]) == [(3, 6), (0, 1), (5, 5), (8, 8)]
    assert bounds([3, 0, 1, 2, 5], [4, 9], [5, 9]) == [(0, 5), (0, 5)]         # unsorted: scan all, masked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits,gather_values", [(1, False), (2, False), (1, True)])
def test_keys_rotated_up_front_match_rotation_on_load(dtype, splits, gather_values, triton_device):
    """Many row blocks rotate the keys once up front; the result is the rotate-on-load one (same rounding of
    the keys, only the dot's summation order differs)."""
    pytest.importorskip("triton")
    from kvfuse.kernels._triton.attention import launch

    c = make_case(19, 53, 6, 2, 32, dtype, seed=31)                       # 57 packed rows: 4 blocks of 16
    truth = attention64(*_args(c))
    ref = fused_attention_reference(*_args(c))
    args = _args(to_device(c, triton_device))
    outs = [launch(*args, block_m=16, num_splits=splits, prerotate=pre, gather_values=gather_values).cpu()
            for pre in (False, True)]
    for out in outs:
        assert out.dtype == dtype
        assert_rule(out, ref, truth, dtype, f"prerotate splits={splits}")
    assert torch.allclose(outs[0].float(), outs[1].float(), atol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("splits", [2, 3])
def test_split_keys_merge_to_the_same_result(splits, triton_device):
    pytest.importorskip("triton")
    from kvfuse.kernels._triton.attention import launch

    c = make_case(6, 47, 4, 2, 16, torch.float32, seed=21)
    c["q_pos"] = c["q_pos"].clone()
    c["q_pos"][1] = int(c["kv_pos"].min()) - 1                            # one query that sees nothing
    ref = fused_attention_reference(*_args(c))
    out = launch(*_args(to_device(c, triton_device)), num_splits=splits).cpu()
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("splits,prerotate", [(1, False), (3, False), (1, True)])
def test_sorted_queries_scan_visible_tiles_without_the_mask(splits, prerotate, triton_device):
    """Sorted recomputed rows (as the engine passes them): most tiles of a block are visible to all its queries
    and take the unmasked path, the rest the masked one; the result is the reference's either way."""
    pytest.importorskip("triton")
    from kvfuse.kernels._triton.attention import launch

    c = make_case(24, 100, 4, 2, 16, torch.float32, seed=13, questions=4)
    order = torch.argsort(c["q_pos"])
    c["q"], c["q_pos"] = c["q"][order], c["q_pos"][order]
    truth = attention64(*_args(c))
    ref = fused_attention_reference(*_args(c))
    out = launch(*_args(to_device(c, triton_device)), block_m=16, block_n=16, num_splits=splits,
                 prerotate=prerotate).cpu()
    assert_rule(out, ref, truth, torch.float32, f"sorted queries splits={splits} prerotate={prerotate}")


# ---------------------------------------------------------------- GPU, real shapes (Llama-3.1-8B attention)

def _attention_fp32_by_head(q, q_pos, k, v, kv_rows, kv_pos, cos, sin, scale):
    """fp32 truth at real shapes, one q head at a time (bounded memory)."""
    keys = rotated_keys_fp32(k, kv_rows, kv_pos, cos, sin)
    values = v[kv_rows].float()
    group = q.shape[1] // k.shape[1]
    visible = kv_pos[None, :] <= q_pos[:, None]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for h in range(q.shape[1]):
        s = (q[:, h].float() @ keys[:, h // group].T) * scale
        out[:, h] = torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ values[:, h // group]
    return out


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [64, 1229, 4096])
def test_gpu_real_shapes(m):
    c = real_case(m, 8192, "cuda")
    args = _args(c)
    truth = _attention_fp32_by_head(*args)
    ref = fused_attention_reference(*args)
    out = fused_attention_triton(*args)
    torch.cuda.synchronize()
    assert_rule(out, ref, truth, torch.bfloat16, f"gpu m={m}", floor=1e-3)


def _index_case(seed: int = 5, n: int = 53, m: int = 12):
    """Keys at positions 0..N-1 (slot p holds position p, as in the fused prefills), gathered from a larger pool;
    queries among the keys, a padded row (-1: sees nothing) and two past the last key (see every key)."""
    c = make_case(m, n, 4, 2, 16, torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    c["kv_pos"] = torch.arange(n)
    picked = torch.sort(torch.randperm(n, generator=g)[: m - 3]).values
    c["q_pos"] = torch.cat([picked, torch.tensor([-1, n + 2, n + 5])])
    c["cos"], c["sin"] = rope_tables(n + 6, 16)
    return c


@pytest.mark.parametrize("splits,prerotate,block", [(1, False, 16), (3, False, 16), (1, True, 16), (2, True, 32)])
def test_positions_as_indices_equal_the_explicit_positions(splits, prerotate, block, triton_device):
    """kv_pos=None (key j at position j): the kernel computes positions and bounds instead of reading and
    searching them, and gives the explicit arange's result bit for bit (and the reference's)."""
    pytest.importorskip("triton")
    from kvfuse.kernels._triton.attention import launch

    c = _index_case()
    explicit = to_device(c, triton_device)
    implicit = dict(explicit, kv_pos=None)
    opts = dict(block_m=block, block_n=block, num_splits=splits, prerotate=prerotate)
    out_explicit = launch(*_args(explicit), **opts).cpu()
    out_implicit = launch(*_args(implicit), **opts).cpu()
    assert torch.equal(out_implicit, out_explicit)
    ref = fused_attention_reference(*_args(c))
    assert torch.equal(fused_attention_reference(*_args(dict(c, kv_pos=None))), ref)
    assert_rule(out_implicit, ref, attention64(*_args(c)), torch.float32, f"positions as indices {opts}")
    pad = c["q_pos"].tolist().index(-1)
    assert torch.equal(out_implicit[pad], torch.zeros_like(out_implicit[pad]))


def test_positions_as_indices_count_the_rows_attended():
    c = _index_case()
    c_none = dict(c, kv_pos=None, kv_rows=c["kv_rows"][:40])  # N = len(kv_rows): the keys past 40 are not seen
    ref40 = fused_attention_reference(*_args(dict(c, kv_pos=torch.arange(40), kv_rows=c["kv_rows"][:40])))
    assert torch.equal(fused_attention_reference(*_args(c_none)), ref40)
    with pytest.raises(ValueError, match="kv_rows must be"):
        fused_attention_reference(*_args(dict(c, kv_pos=None, kv_rows=c["kv_rows"][None])))
