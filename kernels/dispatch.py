"""The one rule that picks a kernel backend.

Rule (in order):

1. The backend asked for: the ``requested`` argument, else the ``KVFUSE_KERNEL_BACKEND`` environment variable
   (a debug toggle, read here and nowhere else), else ``"auto"``.
2. ``"torch"`` always runs (the pure-torch reference is also the CPU path).
3. ``"auto"``: ``"triton"`` for CUDA tensors when triton imports, ``"torch"`` everywhere else.
4. ``"triton"`` asked for explicitly must be able to run, or a ``RuntimeError`` says why; it never falls back
   silently. It runs on CUDA tensors, or on CPU tensors when the triton interpreter is on
   (``TRITON_INTERPRET=1``, used by the tests).
"""
from __future__ import annotations

import functools
import os

import torch

__all__ = ["BACKENDS", "ENV_VAR", "choose_backend", "triton_available", "triton_interpreting"]

ENV_VAR = "KVFUSE_KERNEL_BACKEND"
BACKENDS = ("auto", "triton", "torch")


@functools.lru_cache(maxsize=1)
def _triton_import_error() -> str | None:
    """Imports triton once; returns None when it works, else the reason it does not."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # an install can be present but broken: any failure means "not available"
        return f"{type(exc).__name__}: {exc}"
    return None


def triton_available() -> bool:
    """True when triton imports in this process."""
    return _triton_import_error() is None


def triton_interpreting() -> bool:
    """True when the triton interpreter is switched on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def choose_backend(device: torch.device | str, requested: str | None = None) -> str:
    """Picks the backend for tensors on ``device``.

    Args:
        device: the device of the op's tensors.
        requested: ``"triton"``, ``"torch"``, ``"auto"`` or None (None: the environment toggle, else auto).

    Returns:
        ``"triton"`` or ``"torch"``.

    Raises:
        ValueError: an unknown backend name.
        RuntimeError: ``"triton"`` was asked for but cannot run on ``device``.
    """
    device = torch.device(device)
    name = requested
    if name is None:
        name = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    name = name.strip().lower()
    if name not in BACKENDS:
        source = "requested" if requested is not None else f"${ENV_VAR}"
        raise ValueError(f"unknown kernel backend {name!r} ({source}); expected one of {BACKENDS}")
    if name == "torch":
        return "torch"
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    # explicitly "triton"
    error = _triton_import_error()
    if error is not None:
        raise RuntimeError(f"kernel backend 'triton' was requested but triton does not import ({error})")
    if device.type == "cuda" or (device.type == "cpu" and triton_interpreting()):
        return "triton"
    raise RuntimeError(
        f"kernel backend 'triton' was requested for tensors on {device}, where it cannot run: triton kernels need "
        "CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before the kernels are first used)"
    )
