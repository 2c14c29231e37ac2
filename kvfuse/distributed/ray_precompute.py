"""Precomputes the document caches of a whole corpus on a Ray cluster.

A Ray Data job reads the documents (JSONL, Parquet, a JSON list, or a persisted LlamaIndex docstore), cuts them
into batches and hands each batch to an actor pool; every actor holds one FusionEngine (one actor per GPU where
the cluster has GPUs, CPU actors otherwise) and calls `engine.precompute(batch)`, which writes the caches into
the shared tier: the disk cache folder (`cache_dir/kv`, or `disk_cache_dir=`), shared by every actor on one
machine. (Across machines the folder must be on a shared filesystem.)

Crash safety: entries are keyed by content, so a document is stored at most once however often it is computed.
An actor that dies is restarted and its batch retried (`max_retries`); the documents it had finished are found in
the shared tier and reported as hits. A rerun after a crash computes only what is missing: every actor first
checks which documents of its batch are stored already (an existence check, no entry is read) and counts those
as hits.

Everything about the input is checked in the driver before the cluster is asked for any work: a missing file, a
line that is not JSON (named by its line number), a document without an id or a text, an id used twice with
different texts. Such problems raise `CorpusError` (a ValueError) naming the place.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CorpusError", "CorpusReport", "Corpus", "precompute_corpus", "read_corpus", "FORMATS"]

FORMATS = ("jsonl", "json", "parquet", "llama-index")
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_CHUNK_ROWS = 256  # rows per block read from a JSONL file


class CorpusError(ValueError):
    """The corpus can't be read: names the file, and the line, row or item, and what is wrong."""


# --------------------------------------------------------------------------------------------------- the corpus
@dataclass
class Corpus:
    """A checked corpus, ready to be read by a Ray Data job.

    Attributes:
        format: "jsonl", "json", "parquet" or "llama-index".
        paths: the files read (JSONL and Parquet: one or many; the others: one).
        documents: how many documents (records) the files hold.
        distinct: how many distinct document ids among them.
        rows: the documents themselves for the formats read whole in the driver ("json", "llama-index"); None for
            the streamed ones.
        has_title: a Parquet corpus with a `title` column.
    """

    format: str
    paths: list[Path]
    documents: int
    distinct: int
    rows: list[dict[str, str]] | None = None
    has_title: bool = False


