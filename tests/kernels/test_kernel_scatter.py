"""scatter_rows: in-place row scatter, triton (interpreter on CPU) vs reference."""
from __future__ import annotations

import pytest
import torch

from kvfuse.kernels import scatter_rows, scatter_rows_reference, scatter_rows_triton

from kernel_cases import requires_cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("noncontiguous", [False, True])
def test_triton_equals_reference(dtype, noncontiguous, triton_device):
    g = torch.Generator().manual_seed(0)
    r, m, h, d = 29, 11, 3, 20
    base = torch.randn(r, 2 * h if noncontiguous else h, d, generator=g).to(dtype)
    dst = base[:, ::2] if noncontiguous else base                          # a strided view of a bigger pool
    src = torch.randn(2 * m, h, d, generator=g).to(dtype)[::2]             # non-contiguous source rows too
    rows = torch.randperm(r, generator=g)[:m]                              # unsorted, distinct
    expected = dst.clone()
    scatter_rows_reference(expected, rows, src)
    assert torch.equal(expected[rows], src)
    untouched = torch.ones(r, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(expected[untouched], dst[untouched])
    base_dev = base.to(triton_device)
    dst_dev = base_dev[:, ::2] if noncontiguous else base_dev
    scatter_rows_triton(dst_dev, rows.to(triton_device), src.to(triton_device))
    assert torch.equal(dst_dev.cpu(), expected)
    if noncontiguous:                                                      # the interleaved heads are untouched
        assert torch.equal(base_dev[:, 1::2].cpu(), base[:, 1::2])


def test_public_op_and_validation():
    dst = torch.zeros(6, 2, 4)
    scatter_rows(dst, torch.tensor([4, 1]), torch.ones(2, 2, 4))
    assert dst.sum() == 16 and dst[4].eq(1).all() and dst[1].eq(1).all()
    with pytest.raises(ValueError, match="dtype"):
        scatter_rows_reference(dst, torch.tensor([0]), torch.ones(1, 2, 4, dtype=torch.float16))
    with pytest.raises(ValueError):
        scatter_rows_reference(dst, torch.tensor([0, 1]), torch.ones(1, 2, 4))


def test_empty_scatter_is_a_no_op(triton_device):
    dst = torch.zeros(4, 2, 8, device=triton_device)
    scatter_rows_triton(dst, torch.zeros(0, dtype=torch.long, device=triton_device),
                        torch.zeros(0, 2, 8, device=triton_device))
    assert dst.abs().sum() == 0


@pytest.mark.gpu
@requires_cuda
def test_gpu_real_shapes():
    g = torch.Generator().manual_seed(0)
    dst = torch.randn(32768, 8, 128, generator=g).to(torch.bfloat16).cuda()
    rows = torch.randperm(32768, generator=g)[:4915].cuda()
    src = torch.randn(4915, 8, 128, generator=g).to(torch.bfloat16).cuda()
    expected = dst.clone()
    scatter_rows_reference(expected, rows, src)
    scatter_rows_triton(dst, rows, src)
    assert torch.equal(dst, expected)
