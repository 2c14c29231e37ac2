"""The frameworks are optional extras: importing the adapter packages must not need them."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["llama_index"] = None      # as if llama-index-core were not installed
sys.modules["langchain_core"] = None   # as if langchain-core were not installed
import kvfuse.integrations.llama_index as li, kvfuse.integrations.langchain as lc
for module, name, extra in ((li, "FusionLLM", "llama-index"), (lc, "ChatKVFuse", "langchain")):
    try:
        getattr(module, name)
    except ImportError as err:
        assert extra in str(err), err
    else:
        raise AssertionError(name + " imported without its framework")
print("ok")
"""


def test_adapters_import_without_their_frameworks():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_adapter_packages_do_not_import_frameworks_eagerly():
    script = ("import sys, kvfuse.integrations.llama_index, kvfuse.integrations.langchain\n"
              "print(sorted({m.split('.')[0] for m in sys.modules} & {'llama_index', 'langchain_core'}))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr
