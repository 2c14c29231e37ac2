"""Lazy exports for the adapter packages: a name is imported on first access, and a missing framework
becomes one ImportError that says which extra to install."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, namespace: dict[str, Any], where: dict[str, str], frameworks: tuple[str, ...],
                 hint: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`: `where` maps each exported name to its submodule; an import that
    fails on a top-level module in `frameworks` raises ImportError(hint)."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            module = importlib.import_module(where[name], package)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] in frameworks:
                raise ImportError(hint) from exc
            raise
        value = getattr(module, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
