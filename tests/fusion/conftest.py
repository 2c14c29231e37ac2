"""Fixtures of the strategy tests: fresh fp32 engines over the tiny random models (memory-only caches unless a
disk folder is given), and a cheap deterministic embedder for corpora (no sentence-transformers needed)."""
from __future__ import annotations

import hashlib

import pytest
import torch
from fixtures import load_tiny

from kvfuse.engine.api import FusionEngine
from kvfuse.engine.config import EngineConfig


def word_embedder(dim: int = 256):
    """Bag of hashed lower-case words: texts sharing words are close."""

    def embed(texts):
        out = torch.zeros(len(texts), dim)
        for i, t in enumerate(texts):
            for w in t.lower().replace(".", " ").replace(",", " ").split():
                out[i, int(hashlib.md5(w.encode()).hexdigest(), 16) % dim] += 1.0
        return out

    return embed


@pytest.fixture
def fusion_engine():
    """Factory: fusion_engine(family="qwen2", **EngineConfig fields) -> a fresh fp32 engine on the CPU."""
    made = []

    def factory(family: str = "qwen2", **config) -> FusionEngine:
        model, tok, info = load_tiny(family, dtype=torch.float32)
        engine = FusionEngine(model, tok, EngineConfig(**config), model_name=info.name,
                              model_fingerprint=info.fingerprint, tokenizer_fingerprint=info.tokenizer_fingerprint)
        made.append(engine)
        return engine

    yield factory
    for e in made:
        e.close()
