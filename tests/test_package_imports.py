"""`from kvfuse import FusionEngine, ...`: the public names, imported lazily so `import kvfuse` stays cheap."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import kvfuse

NAMES = {"FusionEngine": "kvfuse.engine.api", "EngineConfig": "kvfuse.engine.config",
         "GenerationOptions": "kvfuse.engine.options", "Document": "kvfuse.engine.types",
         "GenerationResult": "kvfuse.engine.types", "GenerationStream": "kvfuse.engine.types",
         "PrecomputeReport": "kvfuse.engine.types", "PromptFormat": "kvfuse.engine.prompt"}


def test_top_level_names_are_the_engine_objects():
    from kvfuse import Document, EngineConfig, FusionEngine, GenerationOptions, GenerationResult  # noqa: F401

    for name, module in NAMES.items():
        assert getattr(kvfuse, name) is getattr(sys.modules[module], name), name
    assert set(NAMES) <= set(kvfuse.__all__) and set(NAMES) <= set(dir(kvfuse))
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchThing'"):
        kvfuse.NoSuchThing  # noqa: B018
    with pytest.raises(ImportError):
        from kvfuse import NoSuchThing  # noqa: F401


def test_import_kvfuse_is_cheap_and_keeps_its_null_handler():
    code = ("import sys, logging, kvfuse\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'kvfuse.engine.api') if m in sys.modules)\n"
            "assert not heavy, heavy\n"
            "assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger('kvfuse').handlers)\n"
            "from kvfuse import FusionEngine, EngineConfig, GenerationOptions, Document, GenerationResult\n"
            "assert FusionEngine.__module__ == 'kvfuse.engine.api'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("kvfuse").handlers)


def _installed_kernels():
    from importlib import metadata

    try:
        return metadata.distribution("kernels")
    except metadata.PackageNotFoundError:
        return None


def test_the_pypi_kernels_package_is_not_shadowed_by_the_repository_folder():
    """transformers (>= 5.25) imports the PyPI `kernels` package; the repository's top-level `kernels/` folder (which
    installs as `kvfuse.kernels`) must not stand in for it, even with the repository root first on sys.path."""
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    if _installed_kernels() is None:
        pytest.skip("no `kernels` distribution installed (transformers < 5.25): nothing to shadow")
    root = Path(__file__).resolve().parents[1]
    probe = ("import sys; sys.path.insert(0, {root!r}); {pre}import kernels, kvfuse.kernels as ours; "
             "print(kernels.__file__); print(ours.__file__)")
    out = subprocess.run([sys.executable, "-c", probe.format(root=str(root), pre="import kvfuse; ")],
                         capture_output=True, text=True, check=True, cwd=root).stdout.split()
    assert Path(out[0]).resolve() != (root / "kernels" / "__init__.py").resolve()  # the installed package
    assert Path(out[1]).resolve() == (root / "kernels" / "__init__.py").resolve()  # ours, under its own name
    # without kvfuse imported first the folder does shadow it: the guard is what makes the difference
    bare = subprocess.run([sys.executable, "-c", probe.format(root=str(root), pre="")],
                          capture_output=True, text=True, check=True, cwd=root).stdout.split()
    assert Path(bare[0]).resolve() == (root / "kernels" / "__init__.py").resolve()


def test_importing_the_engine_does_not_import_triton():
    """Triton fixes its built-ins as compiled or interpreted when it is first imported: an engine import that pulled
    it in (torch.nn.attention.bias does) before TRITON_INTERPRET is set broke every interpreted kernel test run after
    it in the same process. Kernels import it when first used."""
    code = ("import sys, kvfuse.engine.api, kvfuse.engine.docpass, kvfuse.engine.runner, kvfuse.engine.doccache; "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
