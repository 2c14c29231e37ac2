"""attention_scores: averaged-over-heads probabilities, triton (interpreter on CPU) vs reference vs float64."""
from __future__ import annotations

import pytest
import torch

from kvfuse.kernels import attention_scores, attention_scores_reference, attention_scores_triton

from kernel_cases import (assert_rule, make_case, probs64, real_case, requires_cuda, rope_tables, rotated_keys64,
                          rotated_keys_fp32, to_device)

SHAPES = [(5, 23, 4, 2, 16), (17, 70, 4, 2, 32), (11, 41, 6, 2, 32)]


def _args(c):
    return (c["q"], c["q_pos"], c["k"], c["kv_rows"], c["kv_pos"], c["cos"], c["sin"], c["scale"])


@pytest.mark.parametrize("shape,dtype", [(s, dt) for s in SHAPES for dt in (torch.float32, torch.float16)]
                         + [(SHAPES[0], torch.bfloat16)], ids=str)
def test_triton_and_reference_against_float64(shape, dtype, triton_device):
    m, n, hq, hkv, d = shape
    c = make_case(m, n, hq, hkv, d, dtype, seed=m + n)
    truth = probs64(*_args(c)).mean(dim=0)                                 # [M, N]
    ref = attention_scores_reference(*_args(c))
    out = attention_scores_triton(*_args(to_device(c, triton_device)))
    assert out.shape == (m, n) and out.dtype == torch.float32
    # probabilities are < 1: an fp32-sized floor, whatever the input dtype
    assert_rule(out, ref, truth, dtype, f"triton {shape} {dtype}", floor=1e-6)
    assert_rule(ref, ref, truth, dtype, f"reference {shape} {dtype}", floor=1e-6)
    assert torch.allclose(out.cpu().sum(dim=1), torch.ones(m), atol=1e-5)


@pytest.mark.parametrize("variant", ["rows_none", "no_rope", "unsorted_pos", "blind_query", "head_dim_24"])
def test_variants(variant, triton_device):
    d = 24 if variant == "head_dim_24" else 16
    c = make_case(9, 33, 4, 2, d, torch.float32, seed=4, sorted_pos=variant != "unsorted_pos")
    if variant == "rows_none":
        c["kv_rows"] = None
    if variant == "no_rope":
        c["cos"] = c["sin"] = None
    if variant == "blind_query":
        c["q_pos"] = c["q_pos"].clone()
        c["q_pos"][2] = int(c["kv_pos"].min()) - 1
    truth = probs64(*_args(c)).mean(dim=0)
    ref = attention_scores_reference(*_args(c))
    out = attention_scores_triton(*_args(to_device(c, triton_device))).cpu()
    assert torch.allclose(ref.double(), truth, atol=1e-6)
    assert torch.allclose(out.double(), truth, atol=1e-6)
    if variant == "blind_query":
        assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.equal(ref[2], torch.zeros_like(ref[2]))


def test_future_keys_get_zero_probability_and_deferred_rope_matches_rotated(triton_device):
    c = make_case(8, 30, 4, 2, 16, torch.float32, seed=9)
    out = attention_scores_triton(*_args(to_device(c, triton_device))).cpu()
    future = c["kv_pos"][None, :] > c["q_pos"][:, None]
    assert torch.equal(out[future], torch.zeros_like(out[future]))
    rotated = rotated_keys64(c["k"], c["kv_rows"], c["kv_pos"], c["cos"], c["sin"]).float()
    explicit = dict(c, k=rotated, kv_rows=None, cos=None, sin=None)
    assert torch.allclose(attention_scores_reference(*_args(explicit)), attention_scores_reference(*_args(c)),
                          atol=1e-6)
    assert torch.allclose(attention_scores_triton(*_args(to_device(explicit, triton_device))).cpu(), out, atol=1e-6)


def test_public_op_dispatches_to_torch_on_cpu():
    c = make_case(5, 23, 4, 2, 16, torch.float32)
    assert torch.equal(attention_scores(*_args(c)), attention_scores_reference(*_args(c)))


