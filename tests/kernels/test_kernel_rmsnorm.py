"""RMSNorm: Triton (interpreter on CPU) vs the reference vs transformers' own module."""
from __future__ import annotations

import pytest
import torch

from kvfuse.kernels.rmsnorm import rms_norm, rms_norm_reference, rms_norm_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 24), (3, 2, 16), (1, 96)])
def test_rmsnorm_matches_reference_and_transformers(dtype, shape, triton_device):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (torch.randn(shape[-1], generator=g) * 0.5 + 1).to(dtype)
    hf = LlamaRMSNorm(shape[-1], eps=1e-6)
    hf.weight.data = w.clone()
    ref = rms_norm_reference(x, w, 1e-6)
    torch.testing.assert_close(ref, hf(x), rtol=0, atol=0)  # the reference is transformers' formula
    out = rms_norm_triton(x.to(triton_device), w.to(triton_device), 1e-6).cpu()
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert out.dtype == ref.dtype and out.shape == ref.shape


def test_rmsnorm_dispatch_uses_reference_on_cpu():
    x = torch.randn(4, 8)
    w = torch.ones(8)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), rtol=0, atol=0)
    with pytest.raises(ValueError, match="features"):
        rms_norm_triton(x, torch.ones(7), 1e-5)


def test_inputs_that_need_gradients_take_the_differentiable_path(monkeypatch):
    """The Triton kernel has no backward: where autograd records (adapter training), the default dispatch takes the
    torch path even on a device whose rule says triton, so gradients reach the weights; outside autograd the rule
    stands."""
    import kvfuse.kernels.rmsnorm as mod

    calls = []
    monkeypatch.setattr(mod, "choose_backend", lambda device, backend=None: "triton")
    monkeypatch.setattr(mod, "rms_norm_triton", lambda x, w, eps: calls.append(1) or mod.rms_norm_reference(
        x, w, eps).detach())
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.ones(8)
    y = mod.rms_norm(x, w, 1e-6)
    assert y.requires_grad and not calls
    y.sum().backward()
    assert x.grad is not None
    with torch.no_grad():
        mod.rms_norm(x, w, 1e-6)
    mod.rms_norm(x.detach(), w, 1e-6)
    assert len(calls) == 2
