"""Helpers of the reliability tests: tmpfs mounts the tests make themselves (size-limited, read-only), result
comparison against a reference engine, and the fault table's counters."""
from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest


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


def compare(r, ref) -> tuple[int, int]:
    """(wrong answer, stale serve) of a result against the reference engine's: tokens differ / log-probabilities
    differ in any bit (a served cache that is not the document's own changes them)."""
    wrong = int(r.token_ids != ref.token_ids)
    a, b = r.extra.get("logprobs"), ref.extra.get("logprobs")
    stale = int(a is not None and b is not None and (a.shape != b.shape or not bool((a == b).all())))
    return wrong, stale


# -- the fault table (printed by conftest.py at the end of the run) ---------------------------------------------
COLUMNS = ("wrong answers", "stale serves", "lost committed entries", "code executed", "hangs")
CASE_OF_FILE = {
    "test_disk_security.py": "planted pickles, pickled keys, foreign file paths",
    "test_disk_corruption.py": "corrupt entries and sqlite rows (crafted and random)",
    "test_disk_faults.py": "junk database, read-only, full and vanished folders",
    "test_kill_writer.py": "kill -9 of writers mid-write",
    "test_request_properties.py": "random requests vs full prefill and cold engines",
    "test_input_contract.py": "bad input: one clear error before any work",
    "test_input_properties.py": "bad input: one clear error before any work",
    "test_window.py": "over-window documents and prompts",
    "test_streams.py": "threads, processes, abandoned and slow streams",
    "test_churn.py": "memory budgets under churn",
    "test_redis_tier.py": "shared Redis tier: planted, corrupt, down, hung, over budget",
}
TABLE: dict[str, dict[str, int]] = {}


def row(case: str) -> dict[str, int]:
    """The counters of one case of the fault table."""
    return TABLE.setdefault(case, {"tries": 0, **{c: 0 for c in COLUMNS}})


OTHER = [("o1", "The Merrow Bridge spans the river Tal and was finished in 1902 by the engineer Rosa Pell."),
         ("o2", "Rosa Pell studied at the Carvel Institute and later designed the Dunmore lighthouse."),
         ("o3", "The Dunmore lighthouse is painted red and white and stands forty metres tall.")]
OTHER_Q = "Who designed the Dunmore lighthouse?"


def store_warnings(caplog) -> list[str]:
    """Warnings the store logged (`kvfuse.store`)."""
    import logging

    return [r.getMessage() for r in caplog.records if r.name == "kvfuse.store" and r.levelno >= logging.WARNING]


def ask_exact(engine, reference, question=None, docs=None):
    """Asks `engine` (reuse, 4 tokens, log-probabilities) and asserts its answer is bit-identical to the
    `reference` fixture's engine (no disk or Redis tier)."""
    import torch
    from cases import DOCS, QUESTION

    question, docs = question or QUESTION, docs or DOCS
    r = engine.generate(question, docs, strategy="reuse", max_new_tokens=4, return_logprobs=True)
    ref = reference(question, docs, r)
    assert r.token_ids == ref.token_ids
    torch.testing.assert_close(r.extra["logprobs"], ref.extra["logprobs"], rtol=0, atol=0)
    return r
