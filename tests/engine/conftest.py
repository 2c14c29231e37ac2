"""Engine test fixtures: a FusionEngine over SmolLM2 (the tiny-family `tiny_engine` factory is in tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch
from fixtures import engine_from

from kvfuse.engine.weights import load_model

from cases import DOCS, FAMILIES, QUESTION  # noqa: F401  (re-exported for tests)


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_dir):
    model, tok, info = load_model(smollm2_dir, dtype=torch.float32, device="cpu")
    engine = engine_from(model, tok, info)
    yield engine
    engine.close()
