"""Reliability suite fixtures: fresh tiny engines (fp32, CPU), a reference engine with no disk tier, and
size-limited / read-only filesystems (tmpfs mounts made by the tests themselves).

Heavy cases carry `@pytest.mark.heavy`: the README's test command skips them; CI runs them in their own step
(`pytest -m heavy tests/reliability`).
"""
from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest
import torch
from fixtures import load_tiny

from kvfuse.engine.api import FusionEngine
from kvfuse.engine.config import EngineConfig


def make_engine(model, tok, info, **config) -> FusionEngine:
    return FusionEngine(model, tok, EngineConfig(**config), model_name=info.name,
                        model_fingerprint=info.fingerprint, tokenizer_fingerprint=info.tokenizer_fingerprint)


@pytest.fixture
def tiny_engine():
    """Factory: tiny_engine(family="llama", **EngineConfig fields) -> a fresh fp32 engine on the CPU."""
    made = []

    def factory(family: str = "llama", **config) -> FusionEngine:
        model, tok, info = load_tiny(family, dtype=torch.float32)
        engine = make_engine(model, tok, info, **config)
        made.append(engine)
        return engine

    yield factory
    for e in made:
        e.close()


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """Mounts a tmpfs of `size` at path for the block (skips the test when this machine can't mount)."""
    path.mkdir(parents=True, exist_ok=True)
    r = _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path))
    if r.returncode != 0:
        pytest.skip(f"can't mount a size-limited filesystem here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield path
    finally:
        _run("umount", "-l", str(path))


def remount(path: Path, mode: str) -> None:
    """Remounts a tmpfs made by `tmpfs` read-only ("ro") or read-write ("rw")."""
    r = _run("mount", "-o", f"remount,{mode}", str(path))
    assert r.returncode == 0, r.stderr


@pytest.fixture
def mount_tmpfs(tmp_path):
    """Factory: mount_tmpfs(size="1m") -> Path of a fresh size-limited filesystem (unmounted afterwards)."""
    with contextlib.ExitStack() as stack:
        def factory(size: str = "1m", name: str = "fs") -> Path:
            return stack.enter_context(tmpfs(tmp_path / name, size))
        yield factory
