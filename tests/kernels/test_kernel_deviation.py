"""kv_deviation: per-token L2 norm of fresh - cached, triton (interpreter on CPU) vs reference vs float64."""
from __future__ import annotations

import pytest
import torch

from kvfuse.kernels import kv_deviation, kv_deviation_reference, kv_deviation_triton

from kernel_cases import assert_rule, requires_cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,h,d,noncontiguous", [(13, 3, 16, False), (5, 2, 20, True), (17, 1, 1000, False)])
def test_triton_and_reference_against_float64(m, h, d, noncontiguous, dtype, triton_device):
    g = torch.Generator().manual_seed(m * d)
    cached = torch.randn(m, h, d, generator=g).to(dtype)
    fresh = (cached.float() + 0.1 * torch.randn(m, h, d, generator=g)).to(dtype)
    if noncontiguous:
        fresh = torch.cat([fresh, fresh], dim=0)[::2]
        cached = cached.transpose(1, 2).contiguous().transpose(1, 2)      # head-major memory
    truth = (fresh.double() - cached.double()).flatten(1).norm(dim=1)
    ref = kv_deviation_reference(fresh, cached)
    out = kv_deviation_triton(fresh.to(triton_device), cached.to(triton_device))
    assert out.dtype == torch.float32 and out.shape == (m,)
    # the difference of two half-precision values is exact in fp32: only fp32 rounding remains
    assert_rule(out, ref, truth, dtype, f"deviation {dtype}", floor=1e-5)


def test_public_op_and_validation():
    a = torch.zeros(3, 2, 4)
    b = torch.zeros(3, 2, 4)
    b[1, 0, :] = 1.0
    assert kv_deviation(a, b).tolist() == [0.0, 2.0, 0.0]
    with pytest.raises(ValueError):
        kv_deviation_reference(a, b[:2])


@pytest.mark.gpu
@requires_cuda
def test_gpu_real_shapes():
    g = torch.Generator().manual_seed(0)
    cached = torch.randn(8192, 8, 128, generator=g).to(torch.bfloat16).cuda()
    fresh = (cached.float() + 0.05 * torch.randn(8192, 8, 128, generator=g).cuda()).to(torch.bfloat16)
    truth = (fresh.double() - cached.double()).flatten(1).norm(dim=1)
    assert_rule(kv_deviation_triton(fresh, cached), kv_deviation_reference(fresh, cached), truth, torch.bfloat16,
                "gpu deviation", floor=1e-4)