class _Ids:
    """Document id -> (digest of its text and title, where it was first seen): an id used twice must carry the same
    document both times."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[bytes, str]] = {}

    def add(self, where: str, did: str, text: str, title: str) -> None:
        h = hashlib.blake2b(digest_size=12)
        h.update(text.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
        h.update(title.encode("utf-8", "surrogatepass"))
        digest = h.digest()
        first = self.seen.get(did)
        if first is None:
            self.seen[did] = (digest, where)
        elif first[0] != digest:
            raise CorpusError(f"{where}: document id {did!r} is also used by {first[1]} with a different text")


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _check_document(where: str, record: Any) -> dict[str, str]:
    """One record as {"id", "text", "title"} (strings), or CorpusError naming `where`."""
    from kvfuse.engine.types import Document

    if not isinstance(record, dict):
        raise CorpusError(f"{where}: expected an object with 'id' and 'text', got {_kind(record)}")
    if "id" not in record or record["id"] is None or record["id"] == "":
        raise CorpusError(f"{where}: has no 'id' (every document needs an id and a text)")
    if "text" not in record or record["text"] is None:
        raise CorpusError(f"{where}: has no 'text' (every document needs an id and a text)")
    did, text, title = record["id"], record["text"], record.get("title")
    if isinstance(did, bool) or not isinstance(did, (str, int, float)):
        raise CorpusError(f"{where}: 'id' must be a string or a number, got {_kind(did)}")
    if not isinstance(text, str):
        raise CorpusError(f"{where}: 'text' must be a string, got {_kind(text)}")
    title = "" if title is None else title
    if not isinstance(title, str):
        raise CorpusError(f"{where}: 'title' must be a string, got {_kind(title)}")
    did = str(did)
    try:
        Document(did, text, title.strip())  # the engine's own checks (empty text, lone surrogates)
    except ValueError as e:
        raise CorpusError(f"{where}: {e}") from None
    return {"id": did, "text": text, "title": title}


def _files(path: Path, suffixes: tuple[str, ...], what: str) -> list[Path]:
    """`path` itself, or the files under the folder `path` whose names end with one of `suffixes` (sorted)."""
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(suffixes)
                       and not p.name.startswith((".", "_")))
        if not found:
            raise CorpusError(f"{path}: a folder without {what} files ({', '.join(suffixes)})")
        return found
    if not path.is_file():
        raise CorpusError(f"{path}: not a regular file")
    return [path]


def _guess_format(path: Path) -> str:
    if path.is_dir():
        if (path / "docstore.json").is_file():
            return "llama-index"
        names = [p.name.lower() for p in path.rglob("*") if p.is_file()]
        if any(n.endswith(".parquet") for n in names):
            return "parquet"
        if any(n.endswith(_JSONL_SUFFIXES) for n in names):
            return "jsonl"
        raise CorpusError(f"{path}: a folder without .jsonl, .parquet files or a docstore.json; name the format")
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix == ".json":
        return "json"  # a list of documents, or a LlamaIndex docstore (told apart once read)
    raise CorpusError(f"{path}: can't tell the format from the name; give it (jsonl, json, parquet, llama-index)")


def read_corpus(source: str | os.PathLike[str], format: str = "auto") -> Corpus:
    """Checks a corpus and counts its documents, before any work.

    Args:
        source: a JSONL file (one `{"id", "text"[, "title"]}` object per line) or a folder of them; a Parquet file
            or folder (columns `id`, `text`, optional `title`); a JSON file holding a list of such objects (or
            `{"documents": [...]}`); a persisted LlamaIndex docstore (`docstore.json`, or the persist folder
            holding it), whose nodes are the documents, keyed by their bodies as the LlamaIndex integration keys
            them.
        format: "auto" (from the name), or one of FORMATS.

    Raises:
        CorpusError: naming the file and the line / row / item and what is wrong.
    """
    path = Path(os.fspath(source)).expanduser()
    if not path.exists():
        raise CorpusError(f"no such file: {source}")
    if format not in ("auto", *FORMATS):
        raise CorpusError(f"unknown corpus format {format!r}; use one of auto, {', '.join(FORMATS)}")
    fmt = _guess_format(path) if format == "auto" else format
    if fmt == "jsonl":
        return _scan_jsonl(_files(path, _JSONL_SUFFIXES, "JSONL"))
    if fmt == "parquet":
        return _scan_parquet(_files(path, (".parquet", ".pq"), "Parquet"))
    if fmt == "llama-index":
        if path.is_dir():
            path = path / "docstore.json"
            if not path.is_file():
                raise CorpusError(f"{source}: no docstore.json in this folder")
        return _scan_llama_index(path, _read_json(path))
    data = _read_json(_files(path, (".json",), "JSON")[0])
    if isinstance(data, dict) and "docstore/data" in data:
        return _scan_llama_index(path, data)
    return _scan_json_list(path, data)


def _decode(raw: bytes, where: str, first: bool) -> str:
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None


def _parse(text: str, where: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise CorpusError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except ValueError as e:  # NaN / Infinity
        raise CorpusError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise CorpusError(f"{where}: not valid JSON (nested too deeply)") from None


def _jsonl_records(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of every non-blank line. Only "\\n" ends a record (U+2028 & co. are legal inside JSON
    strings), as in `kvfuse precompute`."""
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):  # binary files split on b"\n" only
                line = _decode(raw, f"{path}:{n}", n == 1)
                if line.strip():
                    yield n, line
    except OSError as e:
        raise CorpusError(f"{path}: cannot read it ({e.strerror})") from None


def _scan_jsonl(paths: list[Path]) -> Corpus:
    ids, count = _Ids(), 0
    for path in paths:
        for n, line in _jsonl_records(path):
            doc = _check_document(f"{path}:{n}", _parse(line, f"{path}:{n}"))
            ids.add(f"{path}:{n}", doc["id"], doc["text"], doc["title"])
            count += 1
    if not count:
        raise CorpusError(f"{paths[0] if len(paths) == 1 else paths[0].parent}: no documents found")
    return Corpus("jsonl", paths, count, len(ids.seen))


def _read_json(path: Path) -> Any:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CorpusError(f"{path}: cannot read it ({e.strerror})") from None
    text = _decode(raw, str(path), True)
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise CorpusError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (ValueError, RecursionError) as e:
        raise CorpusError(f"{path}: not valid JSON ({e})") from None


