"""SiLU-and-multiply over a packed gate|up projection: Triton (interpreter on CPU, or CUDA) vs the reference vs the
formula the decoder used before packing (two GEMM outputs, act then multiply)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfuse.kernels.silu_mul import silu_mul, silu_mul_reference, silu_mul_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 10), (7, 96), (33, 2 * 1300)])
def test_silu_mul_matches_the_unpacked_formula(dtype, shape, triton_device):
    g = torch.Generator().manual_seed(shape[1])
    gu = (torch.randn(shape, generator=g) * 4).to(dtype)
    f = shape[1] // 2
    unpacked = F.silu(gu[:, :f].contiguous()) * gu[:, f:].contiguous()
    ref = silu_mul_reference(gu)
    torch.testing.assert_close(ref, unpacked)  # CPU vector and scalar exp paths may differ in the last fp32 bit
    out = silu_mul_triton(gu.to(triton_device)).cpu()
    assert out.dtype == dtype and out.shape == (shape[0], f)
    if dtype == torch.bfloat16:  # one rounding step apart at most (the exponential's last bit)
        ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(1e-30)
        assert ((out.float() - ref.float()).abs() <= 2 * ulp + 1e-30).all()
        assert (out == ref).float().mean() > 0.95
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_a_strided_input_and_bad_shapes():
    base = torch.randn(6, 20)
    gu = base[:, :16]  # row stride 20: a column slice of a wider tensor
    torch.testing.assert_close(silu_mul(gu), F.silu(gu[:, :8]) * gu[:, 8:])
    with pytest.raises(ValueError, match="2 \\* ffn"):
        silu_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="2 \\* ffn"):
        silu_mul(torch.randn(2, 3, 8))


def test_other_activations_and_autograd_take_the_torch_formula(monkeypatch):
    import kvfuse.kernels.silu_mul as mod

    calls = []
    monkeypatch.setattr(mod, "choose_backend", lambda device, backend=None: "triton")
    monkeypatch.setattr(mod, "silu_mul_triton", lambda gu: calls.append(1) or mod.silu_mul_reference(gu).detach())
    gu = torch.randn(3, 8)
    torch.testing.assert_close(mod.silu_mul(gu, F.gelu), F.gelu(gu[:, :4]) * gu[:, 4:], rtol=0, atol=0)
    assert not calls
    x = gu.clone().requires_grad_()
    y = mod.silu_mul(x)
    y.sum().backward()
    assert x.grad is not None and not calls
    mod.silu_mul(gu)
    assert calls == [1]