def test_reference_chunks_heads_without_changing_results(monkeypatch):
    import kvfuse.kernels.attn_scores as mod

    c = make_case(7, 26, 8, 4, 16, torch.float32, seed=2)
    whole = attention_scores_reference(*_args(c))
    monkeypatch.setattr(mod, "_REFERENCE_CHUNK_BYTES", 1)               # one kv head at a time
    assert torch.allclose(attention_scores_reference(*_args(c)), whole, atol=1e-7)


def _scores_fp32_by_head(q, q_pos, k, kv_rows, kv_pos, cos, sin, scale):
    keys = rotated_keys_fp32(k, kv_rows, kv_pos, cos, sin)
    group = q.shape[1] // k.shape[1]
    visible = kv_pos[None, :] <= q_pos[:, None]
    out = torch.zeros(q.shape[0], kv_pos.numel(), dtype=torch.float32, device=q.device)
    for h in range(q.shape[1]):
        s = (q[:, h].float() @ keys[:, h // group].T) * scale
        out += torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    return out / q.shape[1]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [64, 1229])
def test_gpu_real_shapes(m):
    c = real_case(m, 8192, "cuda")
    args = _args(c)
    truth = _scores_fp32_by_head(*args)
    ref = attention_scores_reference(*args)
    out = attention_scores_triton(*args)
    torch.cuda.synchronize()
    assert_rule(out, ref, truth, torch.bfloat16, f"gpu m={m}", floor=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_keys_rotated_up_front_give_the_rotate_on_load_result(dtype, triton_device):
    pytest.importorskip("triton")
    from kvfuse.kernels._triton.attn_scores import launch

    c = make_case(21, 47, 4, 2, 16, dtype, seed=12)
    truth = probs64(*_args(c)).mean(dim=0)
    ref = attention_scores_reference(*_args(c))
    args = _args(to_device(c, triton_device))
    on_load, up_front = (launch(*args, prerotate=pre).cpu() for pre in (False, True))
    for out in (on_load, up_front):
        assert_rule(out, ref, truth, dtype, f"scores {dtype}", floor=1e-6)
    assert torch.allclose(on_load, up_front, atol=1e-6)


@pytest.mark.parametrize("splits", [2, 3])
def test_split_statistics_merge_to_the_same_result(splits, triton_device):
    pytest.importorskip("triton")
    from kvfuse.kernels._triton.attn_scores import launch

    c = make_case(6, 45, 4, 2, 16, torch.float32, seed=8)
    c["q_pos"] = c["q_pos"].clone()
    c["q_pos"][0] = int(c["kv_pos"].min()) - 1
    ref = attention_scores_reference(*_args(c))
    out = launch(*_args(to_device(c, triton_device)), num_splits=splits).cpu()
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.parametrize("splits,prerotate", [(1, False), (3, False), (1, True)])
def test_positions_as_indices_equal_the_explicit_positions(splits, prerotate, triton_device):
    """kv_pos=None (key j at position j): the same probabilities bit for bit as the explicit arange, without
    reading or searching positions in the kernels."""
    pytest.importorskip("triton")
    from kvfuse.kernels._triton.attn_scores import launch

    c = make_case(10, 45, 4, 2, 16, torch.float32, seed=3)
    c["kv_pos"] = torch.arange(45)
    c["q_pos"] = torch.cat([torch.sort(torch.randperm(45, generator=torch.Generator().manual_seed(3))[:7]).values,
                            torch.tensor([-1, 47, 49])])
    c["cos"], c["sin"] = rope_tables(50, 16)
    explicit = to_device(c, triton_device)
    opts = dict(block_m=16, block_n=16, num_splits=splits, prerotate=prerotate)
    out_explicit = launch(*_args(explicit), **opts).cpu()
    out_implicit = launch(*_args(dict(explicit, kv_pos=None)), **opts).cpu()
    assert torch.equal(out_implicit, out_explicit)
    ref = attention_scores_reference(*_args(c))
    assert torch.equal(attention_scores_reference(*_args(dict(c, kv_pos=None))), ref)
    assert torch.allclose(out_implicit, ref, atol=1e-5)
    assert float(out_implicit[7].abs().sum()) == 0.0  # the padded row sees nothing


@pytest.mark.parametrize("splits,prerotate,by_index", [(1, False, False), (3, False, False), (2, True, False),
                                                         (1, False, True), (3, False, True)])
def test_scores_from_the_attention_statistics_equal_their_own(splits, prerotate, by_index, triton_device):
    """attention_and_scores: the scores normalised by the attention kernel's softmax statistics (its key splits,
    its tiles) are the scores of their own statistics pass, and the attention is fused_attention's; a padded row
    and a query that sees no key get zeros."""
    pytest.importorskip("triton")
    from kvfuse.kernels import fused_attention_reference
    from kvfuse.kernels._triton.attention import launch as attend
    from kvfuse.kernels._triton.attn_scores import launch as score

    c = make_case(10, 45, 4, 2, 16, torch.float32, seed=5)
    if by_index:
        c["kv_pos"] = None
        c["q_pos"] = torch.tensor([3, 9, 17, 30, 44, 44, 45, 47, -1, 12])
        c["cos"], c["sin"] = rope_tables(50, 16)
    else:
        c["q_pos"] = c["q_pos"].clone()
        c["q_pos"][0] = int(c["kv_pos"].min()) - 1                       # sees no key
    dev = to_device(c, triton_device)
    args = (dev["q"], dev["q_pos"], dev["k"], dev["v"], dev["kv_rows"], dev["kv_pos"], dev["cos"], dev["sin"],
            dev["scale"])
    out, stats = attend(*args, stats=True, num_splits=splits, block_m=16, block_n=16, prerotate=prerotate)
    assert stats.shape == (1, 10, 4, 2)  # merged over the splits
    shared = score(*_args(dev), stats=stats).cpu()
    own = score(*_args(dev), block_m=16, block_n=16).cpu()
    ref = attention_scores_reference(*_args(c))
    assert torch.allclose(shared, own, atol=1e-6, rtol=1e-5)
    assert torch.allclose(shared, ref, atol=1e-5)
    assert torch.allclose(out.cpu(), fused_attention_reference(*[c[x] for x in ("q", "q_pos", "k", "v", "kv_rows",
                                                                              "kv_pos", "cos", "sin", "scale")]),
                          atol=1e-5)
    blind = 8 if by_index else 0
    assert float(shared[blind].abs().sum()) == 0.0
    seen = [i for i in range(10) if i != blind]
    assert torch.allclose(shared[seen].sum(dim=1), torch.ones(9), atol=1e-5)


def test_scores_from_other_statistics_are_not_normalised(triton_device):
    """The statistics are what normalises the probabilities: another query set's do not sum to 1 (the test above
    cannot pass by ignoring them)."""
    pytest.importorskip("triton")
    from kvfuse.kernels._triton.attention import launch as attend
    from kvfuse.kernels._triton.attn_scores import launch as score

    c = make_case(10, 45, 4, 2, 16, torch.float32, seed=5)
    dev = to_device(c, triton_device)
    other = dict(dev, q=dev["q"].flip(0))
    _, stats = attend(other["q"], dev["q_pos"], dev["k"], dev["v"], dev["kv_rows"], dev["kv_pos"], dev["cos"],
                      dev["sin"], dev["scale"], stats=True, num_splits=2, block_m=16, block_n=16)
    wrong = score(*_args(dev), stats=stats).cpu()
    assert not torch.allclose(wrong.sum(dim=1), torch.ones(10), atol=1e-3)


def test_attention_and_scores_is_the_two_ops(triton_device):
    """The public op on both backends: the same as fused_attention and attention_scores called apart."""
    from kvfuse.kernels import attention_and_scores, fused_attention

    c = make_case(7, 33, 4, 2, 16, torch.float32, seed=2)
    for backend, case in (("torch", c), ("triton", to_device(c, triton_device))):
        a = (case["q"], case["q_pos"], case["k"], case["v"], case["kv_rows"], case["kv_pos"], case["cos"],
             case["sin"], case["scale"])
        out, sc = attention_and_scores(*a, backend=backend)
        assert torch.allclose(out.cpu(), fused_attention(*a, backend=backend).cpu(), atol=1e-6)
        assert torch.allclose(sc.cpu(), attention_scores(*_args(case), backend=backend).cpu(), atol=1e-6)