def _scan_json_list(path: Path, data: Any) -> Corpus:
    if isinstance(data, dict) and "documents" in data:
        data, what = data["documents"], "'documents'"
    else:
        what = "the top level"
    if not isinstance(data, list):
        raise CorpusError(f"{path}: {what} must be a list of documents (or an object with a 'documents' list, or a "
                          f"LlamaIndex docstore), got {_kind(data)}")
    rows, ids = [], _Ids()
    for i, r in enumerate(data):
        doc = _check_document(f"{path}: item {i + 1}", r)
        ids.add(f"{path}: item {i + 1}", doc["id"], doc["text"], doc["title"])
        rows.append(doc)
    if not rows:
        raise CorpusError(f"{path}: no documents found")
    return Corpus("json", [path], len(rows), len(ids.seen), rows=rows)


def _scan_llama_index(path: Path, data: Any) -> Corpus:
    if not isinstance(data, dict) or not isinstance(data.get("docstore/data"), dict):
        raise CorpusError(f"{path}: not a persisted LlamaIndex docstore (no 'docstore/data' object)")
    try:
        from llama_index.core.storage.docstore import SimpleDocumentStore

        from kvfuse.integrations.llama_index.llm import nodes_to_documents
    except ImportError as e:
        raise CorpusError(f"{path}: reading a LlamaIndex docstore needs the llama-index extra "
                          f"(pip install 'kvfuse[llama-index]'): {e}") from None
    try:
        store = SimpleDocumentStore.from_dict(data)
        nodes = list(store.docs.values())
    except Exception as e:  # noqa: BLE001 - a docstore LlamaIndex itself can't load
        raise CorpusError(f"{path}: LlamaIndex can't load this docstore ({type(e).__name__}: {e})") from None
    rows, ids = [], _Ids()
    for node in nodes:  # the node's body is the document (and its cache key), its metadata header the title
        try:
            docs = nodes_to_documents([node])
        except ValueError as e:
            raise CorpusError(f"{path}: node {getattr(node, 'node_id', '?')!r}: {e}") from None
        for d in docs:
            doc = {"id": d.id, "text": d.text, "title": d.title}
            ids.add(f"{path}: node {d.id!r}", d.id, d.text, d.title)
            rows.append(doc)
    if not rows:
        raise CorpusError(f"{path}: the docstore holds no node with text")
    return Corpus("llama-index", [path], len(rows), len(ids.seen), rows=rows)


def _scan_parquet(paths: list[Path]) -> Corpus:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids, count, has_title = _Ids(), 0, None
    for path in paths:
        try:
            f = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise CorpusError(f"{path}: not a Parquet file ({e})") from None
        schema = f.schema_arrow
        missing = [c for c in ("id", "text") if c not in schema.names]
        if missing:
            raise CorpusError(f"{path}: no {' or '.join(repr(c) for c in missing)} column (columns: "
                              f"{', '.join(schema.names) or 'none'}; every document needs an id and a text)")
        for col, ok in (("id", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)
                         or pa.types.is_integer(t)),
                        ("text", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)),
                        ("title", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)
                         or pa.types.is_null(t))):
            if col in schema.names and not ok(schema.field(col).type):
                raise CorpusError(f"{path}: column {col!r} must hold strings{' or integers' if col == 'id' else ''}, "
                                  f"it holds {schema.field(col).type}")
        title = "title" in schema.names
        if has_title is not None and title != has_title:
            raise CorpusError(f"{path}: has {'a' if title else 'no'} 'title' column, unlike {paths[0]}")
        has_title = title
        cols = ["id", "text"] + (["title"] if title else [])
        row = 0
        for batch in f.iter_batches(columns=cols, batch_size=4096):
            for rec in batch.to_pylist():
                row += 1
                doc = _check_document(f"{path}: row {row}", rec)
                ids.add(f"{path}: row {row}", doc["id"], doc["text"], doc["title"])
                count += 1
    if not count:
        raise CorpusError(f"{paths[0]}: no documents found")
    return Corpus("parquet", paths, count, len(ids.seen), has_title=bool(has_title))


