"""Fault injection for the Ray precompute tests, installed in every Ray worker process of the test cluster.

`install()` is the cluster's `worker_process_setup_hook`. It reads the plan named by $KVFUSE_TEST_FAULT_PLAN (a
JSON file the test writes, or none) at every `FusionEngine.precompute` call of the process:

    {"marker": "/tmp/.../crashed", "on_call": 2, "keep": 2}

On the process's `on_call`-th call, the first process to create `marker` computes the first `keep` documents of its
batch, then dies at once (`os._exit`, no cleanup), as a worker killed mid-batch would. The marker makes it happen
once per test: the restarted actor runs normally.
"""
from __future__ import annotations

import json
import os


def install() -> None:
    from kvfuse.engine.api import FusionEngine

    real = FusionEngine.precompute
    calls = [0]

    def precompute(self, docs, *args, **kwargs):
        calls[0] += 1
        plan = _plan()
        if plan and calls[0] == plan["on_call"] and _claim(plan["marker"]):
            docs = list(docs)
            real(self, docs[:plan["keep"]], *args, **kwargs)
            os._exit(17)
        return real(self, docs, *args, **kwargs)

    FusionEngine.precompute = precompute


def _plan() -> dict | None:
    path = os.environ.get("KVFUSE_TEST_FAULT_PLAN")
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _claim(marker: str) -> bool:
    """Creates `marker`; False when it exists already (the crash happened)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
