"""The backend rule in kvfuse.kernels.dispatch, and the lazy / optional triton import."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvfuse.kernels import dispatch, kv_deviation
from kvfuse.kernels.dispatch import ENV_VAR, choose_backend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    return monkeypatch


def test_auto_picks_torch_on_cpu_and_triton_on_cuda(clean_env):
    pytest.importorskip("triton")
    assert choose_backend(CPU) == "torch"
    assert choose_backend("cpu", "auto") == "torch"
    assert choose_backend(CUDA) == "triton"          # the rule itself needs no GPU: it only looks at the device
    clean_env.setenv("TRITON_INTERPRET", "1")
    assert choose_backend(CPU) == "torch"            # the interpreter is for tests that ask for triton explicitly


def test_torch_always_runs(clean_env):
    assert choose_backend(CPU, "torch") == "torch"
    assert choose_backend(CUDA, "TORCH") == "torch"


def test_requested_triton_on_cpu_without_interpreter_raises(clean_env):
    with pytest.raises(RuntimeError, match="triton"):
        choose_backend(CPU, "triton")
    with pytest.raises(RuntimeError, match="triton"):
        kv_deviation(torch.zeros(2, 1, 4), torch.zeros(2, 1, 4), backend="triton")


def test_requested_triton_on_cpu_with_interpreter_is_allowed(clean_env):
    pytest.importorskip("triton")
    clean_env.setenv("TRITON_INTERPRET", "1")
    assert choose_backend(CPU, "triton") == "triton"


def test_environment_toggle_and_explicit_argument(clean_env):
    clean_env.setenv(ENV_VAR, "torch")
    assert choose_backend(CUDA) == "torch"
    clean_env.setenv(ENV_VAR, "triton")
    with pytest.raises(RuntimeError):
        choose_backend(CPU)                           # the toggle is an explicit request: it never falls back
    assert choose_backend(CPU, "torch") == "torch"   # an explicit argument wins over the toggle
    clean_env.setenv(ENV_VAR, "cuda-please")
    with pytest.raises(ValueError, match=ENV_VAR):
        choose_backend(CPU)


def test_unknown_backend_name(clean_env):
    with pytest.raises(ValueError, match="unknown kernel backend"):
        choose_backend(CPU, "cutlass")


def test_without_triton(clean_env):
    clean_env.setattr(dispatch, "_triton_import_error", lambda: "ModuleNotFoundError: No module named 'triton'")
    assert choose_backend(CUDA) == "torch"
    with pytest.raises(RuntimeError, match="does not import"):
        choose_backend(CUDA, "triton")


_NO_TRITON_SCRIPT = r"""
import importlib.abc, sys, time

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton blocked for this test")
        return None

block = "--block" in sys.argv
if block:
    sys.meta_path.insert(0, _Block())
import torch
import kvfuse.kernels as K
assert "triton" not in sys.modules, "importing kvfuse.kernels imported triton"
if block:
    from kvfuse.kernels.dispatch import choose_backend
    assert choose_backend("cuda") == "torch"
    x = torch.randn(5, 2, 8)
    cos, sin = torch.ones(5, 8), torch.zeros(5, 8)
    assert torch.equal(K.apply_rope(x, cos, sin), x)
    pos = torch.arange(5)
    out = K.fused_attention(x, pos, x[:, :1], x[:, :1], None, pos, None, None, 0.3)
    assert out.shape == (5, 2, 8)
    assert K.attention_scores(x, pos, x[:, :1], None, pos, None, None, 0.3).shape == (5, 5)
    dst = torch.zeros(5, 2, 8)
    K.scatter_rows(dst, pos, x)
    assert torch.equal(dst, x) and K.kv_deviation(dst, x).abs().max() == 0
print("ok")
"""


def test_import_is_lazy_and_works_without_triton():
    for args in ([], ["--block"]):
        done = subprocess.run([sys.executable, "-c", _NO_TRITON_SCRIPT, *args], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