# ------------------------------------------------------------------------------------------------ the report
@dataclass
class CorpusReport:
    """What a corpus precompute did.

    Attributes:
        documents: documents processed (every record of the corpus).
        hits: found in the shared tier already (a rerun, a retried batch, or the same text under another id).
        misses: computed and stored.
        tokens: document tokens computed.
        seconds: wall-clock time of the job (cluster start and model loads included).
        bytes_written: how much the disk cache folder grew (None without a local folder).
        workers: engines (actors) that ran.
        device: "cuda" or "cpu".
        cache: where the caches are.
    """

    documents: int
    hits: int
    misses: int
    tokens: int
    seconds: float
    bytes_written: int | None
    workers: int
    device: str
    cache: str
    worker_seconds: float = 0.0
    batches: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def docs_per_s(self) -> float:
        return self.documents / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        written = "" if self.bytes_written is None else f"; {_size(self.bytes_written)} written"
        return (f"{self.documents} documents: {self.misses} computed ({self.tokens} tokens), {self.hits} already "
                f"cached; {self.seconds:.2f} s on {self.workers} {self.device} worker"
                f"{'s' if self.workers != 1 else ''}: {self.docs_per_s:.1f} documents/s, "
                f"{self.tokens_per_s:.0f} tokens/s{written}; cache at {self.cache}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # removed meanwhile (an evicted entry, a sqlite journal)
                pass
    return total


# ------------------------------------------------------------------------------------------------- the actors
class _PrecomputeWorker:
    """One FusionEngine in one Ray actor; `__call__` precomputes a batch of documents and returns one row of
    counts (documents, hits, misses, tokens, seconds)."""

    def __init__(self, model: str, engine_kwargs: dict[str, Any], strategy: str | None, threads: int | None) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        from kvfuse.engine.api import FusionEngine

        self.engine = FusionEngine.from_pretrained(model, **engine_kwargs)
        self.strategy = strategy

    def _stored(self, docs: list[Any]) -> tuple[list[Any], int]:
        """(the documents still to compute, how many are stored already): an existence check of each content key
        (no entry is read). A document counts as stored once its cache is in the shared tier and it is registered
        (or too short to be searched for), which is where `precompute` ends for it."""
        from kvfuse.engine.store import content_key

        engine = self.engine
        prefix, registry = engine.prompts.prefix_ids, engine.registry
        todo, stored = [], 0
        for d in docs:
            key = content_key(engine.namespace, prefix, engine.prompts.encode_document(d))
            if engine.store.peek(key) and (registry.fingerprint(d) is None or registry.known(d)):
                stored += 1
            else:
                todo.append(d)
        return todo, stored

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        from kvfuse.engine.types import Document

        t0 = time.perf_counter()
        titles = batch.get("title")
        docs = [Document(str(i), str(t), "" if titles is None or titles[j] is None else str(titles[j]).strip())
                for j, (i, t) in enumerate(zip(batch["id"], batch["text"]))]
        todo, stored = (docs, 0) if self.strategy is not None else self._stored(docs)
        hits = misses = tokens = 0
        if todo:
            rep = self.engine.precompute(todo, self.strategy)
            hits, misses, tokens = rep.hits, rep.misses, rep.tokens
        return {"documents": np.array([len(docs)]), "hits": np.array([hits + stored]), "misses": np.array([misses]),
                "tokens": np.array([tokens]), "seconds": np.array([time.perf_counter() - t0]),
                "worker": np.array([os.getpid()])}


def _jsonl_datasource(paths: list[Path]):
    """A Ray Data datasource over JSONL files, checked by `read_corpus` already: one row {"id", "text", "title"}
    (strings) per non-blank line; only "\\n" ends a line (`ray.data.read_text` also splits on U+2028 & co.)."""
    import pyarrow as pa
    from ray.data.datasource import FileBasedDatasource

    class JsonlDocuments(FileBasedDatasource):
        def _read_stream(self, f, path: str):
            cols: dict[str, list[str]] = {"id": [], "text": [], "title": []}
            rest, first = b"", True
            while True:
                chunk = f.read(1 << 20)
                if chunk:
                    rest += chunk
                    *lines, rest = rest.split(b"\n")
                else:
                    lines, rest = ([rest] if rest else []), b""
                for raw in lines:
                    line = raw.decode("utf-8-sig" if first else "utf-8")
                    first = False
                    if not line.strip():
                        continue
                    r = json.loads(line)
                    cols["id"].append(str(r["id"]))
                    cols["text"].append(r["text"])
                    cols["title"].append(r.get("title") or "")
                    if len(cols["id"]) >= _CHUNK_ROWS:
                        yield pa.table(cols)
                        cols = {"id": [], "text": [], "title": []}
                if not chunk:
                    break
            if cols["id"]:
                yield pa.table(cols)

    return JsonlDocuments([str(p) for p in paths])


def _dataset(corpus: Corpus, read_cpus: float):
    import ray.data

    if corpus.rows is not None:
        return ray.data.from_items(corpus.rows)
    if corpus.format == "jsonl":
        return ray.data.read_datasource(_jsonl_datasource(corpus.paths), num_cpus=read_cpus)
    cols = ["id", "text"] + (["title"] if corpus.has_title else [])
    return ray.data.read_parquet([str(p) for p in corpus.paths], num_cpus=read_cpus).select_columns(cols)


# ---------------------------------------------------------------------------------------------------- the job
def _check_model(model: str) -> None:
    from kvfuse.engine.weights import REGISTRY

    if str(model) in REGISTRY:
        return
    if not Path(model).expanduser().exists():
        raise CorpusError(f"model {model!r}: not a registry name ({', '.join(REGISTRY)}), nor an existing .gguf file "
                          f"or model folder")


def _progress(total: int, show: bool):
    if show:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="kvfuse precompute (ray)", unit="doc")
    return None


