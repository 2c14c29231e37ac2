"""The default compute dtype follows the hardware: bf16 on CUDA and on CPUs with native bf16 matmul, fp32 on
CPUs that would emulate it (50-100x slower there); a dtype named by the caller always wins."""
from __future__ import annotations

import pytest
import torch

from kvfuse.engine import config as C

X86_AVX2 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n"
X86_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n"
X86_AMX = "flags\t\t: fpu avx512f amx_bf16 amx_tile\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
ARM_NO = "processor\t: 0\nFeatures\t: fp asimd evtstrm\n"


@pytest.mark.parametrize("text, said", [(X86_AVX2, False), (X86_BF16, True), (X86_AMX, True), (ARM_BF16, True),
                                        (ARM_NO, False), ("", None), ("model name : x\n", None)])
def test_cpuinfo_flags_are_read(text, said):
    assert C.cpuinfo_says_bf16(text) is said


@pytest.mark.parametrize("fast", [True, False])
def test_default_dtype_on_cpu_follows_native_bf16(monkeypatch, fast):
    monkeypatch.setattr(C, "cpu_has_fast_bf16", lambda: fast)
    assert C.resolve_dtype(None, "cpu") == (torch.bfloat16 if fast else torch.float32)
    assert C.resolve_dtype(None, torch.device("cpu")) == (torch.bfloat16 if fast else torch.float32)
    assert C.resolve_dtype(None, "cuda") == torch.bfloat16 and C.resolve_dtype(None) == torch.bfloat16
    for named, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32), (torch.float16, torch.float16)):
        assert C.resolve_dtype(named, "cpu") == dt


@pytest.mark.parametrize("ratio, fast", [(1.1, True), (3.0, False)])
def test_without_cpuinfo_flags_the_rule_is_measured(monkeypatch, ratio, fast):
    """No flags line (macOS, a container without /proc): the timed bf16/fp32 product ratio decides."""
    monkeypatch.setattr(C.Path, "read_text", lambda self, *a, **k: "model name : x\n")
    monkeypatch.setattr(C, "_bf16_matmul_ratio", lambda: ratio)
    C.cpu_has_fast_bf16.cache_clear()
    try:
        assert C.cpu_has_fast_bf16() is fast
    finally:
        C.cpu_has_fast_bf16.cache_clear()


def test_the_measurement_times_both_dtypes(monkeypatch):
    """The ratio is bf16's best time over fp32's: a product made 5x slower in bf16 reads about 5."""
    import time as _time

    real = C.torch.Tensor.__matmul__
    clock = {"t": 0.0}

    def matmul(x, y):
        clock["t"] += 5.0 if x.dtype == C.torch.bfloat16 else 1.0
        return real(x, y)

    monkeypatch.setattr(C.torch.Tensor, "__matmul__", matmul)
    monkeypatch.setattr(_time, "perf_counter", lambda: clock["t"])
    assert C._bf16_matmul_ratio() == pytest.approx(5.0)


def test_bad_dtype_is_refused():
    with pytest.raises(ValueError, match="unsupported dtype"):
        C.resolve_dtype("int8", "cpu")
