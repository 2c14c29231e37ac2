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
import logging

logging.getLogger("kvfuse").addHandler(logging.NullHandler())

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