def precompute_corpus(source: str | os.PathLike[str], *, model: str | None = None, cache_dir: str | None = None,
                      num_workers: int | None = None, batch_size: int = 32, address: str | None = None,
                      format: str = "auto", device: str | None = None, dtype: str | None = None,
                      strategy: str | None = None, threads_per_worker: int | None = None, max_retries: int = 3,
                      show_progress: bool = False, **engine_config: Any) -> CorpusReport:
    """Computes and stores the caches of every document of a corpus, on a Ray cluster.

    Args:
        source: the corpus (see `read_corpus`: JSONL, Parquet, a JSON list, a LlamaIndex docstore).
        model: registry name, .gguf file or Hugging Face folder (default: the engine's default model). Every actor
            loads it; a path must exist on every node.
        cache_dir: converted weights and the disk cache (`cache_dir/kv`), as `FusionEngine.from_pretrained`'s
            (default: $KVFUSE_CACHE_DIR or ~/.cache/kvfuse). The one folder every actor writes: the shared tier.
        num_workers: engines (actors). Default: one per GPU of the cluster; without GPUs, one per 8 CPUs (at
            least one).
        batch_size: documents per `engine.precompute` call (a batch is also what is retried after a crash).
        address: the Ray cluster to join ("auto", "ray://host:10001"); None joins the cluster this process is
            connected to already, or starts a local one (shut down at the end).
        format: "auto" or one of FORMATS.
        device, dtype: of the engines ("cuda" when the cluster has GPUs, else "cpu"; dtype default as for
            `FusionEngine.from_pretrained`: bf16 on CUDA and on CPUs with native bf16, else fp32). The
            caches are only served to engines of the same model, tokenizer and dtype.
        strategy: also compute the offline data this fusion strategy reads (as `engine.precompute`'s).
        threads_per_worker: torch threads of a CPU actor (default: the cluster's CPUs shared among the actors).
        max_retries: restarts of a dead actor, and retries of the batch it was computing.
        show_progress: a progress bar over the documents (on stderr).
        **engine_config: EngineConfig fields for every engine (`disk_cache_dir`, `cache_secret`, ...). The memory
            tier of a precompute actor defaults to 256 MiB (`memory_budget_bytes`): it only holds the batch at hand.

    Returns:
        CorpusReport: documents, hits, misses, tokens, seconds, bytes written; `summary()` is one line.

    Raises:
        CorpusError: a bad corpus or model argument, before any work.
        ImportError: Ray is not installed (the `distributed` extra).
        RuntimeError: the job failed on the cluster.
    """
    from kvfuse.engine.api import DEFAULT_MODEL
    from kvfuse.engine.validate import check_dir_path
    from kvfuse.engine.weights import default_cache_dir

    corpus = read_corpus(source, format)
    model = str(model or DEFAULT_MODEL)
    _check_model(model)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise CorpusError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 1):
        raise CorpusError(f"num_workers must be an integer >= 1, got {num_workers!r}")
    if not isinstance(max_retries, int) or max_retries < 0:
        raise CorpusError(f"max_retries must be an integer >= 0, got {max_retries!r}")
    if threads_per_worker is not None and threads_per_worker < 1:
        raise CorpusError(f"threads_per_worker must be >= 1, got {threads_per_worker!r}")
    if engine_config.pop("disk_cache", True) is False:
        raise CorpusError("a corpus precompute writes the shared disk tier: disk_cache=False would keep nothing")
    if strategy is not None:
        from kvfuse.engine.fusion import make_strategy

        make_strategy(strategy)  # an unknown name fails here, not in every actor
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    root = check_dir_path(root.absolute(), "cache_dir")
    kv_dir = Path(engine_config.get("disk_cache_dir") or root / "kv").expanduser().absolute()
    engine_config["disk_cache_dir"] = check_dir_path(kv_dir, "disk_cache_dir")
    engine_config.setdefault("memory_budget_bytes", 256 << 20)
    from kvfuse.engine.config import EngineConfig

    EngineConfig(**engine_config)  # a bad field or value fails here, once

    try:
        import ray
    except ImportError as e:
        raise ImportError("precompute_corpus needs Ray: pip install 'kvfuse[distributed]'") from e
    started = False
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, configure_logging=True, logging_level="warning")
        started = True
    try:
        return _run(ray, corpus, model, root, kv_dir, engine_config, num_workers, batch_size, device, dtype,
                    strategy, threads_per_worker, max_retries, show_progress)
    finally:
        if started:
            ray.shutdown()


