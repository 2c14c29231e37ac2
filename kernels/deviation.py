"""Per-token deviation between fresh and cached KV: ``||fresh[i] - cached[i]||_2`` over all heads and dims.

CacheBlend picks the tokens to recompute by this deviation at its check layer.
"""
from __future__ import annotations

import torch

from .dispatch import choose_backend

__all__ = ["kv_deviation", "kv_deviation_reference", "kv_deviation_triton"]


def _check(fresh: torch.Tensor, cached: torch.Tensor) -> None:
    if fresh.dim() != 3 or tuple(fresh.shape) != tuple(cached.shape):
        raise ValueError(f"fresh and cached must be [tokens, heads, head_dim] of one shape, got "
                         f"{tuple(fresh.shape)} and {tuple(cached.shape)}")
    if fresh.device != cached.device:
        raise ValueError("fresh and cached must be on one device")


def kv_deviation_reference(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Pure-torch deviation (also the CPU path), accumulated in fp32.

    Args:
        fresh: [M, H, D] recomputed K or V.
        cached: [M, H, D] cached K or V of the same tokens (any float dtype).

    Returns:
        [M] float32 L2 norms of the per-token differences.
    """
    _check(fresh, cached)
    diff = fresh.float() - cached.float()
    return torch.linalg.vector_norm(diff, dim=(1, 2)) if diff.numel() else diff.new_zeros(fresh.shape[0])


def kv_deviation_triton(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Triton deviation; same contract as the reference."""
    _check(fresh, cached)
    choose_backend(fresh.device, "triton")
    from ._triton.deviation import launch

    return launch(fresh, cached)


def kv_deviation(fresh: torch.Tensor, cached: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """L2 norm of ``fresh - cached`` per token over heads and head dims.

    Args:
        fresh: [M, H, D].
        cached: [M, H, D].
        backend: None (the rule in ``dispatch``), ``"triton"`` or ``"torch"``.

    Returns:
        [M] float32.
    """
    if choose_backend(fresh.device, backend) == "triton":
        return kv_deviation_triton(fresh, cached)
    return kv_deviation_reference(fresh, cached)
