"""Scatter token rows into a KV pool, in place: ``dst[rows[i]] = src[i]``.

Used to write freshly recomputed K/V over the cached rows. Rows should be distinct; with repeats, which write
wins is unspecified (as with torch's ``index_copy_`` on CUDA).
"""
from __future__ import annotations

import torch

from .dispatch import choose_backend

__all__ = ["scatter_rows", "scatter_rows_reference", "scatter_rows_triton"]


def _check(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    if dst.dim() != 3 or src.dim() != 3:
        raise ValueError(f"dst and src must be [tokens, heads, head_dim], got {tuple(dst.shape)}, {tuple(src.shape)}")
    if tuple(src.shape[1:]) != tuple(dst.shape[1:]):
        raise ValueError(f"src rows {tuple(src.shape[1:])} do not match dst rows {tuple(dst.shape[1:])}")
    if rows.dim() != 1 or rows.numel() != src.shape[0]:
        raise ValueError(f"rows must be [M={src.shape[0]}], got {tuple(rows.shape)}")
    if src.dtype != dst.dtype:
        raise ValueError(f"src dtype {src.dtype} differs from dst dtype {dst.dtype}; cast explicitly")
    if src.device != dst.device or rows.device != dst.device:
        raise ValueError("dst, rows and src must be on one device")
    return rows.long()


def scatter_rows_reference(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """Pure-torch scatter (also the CPU path): ``dst[rows] = src`` in place.

    Args:
        dst: [R, H, D] pool, written in place.
        rows: [M] int64 destination rows.
        src: [M, H, D] rows to write (dst's dtype).
    """
    rows = _check(dst, rows, src)
    dst.index_copy_(0, rows, src)


def scatter_rows_triton(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """Triton scatter; same contract as the reference (any strides)."""
    rows = _check(dst, rows, src)
    choose_backend(dst.device, "triton")
    from ._triton.scatter import launch

    launch(dst, rows, src)


def scatter_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, *, backend: str | None = None) -> None:
    """Writes ``src[i]`` over ``dst[rows[i]]`` in place.

    Args:
        dst: [R, H, D] pool.
        rows: [M] int64 destination rows (distinct).
        src: [M, H, D], dst's dtype.
        backend: None (the rule in ``dispatch``), ``"triton"`` or ``"torch"``.
    """
    if choose_backend(dst.device, backend) == "triton":
        scatter_rows_triton(dst, rows, src)
    else:
        scatter_rows_reference(dst, rows, src)