def _run(ray, corpus: Corpus, model: str, root: Path, kv_dir: Path, engine_config: dict[str, Any],
         num_workers: int | None, batch_size: int, device: str | None, dtype: str | None, strategy: str | None,
         threads: int | None, max_retries: int, show_progress: bool) -> CorpusReport:
    import ray.data
    from ray.exceptions import RayError

    t0 = time.perf_counter()
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), float(resources.get("CPU", 1))
    use_gpus = gpus > 0 and (device is None or str(device).startswith("cuda"))
    workers = num_workers or (gpus if use_gpus else max(1, int(cpus) // 8))
    read_cpus = 0.25  # reading is light: it must never wait for CPUs the actors hold
    if use_gpus:
        actor = {"num_gpus": 1, "num_cpus": min(1.0, max(0.1, (cpus - read_cpus) / workers))}
        device = "cuda"
    else:
        per = max(0.1, (cpus - read_cpus) / workers)
        actor = {"num_cpus": per}
        threads = threads or max(1, math.floor(per + 0.3))
        device = device or "cpu"
    engine_kwargs = {"device": device, "dtype": dtype, "cache_dir": str(root), **engine_config}
    before = _folder_bytes(kv_dir) if kv_dir.is_dir() else 0

    ctx = ray.data.DataContext.get_current()
    saved = ctx.enable_progress_bars
    if show_progress:
        ctx.enable_progress_bars = False  # ours counts documents
    bar = _progress(corpus.documents, show_progress)
    totals = dict(documents=0, hits=0, misses=0, tokens=0, seconds=0.0, batches=0)
    pids: set[int] = set()
    try:
        ds = _map(_dataset(corpus, read_cpus), dict(
            fn=_PrecomputeWorker, fn_constructor_args=(model, engine_kwargs, strategy, threads),
            batch_size=batch_size, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=workers), **actor),
            max_retries)
        for row in ds.iter_rows():
            for k in ("documents", "hits", "misses", "tokens"):
                totals[k] += int(row[k])
            totals["seconds"] += float(row["seconds"])
            totals["batches"] += 1
            pids.add(int(row["worker"]))
            if bar is not None:
                bar.update(int(row["documents"]))
    except RayError as e:
        raise RuntimeError(f"the Ray precompute job failed: {_first_line(e)}") from e
    finally:
        ctx.enable_progress_bars = saved
        if bar is not None:
            bar.close()
    after = _folder_bytes(kv_dir) if kv_dir.is_dir() else 0
    return CorpusReport(documents=totals["documents"], hits=totals["hits"], misses=totals["misses"],
                        tokens=totals["tokens"], seconds=time.perf_counter() - t0, bytes_written=max(0, after - before),
                        workers=workers, device="cuda" if use_gpus else "cpu", cache=str(kv_dir),
                        worker_seconds=totals["seconds"], batches=totals["batches"],
                        extra={"processes": len(pids)})


def _map(ds, kwargs: dict[str, Any], retries: int):
    """`ds.map_batches(**kwargs)` with actor restarts and batch retries bounded by `retries` (Ray Data's default is
    unbounded: a document that kills its actor every time would loop forever). Ray takes these as extra remote
    arguments, which it has announced it will stop accepting; without them the defaults stay."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ray_remote_args.* deprecated")
        try:
            return ds.map_batches(**kwargs, max_restarts=retries, max_task_retries=retries)
        except TypeError:
            return ds.map_batches(**kwargs)


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln and not ln.startswith(("File ", "Traceback"))]
    return (errors[-1] if errors else lines[0] if lines else type(e).__name__)[:500]

