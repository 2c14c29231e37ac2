"""RMSNorm exactly as Hugging Face transformers computes it: fp32 statistics, the normalised row cast back to
the input dtype, then multiplied by the weight in the input dtype.

``rms_norm(x[..., F], weight[F], eps) -> [..., F]``. One kernel per call on CUDA instead of the eight element-
wise launches the torch formula takes, which matters on the short, launch-bound question path.
"""
from __future__ import annotations

import torch

from .dispatch import choose_backend

__all__ = ["rms_norm", "rms_norm_reference", "rms_norm_triton"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Pure-torch RMSNorm (also the CPU path), transformers' order of operations."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm: one program per row; same contract as the reference."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight has {weight.shape[0]} features, x has {x.shape[-1]}")
    choose_backend(x.device, "triton")
    from ._triton.rmsnorm import launch

    return launch(x, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension.

    Args:
        x: [..., F] activations.
        weight: [F] scale.
        eps: added to the mean square.
        backend: None (the rule in ``dispatch``), ``"triton"`` or ``"torch"``.

    Returns:
        [..., F] in the dtype of ``weight * x`` (transformers' promotion).
    """
    if backend is None and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return rms_norm_reference(x, weight, eps)  # the kernel has no backward: autograd (training) takes torch
    if choose_backend(x.device, backend) == "triton":
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
