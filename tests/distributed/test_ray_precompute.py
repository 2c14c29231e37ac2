"""Corpus precompute on Ray (kvfuse.distributed): a real local Ray cluster on the CPU, the tiny llama model.

The cluster is started once for the module (2 CPUs, a 200 MB object store, no dashboard). Its workers run
`ray_faults.install` at start (see ray_faults.py): a test writes a plan file to kill an actor mid-batch.
The input checks run without Ray.
"""
from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest

from kvfuse import cli
from kvfuse.distributed import CorpusError, precompute_corpus, read_corpus
from kvfuse.engine.store import content_key
from kvfuse.engine.store.disk import DiskTier
from kvfuse.engine.types import Document

HERE = Path(__file__).resolve().parent
TOPICS = ["observatory", "harbour", "festival", "lighthouse", "railway", "orchard", "bridge", "library",
          "glacier", "market"]
DOCS = [{"id": f"doc-{i:02d}",
         "text": f"Record {i}: the {TOPICS[i % 10]} of Dunmore was surveyed in {1850 + 7 * i} by team {i % 4}; "
                 f"its ledger lists {3 * i + 2} entries."}
        for i in range(30)]
DOCS[3]["title"] = "A titled record"


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def corpus(tmp_path) -> Path:
    return _jsonl(tmp_path / "corpus.jsonl", DOCS)


# ------------------------------------------------------------------------------------------ the cluster
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray cluster for the module; yields the fault plan path its workers read."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (the distributed extra)")
    plan = tmp_path_factory.mktemp("faults") / "plan.json"
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    try:
        ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, object_store_memory=200 * 1024 * 1024,
                 logging_level="warning",
                 runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "KVFUSE_TEST_FAULT_PLAN": str(plan),
                                           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
                              "worker_process_setup_hook": "ray_faults.install"})
    except Exception as e:  # noqa: BLE001 - any reason Ray can't run here
        pytest.skip(f"a local Ray cluster can't start here: {type(e).__name__}: {e}")
    try:
        yield plan
    finally:
        ray.shutdown()


def _run(corpus, cache, tiny_model, **kw):
    kw = {"num_workers": 2, "batch_size": 4, **kw}
    return precompute_corpus(corpus, model=str(tiny_model("llama")), cache_dir=str(cache), device="cpu",
                             dtype="fp32", **kw)


def _engine(tiny_model, cache=None):
    from kvfuse.engine.api import FusionEngine

    if cache is None:
        return FusionEngine.from_pretrained(str(tiny_model("llama")), device="cpu", dtype="fp32", disk_cache=False)
    return FusionEngine.from_pretrained(str(tiny_model("llama")), device="cpu", dtype="fp32", cache_dir=str(cache))


def _kv_keys(folder: Path) -> list[str]:
    """The content keys of every K/V entry in a disk cache folder (one row per key)."""
    con = sqlite3.connect(f"file:{folder / 'cache.db'}?mode=ro", uri=True)
    try:
        return [k[3:] for (k,) in con.execute("SELECT key FROM Cache WHERE key LIKE 'kv:%'")]
    finally:
        con.close()


def _expected_keys(engine, docs) -> set[str]:
    p = engine.prompts
    return {content_key(engine.namespace, p.prefix_ids, p.encode_document(Document(d["id"], d["text"])))
            for d in docs}


def _check_cached_once(cache: Path, tiny_model) -> None:
    """Every document is in the folder exactly once (and nothing else but the prompt prefix), no orphan file; a
    fresh engine over it finds all of them."""
    engine = _engine(tiny_model, cache)
    try:
        keys = _kv_keys(cache / "kv")
        assert len(keys) == len(set(keys))
        assert set(keys) == _expected_keys(engine, DOCS) | {engine.doc_cache.prefix_key}
        assert len(keys) == len({d["text"] for d in DOCS}) + 1  # + the prompt prefix
        assert DiskTier(cache / "kv", 1 << 30).orphans() == []
        rep = engine.precompute(DOCS)
        assert (rep.hits, rep.misses, rep.tokens) == (len(DOCS), 0, 0)
    finally:
        engine.close()


