import json

import pytest

from kvfuse.evaluation.data import load_examples, read_jsonl, select_examples, smoke_data_path


def _row(i, ds, passages=None):
    return {"id": f"{ds}-{i}", "dataset": ds, "question": f"q{i}?", "answers": [f"a{i}"],
            "passages": passages or [{"id": f"p{i}", "title": f"T{i}", "text": f"text {i}"},
                                     {"id": f"u{i}", "title": "", "text": f"untitled {i}"}]}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_smoke_data_is_bundled_and_valid():
    exs = read_jsonl(smoke_data_path())
    assert len(exs) >= 2
    assert {e.dataset for e in exs} == {"2wikimqa"}
    ids = [set(pid for pid, _ in e.docs) for e in exs]
    assert ids[0] & ids[1], "the smoke examples share passages (exercises cache reuse)"


def test_docs_title_only_when_present(tmp_path):
    ex = read_jsonl(_write(tmp_path / "a.jsonl", [_row(0, "x")]))[0]
    assert ex.docs == [("p0", "T0\ntext 0"), ("u0", "untitled 0")]


def test_folder_filter_limit_and_seeded_shuffle(tmp_path):
    _write(tmp_path / "a.jsonl", [_row(i, "alpha") for i in range(30)])
    _write(tmp_path / "b.jsonl", [_row(i, "beta") for i in range(10)] + [_row(0, "alpha")])  # duplicate id
    (tmp_path / "notes.txt").write_text("ignored")
    all_ = read_jsonl(tmp_path)
    assert len(all_) == 40
    sel = load_examples(tmp_path, limit=5, seed=0)
    assert [e.dataset for e in sel] == ["alpha"] * 5 + ["beta"] * 5
    assert [e.id for e in sel] == [e.id for e in load_examples(tmp_path, limit=5, seed=0)]
    assert [e.id for e in sel] != [e.id for e in load_examples(tmp_path, limit=5, seed=1)]
    # the selection of one dataset does not depend on the other datasets being loaded
    only_beta = load_examples(tmp_path, datasets=["beta"], limit=5, seed=0)
    assert [e.id for e in only_beta] == [e.id for e in sel if e.dataset == "beta"]
    # nor on file order
    shuffled = list(reversed(all_))
    assert [e.id for e in select_examples(shuffled, limit=5, seed=0)] == [e.id for e in sel]
    # the order of --datasets is kept
    assert [e.dataset for e in load_examples(tmp_path, datasets=["beta", "alpha"], limit=1)] == ["beta", "alpha"]
    assert load_examples(tmp_path, limit=0) == []


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.pop("answers"), "missing field"),
    (lambda r: r.update(passages=[]), "passages"),
    (lambda r: r.update(question=""), "question"),
    (lambda r: r.update(answers=[1]), "answers"),
    (lambda r: r.update(passages=[{"id": "p", "title": "", "text": " "}]), "empty"),
])
def test_schema_errors_are_one_line_value_errors(tmp_path, mutate, message):
    row = _row(0, "x")
    mutate(row)
    with pytest.raises(ValueError, match=message) as ei:
        read_jsonl(_write(tmp_path / "bad.jsonl", [row]))
    assert "bad.jsonl:1" in str(ei.value) and "\n" not in str(ei.value)


def test_bad_paths_and_unknown_dataset(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        read_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="no .jsonl"):
        read_jsonl(tmp_path)
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="invalid JSON"):
        read_jsonl(tmp_path / "broken.jsonl")
    _write(tmp_path / "broken.jsonl", [_row(0, "x")])
    with pytest.raises(ValueError, match="unknown dataset.*nope.*has x"):
        load_examples(tmp_path, datasets=["nope"])


def test_missing_passage_id_is_content_hash(tmp_path):
    import hashlib

    row = _row(0, "x", passages=[{"title": "T", "text": "body"}])
    ex = read_jsonl(_write(tmp_path / "a.jsonl", [row]))[0]
    assert ex.docs[0][0] == "p" + hashlib.sha1(b"T\0body").hexdigest()[:16]


def test_skip_takes_the_next_slice_of_the_same_seeded_order(tmp_path):
    from kvfuse.evaluation.data import select_examples

    examples = read_jsonl(smoke_data_path()) * 1
    full = select_examples(examples, limit=None)
    assert select_examples(examples, skip=1, limit=1) == full[1:2]
    assert select_examples(examples, skip=len(full)) == []
    with pytest.raises(ValueError, match="--skip"):
        select_examples(examples, skip=-1)
