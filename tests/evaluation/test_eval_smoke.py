"""`kvfuse eval --smoke` with the real engine and SmolLM2: the harness end to end."""
import importlib

import pytest


def _engine_import_error():
    try:
        importlib.import_module("kvfuse.engine.api")
    except Exception as e:  # noqa: BLE001 - any import failure means there is no engine to test
        return f"kvfuse.engine.api cannot be imported: {type(e).__name__}: {e}"
    return None


@pytest.mark.slow
def test_smoke_with_the_real_engine(tmp_path, capsys):
    reason = _engine_import_error()
    if reason:
        pytest.skip(reason)
    from kvfuse.evaluation.cli import main

    assert main(["--smoke", "--out", str(tmp_path), "--no-progress"]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "SMOKE OK" in err
