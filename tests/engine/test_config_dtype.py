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


def test_measured_fallback_is_a_ratio_of_real_matmuls():
    r = C._bf16_matmul_ratio()
    assert 0 < r < 1e4


def test_this_cpus_answer_agrees_with_its_cpuinfo():
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo on this system: the rule is measured instead")
    said = C.cpuinfo_says_bf16(text)
    if said is None:
        pytest.skip("/proc/cpuinfo names no flags here: the rule is measured instead")
    assert C.cpu_has_fast_bf16() is said


def test_bad_dtype_is_refused():
    with pytest.raises(ValueError, match="unsupported dtype"):
        C.resolve_dtype("int8", "cpu")
