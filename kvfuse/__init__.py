"""kvfuse: fast retrieval-augmented generation from fused per-document KV caches.

    from kvfuse import FusionEngine, GenerationOptions

    engine = FusionEngine.from_pretrained()
    r = engine.generate("Who ...?", [("d1", "..."), ("d2", "...")], GenerationOptions(max_new_tokens=32))

The names below (`FusionEngine`, `EngineConfig`, `GenerationOptions`, `Document`, `GenerationResult`, ...) are
imported on first use, so `import kvfuse` stays cheap (no torch, no model code).

Logging: everything logs under the `kvfuse` logger (`kvfuse.store`, `kvfuse.weights`, ...). As a library,
kvfuse attaches only a NullHandler to it, so nothing is printed unless the application configures logging,
e.g. `logging.basicConfig(level=logging.INFO)` or a handler on `logging.getLogger("kvfuse")`. The `kvfuse`
command line prints the warnings itself, on stderr.
"""
import importlib
import importlib.abc
import importlib.util
import logging
import sys
from pathlib import Path

logging.getLogger("kvfuse").addHandler(logging.NullHandler())


class _InstalledKernels(importlib.abc.MetaPathFinder):
    """Finds the installed PyPI `kernels` package (transformers imports it, a dependency since transformers 5.25)
    where the repository's own top-level `kernels/` folder would shadow it.

    That folder installs as `kvfuse.kernels`, never as `kernels`; but with the repository root on sys.path (a
    script or `python -m` run from the checkout) `import kernels` would find the folder, and loading a model
    fails inside transformers. Only the top-level name is redirected; its submodules follow the package's path.
    """

    def __init__(self, init_file: Path) -> None:
        self.init_file = init_file

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "kernels":
            return None
        return importlib.util.spec_from_file_location(fullname, self.init_file,
                                                      submodule_search_locations=[str(self.init_file.parent)])


def _guard_kernels_name() -> None:
    """Installs `_InstalledKernels` in a checkout (the repository's `kernels/` folder beside this package) when a
    `kernels` distribution is installed: whatever sys.path holds now or later (a Ray worker started in the
    checkout, a script inserting the root), `import kernels` then finds the installed package. Cheap: a metadata
    read, no import."""
    if any(isinstance(f, _InstalledKernels) for f in sys.meta_path):
        return
    ours = Path(__file__).resolve().parents[1] / "kernels" / "__init__.py"
    if not ours.is_file():  # an installed kvfuse: its kernels are kvfuse/kernels, nothing can shadow
        return
    from importlib import metadata

    try:
        init = Path(metadata.distribution("kernels").locate_file("kernels/__init__.py"))
    except metadata.PackageNotFoundError:
        return
    if init.is_file() and init.resolve() != ours:
        sys.meta_path.insert(0, _InstalledKernels(init))
        shadow = sys.modules.get("kernels")
        if shadow is not None and Path(getattr(shadow, "__file__", "") or "").resolve() == ours:
            del sys.modules["kernels"]  # the folder was imported under the wrong name: the next import is right


_guard_kernels_name()

# public name -> the module that defines it
_EXPORTS = {
    "FusionEngine": "kvfuse.engine.api",
    "EngineConfig": "kvfuse.engine.config",
    "GenerationOptions": "kvfuse.engine.options",
    "Document": "kvfuse.engine.types",
    "GenerationResult": "kvfuse.engine.types",
    "GenerationStream": "kvfuse.engine.types",
    "PrecomputeReport": "kvfuse.engine.types",
    "PromptFormat": "kvfuse.engine.prompt",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfuse' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
