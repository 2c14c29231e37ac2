"""Rotary position embedding, rotate-half convention exactly as Hugging Face transformers.

``apply_rope(x, cos, sin) = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)`` over the
two halves of the head dimension. As in HF, cos/sin are cast to x's dtype and the arithmetic runs in that
dtype, so a full prefill through this op reproduces HF's logits. The tables must have HF's layout (the same
angles in both halves of a row): the triton path reads only the first half.
"""
from __future__ import annotations

import torch

from .dispatch import choose_backend

__all__ = ["apply_rope", "apply_rope_reference", "apply_rope_triton", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` over the last dimension (HF's ``rotate_half``)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_in_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in x's dtype; cos/sin broadcast against x (already gathered)."""
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    t, _, d = x.shape
    if d % 2:
        raise ValueError(f"head_dim must be even, got {d}")
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != (t, d):
            raise ValueError(f"{name} must be [tokens, head_dim] = {(t, d)}, got {tuple(table.shape)}")


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pure-torch RoPE (also the CPU path).

    Args:
        x: [tokens, heads, head_dim].
        cos: [tokens, head_dim], the two halves duplicated (HF layout); any float dtype, cast to x's.
        sin: [tokens, head_dim], same layout.

    Returns:
        [tokens, heads, head_dim] in x's dtype.
    """
    _check(x, cos, sin)
    return rope_in_dtype(x, cos.unsqueeze(1), sin.unsqueeze(1))


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton RoPE; same contract as :func:`apply_rope_reference`."""
    _check(x, cos, sin)
    choose_backend(x.device, "triton")
    from ._triton.rope import launch

    return launch(x, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Rotates x by the per-token angles in cos/sin (HF rotate-half convention).

    Args:
        x: [tokens, heads, head_dim].
        cos: [tokens, head_dim] (halves duplicated).
        sin: [tokens, head_dim].
        backend: None (the rule in ``dispatch``), ``"triton"`` or ``"torch"``.

    Returns:
        [tokens, heads, head_dim] in x's dtype.
    """
    if choose_backend(x.device, backend) == "triton":
        return apply_rope_triton(x, cos, sin)
    return apply_rope_reference(x, cos, sin)
