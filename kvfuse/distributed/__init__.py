"""Distributed jobs over a cluster (Ray): precomputing the document caches of a whole corpus.

    from kvfuse.distributed import precompute_corpus

    report = precompute_corpus("corpus.jsonl", model="qwen2.5-coder-0.5b", cache_dir="/data/kvfuse")
    print(report.summary())

Needs the `distributed` extra (`pip install 'kvfuse[distributed]'`); importing this package does not import Ray.
"""
from __future__ import annotations

import importlib

__all__ = ["CorpusError", "CorpusReport", "precompute_corpus", "read_corpus"]

_EXPORTS = {name: "kvfuse.distributed.ray_precompute" for name in __all__}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfuse.distributed' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
