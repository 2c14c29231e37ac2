"""Fixtures of the strategy tests: fresh fp32 engines over the tiny random models (memory-only caches unless a
disk folder is given). The cheap deterministic corpus embedder is `fixtures.word_embedder`."""
from __future__ import annotations

import pytest


@pytest.fixture
def fusion_engine(tiny_engine):
    """Factory: fusion_engine(family="qwen2", **EngineConfig fields) -> a fresh fp32 engine on the CPU."""

    def factory(family: str = "qwen2", **config):
        return tiny_engine(family, **config)

    return factory
