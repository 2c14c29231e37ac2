"""The gated MLP's activation over one packed gate|up projection: ``silu_mul(gu[T, 2F]) = act(gu[:, :F]) * gu[:, F:]``.

The decoder projects gate and up with one GEMM over their concatenated weights; this op reads that output once and
writes the product, where the torch formula takes two launches (act, then multiply) and writes an intermediate.
Rounding as transformers takes it: the activation computed in fp32 and rounded to the input dtype, then the product
computed in fp32 and rounded once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import choose_backend

__all__ = ["silu_mul", "silu_mul_reference", "silu_mul_triton"]


def _check(gu: torch.Tensor) -> int:
    if gu.dim() != 2 or gu.shape[1] % 2:
        raise ValueError(f"gu must be [tokens, 2 * ffn], got shape {tuple(gu.shape)}")
    return gu.shape[1] // 2


def silu_mul_reference(gu: torch.Tensor, act=F.silu) -> torch.Tensor:
    """Pure-torch version (also the CPU path): ``act(gate) * up`` over the two halves of the last dimension."""
    f = _check(gu)
    return act(gu[:, :f]) * gu[:, f:]


def silu_mul_triton(gu: torch.Tensor) -> torch.Tensor:
    """Triton version (SiLU only); same contract as the reference."""
    _check(gu)
    choose_backend(gu.device, "triton")
    from ._triton.silu_mul import launch

    return launch(gu)


def silu_mul(gu: torch.Tensor, act=F.silu, *, backend: str | None = None) -> torch.Tensor:
    """``act(gu[:, :F]) * gu[:, F:]`` -> [T, F] in gu's dtype.

    Args:
        gu: [T, 2F], the gate projection's columns then the up projection's.
        act: the activation; the kernel covers SiLU, any other runs the torch formula.
        backend: None (the rule in ``dispatch``), ``"triton"`` or ``"torch"``.
    """
    if act is not F.silu or (torch.is_grad_enabled() and gu.requires_grad):
        return silu_mul_reference(gu, act)  # no kernel for other activations; the kernel has no backward
    if choose_backend(gu.device, backend) == "triton":
        return silu_mul_triton(gu)
    return silu_mul_reference(gu, act)