# --------------------------------------------------------------------------------------------------- the job
@pytest.mark.slow
def test_every_document_ends_up_cached_and_serves_as_computed_cold(cluster, corpus, tmp_path, tiny_model):
    import torch

    cache = tmp_path / "cache"
    rep = _run(corpus, cache, tiny_model)
    assert (rep.documents, rep.misses, rep.hits) == (30, 30, 0)
    assert rep.tokens > 30 and rep.bytes_written > 0 and rep.docs_per_s > 0 and rep.tokens_per_s > 0
    assert rep.workers == 2 and rep.device == "cpu" and rep.batches >= 8
    assert rep.cache == str(cache / "kv")
    assert "30 documents: 30 computed" in rep.summary() and "documents/s" in rep.summary()
    _check_cached_once(cache, tiny_model)

    warm, cold = _engine(tiny_model, cache), _engine(tiny_model)
    try:
        for d in DOCS:  # the stored K/V is what a cold engine computes
            doc = Document(d["id"], d["text"])
            ids = warm.prompts.encode_document(doc)
            kv = warm.store.lookup(None, content_key(warm.namespace, warm.prompts.prefix_ids, ids), len(ids))
            ref = cold.doc_cache.compute(ids)
            torch.testing.assert_close(kv.k, ref.k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(kv.v, ref.v, rtol=1e-5, atol=1e-5)
        for i in range(0, 9, 3):  # and answers from it are the tokens of computing the documents cold
            docs = DOCS[i:i + 3]
            a = warm.generate("Who surveyed the harbour?", docs, max_new_tokens=8, recompute_ratio=0.15)
            b = cold.generate("Who surveyed the harbour?", docs, max_new_tokens=8, recompute_ratio=0.15)
            assert a.cache_misses == 0 and a.cache_hits == 3 and b.cache_misses == 3
            assert a.token_ids == b.token_ids
    finally:
        warm.close()
        cold.close()


@pytest.mark.slow
def test_an_actor_killed_mid_batch_loses_nothing_and_duplicates_nothing(cluster, corpus, tmp_path, tiny_model):
    marker = tmp_path / "crashed"
    cluster.write_text(json.dumps({"marker": str(marker), "on_call": 2, "keep": 2}), encoding="utf-8")
    cache = tmp_path / "cache"
    try:
        rep = _run(corpus, cache, tiny_model)
    finally:
        cluster.unlink()
    assert marker.exists(), "no actor was killed"
    # the killed task was retried: what it had stored (the 2 documents of the killed batch, and the batches of 4 the
    # same task had finished before it) are hits, not computed again; nothing is computed twice
    assert rep.documents == 30 and rep.hits + rep.misses == 30
    assert rep.hits >= 2 and (rep.hits - 2) % 4 == 0, rep
    _check_cached_once(cache, tiny_model)

    files = sorted((cache / "kv").glob("??/??/*.val"))
    again = _run(corpus, cache, tiny_model)  # a rerun computes nothing
    assert (again.documents, again.hits, again.misses, again.tokens) == (30, 30, 0, 0)
    assert sorted((cache / "kv").glob("??/??/*.val")) == files  # no entry was written again
    _check_cached_once(cache, tiny_model)


@pytest.mark.slow
def test_cli_precompute_ray_prints_progress_and_throughput(cluster, corpus, tmp_path, tiny_model, capsys):
    argv = ["precompute", "--ray", "--input", str(corpus), "--model", str(tiny_model("llama")), "--device", "cpu",
            "--dtype", "fp32", "--cache-dir", str(tmp_path / "cache"), "--num-workers", "1", "--batch-size", "8",
            "--progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    # the report's own line (Ray may print its log lines, e.g. a worker it restarted, to the same stdout first)
    assert any(line.startswith("30 documents: 30 computed") for line in out.out.splitlines()), out
    assert "documents/s" in out.out and "tokens/s" in out.out and "written" in out.out
    assert "on 1 cpu worker:" in out.out
    assert "kvfuse precompute (ray)" in out.err and "30/30" in out.err, out.err


@pytest.mark.slow
def test_parquet_and_docstore_corpora_read_as_rows(cluster, tmp_path):
    """The readers behind the job (no model): Parquet and a LlamaIndex docstore give id/text/title rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvfuse.distributed.ray_precompute import _dataset

    pq.write_table(pa.table({"id": [d["id"] for d in DOCS], "text": [d["text"] for d in DOCS]}),
                   tmp_path / "c.parquet")
    c = read_corpus(tmp_path / "c.parquet")
    assert (c.format, c.documents, c.distinct) == ("parquet", 30, 30)
    rows = _dataset(c, 0.25).take_all()
    assert sorted((r["id"], r["text"]) for r in rows) == sorted((d["id"], d["text"]) for d in DOCS)

    llama = pytest.importorskip("llama_index.core")
    from llama_index.core.schema import TextNode
    from llama_index.core.storage.docstore import SimpleDocumentStore

    store = SimpleDocumentStore()
    store.add_documents([TextNode(id_=f"n{i}", text=d["text"], metadata={"source": "ledger"})
                         for i, d in enumerate(DOCS[:5])])
    store.persist(str(tmp_path / "persist" / "docstore.json"))
    c = read_corpus(tmp_path / "persist")
    assert (c.format, c.documents) == ("llama-index", 5)
    rows = _dataset(c, 0.25).take_all()
    assert sorted(r["text"] for r in rows) == sorted(d["text"] for d in DOCS[:5])  # keyed by the node body
    assert {r["title"].strip() for r in rows} == {"source: ledger"}  # the metadata header, as the integration
    del llama


@pytest.mark.slow
def test_jsonl_rows_read_by_ray_keep_lines_that_hold_unicode_separators(cluster, tmp_path):
    from kvfuse.distributed.ray_precompute import _dataset

    rows = [{"id": "a", "text": "one\u2028two\x1cthree"}, {"id": 7, "text": "seven"}]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + "\n\n", encoding="utf-8")
    c = read_corpus(path)
    assert c.documents == 2
    assert sorted((r["id"], r["text"]) for r in _dataset(c, 0.25).take_all()) == [("7", "seven"),
                                                                                  ("a", "one\u2028two\x1cthree")]


# ---------------------------------------------------------------------------------- checks before any work
@pytest.mark.parametrize("lines, message", [
    (['{"id": "a", "text": "fine"}', '{"id": "b", "text": '], r"corpus\.jsonl:2: not valid JSON"),
    (['{"id": "a", "text": "fine"}', "", '["a", "b"]'], r"corpus\.jsonl:3: expected an object"),
    (['{"text": "no id here"}'], r"corpus\.jsonl:1: has no 'id'"),
    (['{"id": "a"}'], r"corpus\.jsonl:1: has no 'text'"),
    (['{"id": "a", "text": "   "}'], r"corpus\.jsonl:1: .*text is empty"),
    (['{"id": "a", "text": 3}'], r"corpus\.jsonl:1: 'text' must be a string"),
    (['{"id": "a", "text": "one"}', '{"id": "a", "text": "two"}'],
     r"corpus\.jsonl:2: document id 'a' is also used by .*corpus\.jsonl:1 with a different text"),
    (["", "  "], r"no documents found"),
], ids=["bad-json", "not-an-object", "no-id", "no-text", "empty-text", "text-not-str", "id-reused", "empty"])
def test_bad_jsonl_is_named_before_any_work(tmp_path, lines, message):
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=message):
        read_corpus(path)


def test_other_bad_inputs(tmp_path):
    with pytest.raises(CorpusError, match="no such file"):
        read_corpus(tmp_path / "missing.jsonl")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CorpusError, match="can't tell the format"):
        read_corpus(tmp_path / "notes.txt")
    (tmp_path / "bad.jsonl").write_bytes(b'{"id": "a", "text": "caf\xe9"}\n')
    with pytest.raises(CorpusError, match=r"bad\.jsonl:1: not UTF-8"):
        read_corpus(tmp_path / "bad.jsonl")
    (tmp_path / "store.json").write_text(json.dumps({"docstore/data": {}}))
    with pytest.raises(CorpusError, match="holds no node"):
        read_corpus(tmp_path / "store.json", "llama-index")

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["a"], "body": ["x"]}), tmp_path / "nocol.parquet")
    with pytest.raises(CorpusError, match=r"nocol\.parquet: no 'text' column"):
        read_corpus(tmp_path / "nocol.parquet")
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["fine", None]}), tmp_path / "null.parquet")
    with pytest.raises(CorpusError, match=r"null\.parquet: row 2: has no 'text'"):
        read_corpus(tmp_path / "null.parquet")


def test_cli_reports_a_bad_corpus_in_one_line_without_starting_ray(tmp_path, capsys, monkeypatch, tiny_model):
    import kvfuse.distributed.ray_precompute as rp

    monkeypatch.setattr(rp, "precompute_corpus", lambda *a, **k: pytest.fail("the job started"))
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"id": "a", "text": "fine"}\n{"id": "b"\n', encoding="utf-8")
    argv = ["precompute", "--ray", "--input", str(path), "--model", str(tiny_model("llama"))]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvfuse: error: ") and "corpus.jsonl:2: not valid JSON" in err
    assert err.count("\n") == 1
    assert cli.main(["precompute", "--ray", "--input", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli.main(["precompute", "--input", str(path), "--num-workers", "2"]) == 2
    assert "--num-workers needs --ray" in capsys.readouterr().err
    assert cli.main(["precompute"]) == 2
    assert "no input" in capsys.readouterr().err


def test_bad_job_arguments_fail_before_ray(corpus, tiny_model):
    model = str(tiny_model("llama"))
    with pytest.raises(CorpusError, match="model 'no/such/model'"):
        precompute_corpus(corpus, model="no/such/model")
    with pytest.raises(CorpusError, match="batch_size"):
        precompute_corpus(corpus, model=model, batch_size=0)
    with pytest.raises(CorpusError, match="num_workers"):
        precompute_corpus(corpus, model=model, num_workers=0)
    with pytest.raises(CorpusError, match="disk_cache=False"):
        precompute_corpus(corpus, model=model, disk_cache=False)
    with pytest.raises(TypeError):
        precompute_corpus(corpus, model=model, no_such_option=1)
