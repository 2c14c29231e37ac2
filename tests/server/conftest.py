"""Fixtures of the server tests (helpers in serving.py).

Fixtures:
    server_deps     skips the folder's tests (naming what is missing) when the serve extra is not installed.
    server          session-scoped running server (tiny llama, fp32, CPU) with API key KEY: `.url`, `.model`,
                    `.proc`, `.logs()`.
    start_server    factory for a server of a test's own (shutdown tests): start_server(*extra_args).
    local_engine    the same tiny model in this process, to compare answers with.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from serving import KEY, Server, launch, missing_deps


@pytest.fixture(scope="session", autouse=True)
def server_deps():
    missing = missing_deps()
    if missing:
        pytest.skip(f"the serve extra is not installed (missing {', '.join(missing)}): pip install -e '.[serve,dev]'")


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def server(tiny_llama_dir):
    srv = launch(tiny_llama_dir, "--api-key", KEY, "--max-tokens", "16")
    yield srv
    rc = srv.stop()
    assert rc == 0, f"the server exited with {rc}:\n{srv.logs()[-3000:]}"


@pytest.fixture
def start_server(tiny_llama_dir):
    made: list[Server] = []

    def factory(*args: str) -> Server:
        srv = launch(tiny_llama_dir, "--api-key", KEY, *args)
        made.append(srv)
        return srv

    yield factory
    for s in made:
        s.stop()


@pytest.fixture(scope="session")
def local_engine(tiny_llama_dir):
    """The same tiny model in this process, for answers to compare with the server's."""
    from kvfuse.engine.api import FusionEngine

    engine = FusionEngine.from_pretrained(str(tiny_llama_dir), device="cpu", dtype="fp32", disk_cache=False)
    yield engine
    engine.close()
