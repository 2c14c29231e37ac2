"""Shared fixtures for the kernel tests.

Without CUDA the triton kernels run in the triton interpreter on CPU tensors: TRITON_INTERPRET must be set before
any @triton.jit function is defined, i.e. before the first triton call of a kvfuse kernel (they import their
triton modules lazily), so it is set here, at collection time. With CUDA the same tests run the kernels on the GPU.
"""
from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def triton_device() -> torch.device:
    """Where the triton kernels run in these tests: CUDA if present, else CPU under the interpreter."""
    pytest.importorskip("triton")
    return torch.device("cuda" if HAS_CUDA else "cpu")
