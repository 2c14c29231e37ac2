"""apply_rope: Hugging Face rotate-half arithmetic, triton (interpreter on CPU) vs reference vs float64."""
from __future__ import annotations

import pytest
import torch

from kvfuse.kernels import apply_rope, apply_rope_reference, apply_rope_triton

from kernel_cases import assert_rule, requires_cuda, rope_tables, rotate_half64


def _case(t, h, d, dtype, seed=0, noncontiguous=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 2 * h if noncontiguous else h, d, generator=g).to(dtype)
    if noncontiguous:
        x = x[:, ::2]                                                      # head stride 2 * D
    positions = torch.randperm(4 * t, generator=g)[:t]                     # arbitrary positions per token
    cos, sin = rope_tables(4 * t, d)
    return x, cos[positions], sin[positions]


def _rope64(x, cos, sin):
    c = cos.to(x.dtype).double()[:, None]
    s = sin.to(x.dtype).double()[:, None]
    x = x.double()
    return x * c + rotate_half64(x) * s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,h,d,noncontiguous", [(13, 3, 16, False), (7, 2, 32, True), (1, 1, 6, False)])
def test_triton_and_reference_against_float64(t, h, d, noncontiguous, dtype, triton_device):
    x, cos, sin = _case(t, h, d, dtype, seed=t + d, noncontiguous=noncontiguous)
    truth = _rope64(x, cos, sin)
    ref = apply_rope_reference(x, cos, sin)
    out = apply_rope_triton(x.to(triton_device), cos.to(triton_device), sin.to(triton_device)).cpu()
    assert out.dtype == dtype and out.shape == x.shape
    assert_rule(out, ref, truth, dtype, f"rope {dtype}")
    assert torch.equal(out, ref)    # each product and the sum rounded like torch, never fused: identical bits


def test_reference_matches_hugging_face_bit_for_bit():
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x, cos, sin = _case(11, 4, 32, dtype, seed=1)
        # HF: [batch, heads, seq, dim] with cos/sin [batch, seq, dim] already in the model dtype
        hf_q, _ = modeling.apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None],
                                                cos.to(dtype)[None], sin.to(dtype)[None])
        assert torch.equal(apply_rope_reference(x, cos, sin), hf_q[0].transpose(0, 1))


def test_public_op_and_validation():
    x, cos, sin = _case(5, 2, 16, torch.float32)
    assert torch.equal(apply_rope(x, cos, sin), apply_rope_reference(x, cos, sin))
    with pytest.raises(ValueError):
        apply_rope_reference(x, cos[:-1], sin)
    with pytest.raises(ValueError):
        apply_rope_reference(x[..., :15], cos[:, :15], sin[:, :15])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows_none", [False, True])
def test_gather_rotated_equals_reference_keys(dtype, rows_none, triton_device):
    """The up-front rotation of the attention kernels: pool rows gathered and rotated at their positions,
    head-major, with exactly the reference's bits."""
    pytest.importorskip("triton")
    from kvfuse.kernels._triton.rope import gather_rotated
    from kvfuse.kernels.attention import gather_keys

    g = torch.Generator().manual_seed(5)
    k = torch.randn(40, 3, 24, generator=g).to(dtype)                     # head_dim 24: halves padded
    kv_rows = None if rows_none else torch.randperm(40, generator=g)[:29]
    kv_pos = torch.randperm(60, generator=g)[:29]
    cos, sin = rope_tables(60, 24)
    ref = gather_keys(k, kv_rows, kv_pos, cos, sin)                       # [Hkv, N, D]
    dev = lambda t: None if t is None else t.to(triton_device)
    out = gather_rotated(dev(k), dev(kv_rows), dev(kv_pos), dev(cos), dev(sin)).cpu()
    assert out.shape == ref.shape and out.is_contiguous()
    assert torch.equal(out, ref)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_real_shapes(dtype):
    x, cos, sin = _case(8192, 8, 128, dtype)
    x, cos, sin = x.cuda(), cos.cuda(), sin.cuda()
    assert torch.equal(apply_rope_triton(x, cos, sin), apply_rope_reference(x, cos, sin))
    # model-dtype tables, as the engine passes them
    assert torch.equal(apply_rope_triton(x, cos.to(dtype), sin.to(dtype)),
                       apply_rope_reference(x, cos.to(dtype), sin.to(dtype)))
