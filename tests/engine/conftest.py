"""Engine test fixtures: a fresh FusionEngine (memory-only caches) over each tiny family, and over SmolLM2."""
from __future__ import annotations

import pytest
import torch
from fixtures import TINY_FAMILIES, load_tiny

from kvfuse.engine.api import FusionEngine
from kvfuse.engine.config import EngineConfig
from kvfuse.engine.weights import load_model

from cases import DOCS, FAMILIES, QUESTION  # noqa: F401  (re-exported for tests)


def make_engine(model, tok, info, **config) -> FusionEngine:
    return FusionEngine(model, tok, EngineConfig(**config), model_name=info.name,
                        model_fingerprint=info.fingerprint, tokenizer_fingerprint=info.tokenizer_fingerprint)


@pytest.fixture
def tiny_engine():
    """Factory: tiny_engine(family, **EngineConfig fields) -> a fresh fp32 engine on the CPU."""
    made = []

    def factory(family: str, **config) -> FusionEngine:
        model, tok, info = load_tiny(family, dtype=torch.float32)
        engine = make_engine(model, tok, info, **config)
        made.append(engine)
        return engine

    yield factory
    for e in made:
        e.close()


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_dir):
    model, tok, info = load_model(smollm2_dir, dtype=torch.float32, device="cpu")
    engine = make_engine(model, tok, info)
    yield engine
    engine.close()
