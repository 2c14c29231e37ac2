"""Every bad input is one clear error before any work: a ValueError naming the problem from the engine (no prefill,
no cache lookup or write), or from the CLI one `kvfuse: error: ...` line on stderr and exit status 2, no traceback,
raised before any model is loaded. Valid inputs next to the bad ones still work, and lose nothing."""
from __future__ import annotations

import contextlib
import json
import math
import re

import numpy as np
import pytest
import torch
from cases import DOCS, QUESTION

from kvfuse import cli
from kvfuse.engine.config import EngineConfig
from kvfuse.engine.prompt import PROMPT_PRESETS, PromptBuilder, PromptFormat
from kvfuse.engine.types import Document, as_documents

NAN, INF = float("nan"), float("inf")


@contextlib.contextmanager
def no_work(engine):
    """Fails the test when the block prefills, decodes, or touches the cache store."""
    before = engine.cache_stats()
    calls = []

    def refuse(name):
        def f(*a, **kw):
            calls.append(name)
            raise AssertionError(f"work started ({name}) before the input was rejected")
        return f

    saved = {(engine.runner, "prefill"): engine.runner.prefill, (engine.decoding, "step"): engine.decoding.step,
             (engine.decoding, "extend"): engine.decoding.extend}
    saved_store = {n: getattr(engine.store, n) for n in ("lookup", "put")}
    for obj, n in saved:
        setattr(obj, n, refuse(f"{type(obj).__name__}.{n}"))
    for n in saved_store:
        setattr(engine.store, n, refuse(f"store.{n}"))
    try:
        yield
    finally:
        for (obj, n), f in saved.items():
            setattr(obj, n, f)
        for n, f in saved_store.items():
            setattr(engine.store, n, f)
    assert calls == []
    assert engine.cache_stats() == before


# -- engine API --------------------------------------------------------------------------------------------------
BAD_GENERATE = [
    (dict(max_new_tokens=1.5), "max_new_tokens must be an int"),
    (dict(max_new_tokens=True), "max_new_tokens must be an int"),
    (dict(max_new_tokens="3"), "max_new_tokens must be an int"),
    (dict(max_new_tokens=None), "max_new_tokens must be an int"),
    (dict(max_new_tokens=-2), "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=10 ** 12), "max_new_tokens must be <="),
    (dict(temperature=NAN), "temperature must be finite"),
    (dict(temperature=INF), "temperature must be finite"),
    (dict(temperature=-INF), "temperature must be finite"),
    (dict(temperature="0.7"), "temperature must be a number"),
    (dict(temperature=-0.5), r"temperature must be in \[0"),
    (dict(top_p=NAN), "top_p must be finite"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.01), r"top_p must be in \(0, 1\]"),
    (dict(recompute_ratio=True), "recompute_ratio must be a number"),
    (dict(recompute_ratio="0.5"), "recompute_ratio must be a number"),
    (dict(recompute_ratio=NAN), "recompute_ratio must be finite"),
    (dict(recompute_ratio=-0.01), r"recompute_ratio must be in \[0, 1\]"),
    (dict(stop=5), "stop must be a string or a list"),
    (dict(stop={"River"}), "stop must be a string or a list"),
    (dict(stop=""), "stop is an empty string"),
    (dict(stop=["ok", ""]), r"stop\[1\] is an empty string"),
    (dict(stop=["ok", 3]), r"stop\[1\] must be a string"),
    (dict(stop=["\ud800"]), r"stop\[0\] contains a lone surrogate"),
    (dict(seed=1.5), "seed must be None or an int"),
    (dict(seed="7"), "seed must be None or an int"),
    (dict(seed=True), "seed must be None or an int"),
    (dict(seed=2 ** 64), "seed must be None or an int"),
    (dict(teacher_ids=[1, 2.0]), r"teacher_ids\[1\] must be a token id"),
    (dict(teacher_ids=[-1]), r"teacher_ids\[0\] must be a token id"),
    (dict(teacher_ids=[49152]), r"teacher_ids\[0\] must be a token id, an int in \[0, 49152\)"),
    (dict(teacher_ids=[True]), r"teacher_ids\[0\] must be a token id"),
    (dict(teacher_ids="12"), "teacher_ids must be a list of token ids"),
    (dict(teacher_ids=7), "teacher_ids must be a list of token ids"),
    (dict(return_logprobs="yes"), "return_logprobs must be True or False"),
    (dict(strategy=3), "strategy must be a strategy name"),
    (dict(strategy=["full"]), "strategy must be a strategy name"),
    (dict(strategy="cacheblend", no_such_option=1), "strategy 'cacheblend'"),
    (dict(question="Where?\ud800"), "the question contains a lone surrogate"),
    (dict(question=42), "the question must be a string"),
    (dict(question=" \n"), "the question is empty"),
    (dict(docs=5), "docs must be a list"),
    (dict(docs={"a": "text"}), "docs must be a list"),
    (dict(docs=[("a", "text \udfff")]), "document 'a': text contains a lone surrogate"),
    (dict(docs=[("\ud83d", "text")]), "document id '\\\\ud83d' contains a lone surrogate"),
    (dict(docs=[(1.5, "text")]), r"docs\[0\] id must be a string or an int"),
    (dict(docs=[(None, "text")]), r"docs\[0\] id must be a string or an int"),
    (dict(docs=[{"id": "a", "text": 5, "title": "T"}]), r"docs\[0\]: 'text' must be a string"),
    (dict(docs=[{"id": "a", "text": "t", "title": 5}]), r"docs\[0\]: 'title' must be a string"),
    (dict(docs=[{"id": ["a"], "text": "t"}]), r"docs\[0\] id must be a string or an int"),
]


@pytest.fixture(scope="module")
def warm_engine():
    """One tiny engine for the rejection cases (each checks that it is left as it was), first document cached."""
    from fixtures import load_tiny

    from kvfuse.engine.api import FusionEngine

    model, tok, info = load_tiny("llama", dtype=torch.float32)
    engine = FusionEngine(model, tok, EngineConfig(), model_name=info.name, model_fingerprint=info.fingerprint,
                          tokenizer_fingerprint=info.tokenizer_fingerprint)
    engine.precompute(DOCS[:1])  # a warm cache: a lookup would count a hit
    yield engine
    engine.close()


@pytest.mark.parametrize("kwargs,match", BAD_GENERATE, ids=[m for _, m in BAD_GENERATE])
def test_bad_generate_argument_is_one_value_error_before_any_work(warm_engine, kwargs, match):
    engine = warm_engine
    for call in (engine.generate, engine.stream):  # stream() raises at the call, not at the first next()
        args = dict(question=QUESTION, docs=DOCS, strategy="reuse", max_new_tokens=2)
        args.update(kwargs)
        with no_work(engine), pytest.raises(ValueError, match=match) as ei:
            call(args.pop("question"), args.pop("docs"), **args)
        assert "\n" not in str(ei.value)
    r = engine.generate(QUESTION, DOCS[:1], strategy="reuse", max_new_tokens=1)  # nothing held, nothing lost
    assert (r.cache_hits, r.cache_misses) == (1, 0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(target_ids=[]), "target_ids is empty"),
    (dict(target_ids=[0.5]), r"target_ids\[0\] must be a token id"),
    (dict(target_ids=[49152]), r"target_ids\[0\] must be a token id"),
    (dict(target_ids=[-3]), r"target_ids\[0\] must be a token id"),
    (dict(target_ids="abc"), "target_ids must be a list"),
    (dict(target_ids=list(range(5000))), "more than fit the context window"),
    (dict(recompute_ratio="0.5"), "recompute_ratio must be a number"),
    (dict(recompute_ratio=INF), "recompute_ratio must be finite"),
    (dict(strategy=None), "strategy must be a strategy name"),
    (dict(question=""), "the question is empty"),
    (dict(question="\udc80?"), "the question contains a lone surrogate"),
    (dict(docs=[("a", "fine"), ("b", 7)]), "document 'b': text must be a string"),
])
def test_bad_next_token_logprobs_argument_is_one_value_error_before_any_work(warm_engine, kwargs, match):
    engine = warm_engine
    args = dict(question=QUESTION, docs=DOCS, target_ids=[5, 6], strategy="reuse")
    args.update(kwargs)
    with no_work(engine), pytest.raises(ValueError, match=match):
        engine.next_token_logprobs(args.pop("question"), args.pop("docs"), args.pop("target_ids"), **args)


def test_valid_arguments_of_every_kind_still_work(tiny_engine):
    engine = tiny_engine("llama")
    ref = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=3)
    r = engine.generate(QUESTION, [(7, DOCS[0][1]), {"id": 0, "text": DOCS[1][1]}, DOCS[2]], strategy="reuse",
                        max_new_tokens=np.int64(3), recompute_ratio=1, temperature=0, top_p=np.float32(1.0),
                        seed=-5, teacher_ids=torch.tensor(ref.token_ids), stop=("never-in-the-answer",))
    assert r.token_ids == ref.token_ids and r.extra["teacher_logprobs"].shape[0] == len(ref.token_ids)
    lp = engine.next_token_logprobs(QUESTION, DOCS, (ref.token_ids[0],), strategy="full", recompute_ratio=0)
    assert lp.shape == (1, engine.decoder.spec.vocab) and math.isfinite(float(lp[0].max()))
    # tiny temperatures and nucleus masses are valid: they sample (in effect greedily), never fail on nan
    for temperature, top_p in ((5e-324, 1.0), (1e-30, 1e-300), (1e300, 0.5)):
        out = engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=2, temperature=temperature,
                              top_p=top_p, seed=1)
        assert len(out.token_ids) <= 2
    assert engine.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=2, temperature=5e-324,
                           seed=3).token_ids == ref.token_ids[:2]


def test_a_single_stop_string_is_one_stop_string_not_its_characters(tiny_engine):
    engine = tiny_engine("llama")
    free = engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=20).text
    # a stop string whose later characters occur before it: split into characters, it would cut earlier
    stop = next((free[k:k + n] for n in (2, 3, 4) for k in range(1, len(free) - n)
                 if free.find(free[k:k + n]) == k and min(free.find(c) for c in free[k:k + n]) < k), None)
    assert stop is not None, f"no usable stop string in {free!r}"
    cut = free.find(stop)
    for given in (stop, [stop], (stop,)):
        r = engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=20, stop=given)
        assert r.text == free[:cut] and r.finish_reason == "stop", (given, r.text)


# -- documents ---------------------------------------------------------------------------------------------------
def test_document_rejects_lone_surrogates_naming_the_document():
    with pytest.raises(ValueError, match=r"document 'doc-1': text contains a lone surrogate '\\udc00' at character 3"):
        Document("doc-1", "abc\udc00def")
    with pytest.raises(ValueError, match=r"document id 'x\\ud800' contains a lone surrogate"):
        Document("x\ud800", "text")
    assert Document("ok", "emoji \U0001F600 and \u2028 are fine").text.startswith("emoji")  # real pairs pass


def test_as_documents_ids_are_strings_or_ints_and_keep_falsy_ints():
    docs = as_documents([(3, "three"), ("b", "bee"), {"id": 0, "text": "zero"}, {"doc_id": 9, "text": "nine"},
                         {"text": "anonymous"}])
    assert [d.id for d in docs] == ["3", "b", "0", "9", "doc-4"]
    for bad in (True, 2.5, None, ("t",), b"bytes"):
        with pytest.raises(ValueError, match=r"docs\[1\] id must be a string or an int"):
            as_documents([("a", "fine"), (bad, "text")])
    with pytest.raises(ValueError, match=r"docs\[0\]: 'text' must be a string, got list"):
        as_documents([{"id": "a", "text": ["not", "text"], "title": "T"}])  # not silently joined into a string


# -- prompt format, engine config --------------------------------------------------------------------------------
@pytest.mark.parametrize("template,match", [
    ("Answer concisely.", "has no {question} field"),
    ("", "has no {question} field"),
    ("Q: {question} in {lang}", "has the field {lang}"),
    ("Q: {}", "has the field {}"),
    ("Q: {0}", "has the field {0}"),
    ("Q: {question!r}", "has the field {question!r}"),
    ("Q: {question:>20}", "has the field {question:>20}"),
    ("Q: {question.upper}", "has the field {question.upper}"),
    ("Q: {question", "not a valid format string"),
    ("Q: {question} }", "not a valid format string"),
    ("Q: {question} {", "not a valid format string"),
])
def test_prompt_format_rejects_templates_that_drop_or_break_the_question(template, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        PromptFormat(question_template=template)


def test_prompt_format_checks_its_other_fields():
    with pytest.raises(ValueError, match="PromptFormat.instruction must be a string"):
        PromptFormat(instruction=None)
    with pytest.raises(ValueError, match="PromptFormat.system_prompt contains a lone surrogate"):
        PromptFormat(system_prompt="be \ud800 brief")


def test_presets_and_literal_braces_keep_the_question(tiny_engine):
    engine = tiny_engine("llama")
    for name, fmt in PROMPT_PRESETS.items():
        again = PromptFormat(**vars(fmt))  # revalidates
        assert "QQ-MARK" in again.question_template.format(question="QQ-MARK"), name
    fmt = PromptFormat(question_template="{{json}} {question} {{}}")
    tail = engine.tokenizer.decode(PromptBuilder(engine.tokenizer, fmt).encode_tail("Where?"))
    assert tail.startswith("{json} Where? {}"), tail
    assert EngineConfig(prompt=fmt).prompt is fmt


def test_engine_config_rejects_a_disk_cache_dir_that_is_not_a_folder(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="disk_cache_dir .* exists and is not a directory"):
        EngineConfig(disk_cache_dir=f)
    with pytest.raises(ValueError, match="disk_cache_dir .* cannot be created: .* is not a directory"):
        EngineConfig(disk_cache_dir=f / "kv")
    assert EngineConfig(disk_cache_dir=tmp_path / "new" / "kv").disk_cache_dir == tmp_path / "new" / "kv"


# -- CLI ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def no_engine(monkeypatch):
    """The CLI must fail before it loads a model."""
    def fail(args):
        raise AssertionError("the engine was built for bad input")
    monkeypatch.setattr(cli, "_engine", fail)
    import kvfuse.evaluation.runner as runner

    monkeypatch.setattr(runner, "load_engine", lambda *a, **kw: fail(None))


def cli_error(capsys, argv) -> str:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err)
    assert err.startswith("kvfuse: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


DOC_FILES = [
    ("num.json", "42", "the top level must be a list .* got a number"),
    ("str.json", '"text"', "the top level must be a list .* got a string"),
    ("docs.json", '{"documents": {"id": "a", "text": "t"}}', "'documents' must be a list .* got an object"),
    ("passages.json", '[{"question": "q", "passages": "text"}]', "item 1: 'passages' must be a list, got a string"),
    ("pstr.jsonl", '{"passages": [{"id": "a", "text": "t"}, "just text"]}',
     r"pstr.jsonl:1: passage 2: expected an object with id/text, got a string"),
    ("rec.json", '[{"id": "a", "text": "t"}, ["b", "u"]]', "item 2: expected an object .* got a list"),
    ("text.jsonl", '{"id": "a", "text": 12}', "text.jsonl:1: 'text' must be a string, got a number"),
    ("textnull.json", '[{"id": "a", "text": null}]', "'text' must be a string, got null"),
    ("ptext.jsonl", '{"passages": [{"id": "a", "text": {"x": 1}}]}', "passage 1: 'text' must be a string"),
    ("title.jsonl", '{"id": "a", "text": "t", "title": 3}', "'title' must be a string"),
    ("id.jsonl", '{"id": {"n": 1}, "text": "t"}', "'id' must be a string or a number, got an object"),
    ("idbool.jsonl", '{"id": true, "text": "t"}', "'id' must be a string or a number, got a boolean"),
    ("surr.jsonl", '{"id": "a", "text": "bad \\ud800 text"}', r"surr.jsonl:1: document 'a': text contains a lone"),
    ("surrid.json", '[{"id": "\\udfff", "text": "t"}]', r"item 1: document id .* contains a lone surrogate"),
    ("empty.jsonl", '{"id": "a", "text": "  "}', "document 'a': text is empty"),
    ("notext.jsonl", '{"id": "a"}', "has no 'text'"),
    ("nan.json", '[{"id": NaN, "text": "t"}]', "NaN is not valid JSON"),
    ("deep.json", "[" * 100000 + "]" * 100000, "nested too deeply"),
    ("dup.jsonl", '{"id": "a", "text": "one"}\n{"id": "a", "text": "two"}',
     "dup.jsonl:2: document id 'a' is also used by .*dup.jsonl:1 with a different text"),
    ("none.json", "[]", "no documents found"),
    ("lines.jsonl", '{"id": "a", "text": "t"}\n\n\n{"id": "b", "text": }\n', r"lines.jsonl:4: not valid JSON"),
    ("lines.json", '[\n{"id": "a", "text": "t"},\n\n{"id": "b" "text": "u"}]', r"not valid JSON \(.* at line 4"),
]


@pytest.mark.parametrize("name,content,match", DOC_FILES, ids=[n for n, _, _ in DOC_FILES])
@pytest.mark.parametrize("command", ["precompute", "ask"])
def test_cli_bad_documents_file_is_one_line_exit_2_before_any_model(tmp_path, capsys, no_engine, name, content,
                                                                     match, command):
    f = tmp_path / name
    f.write_text(content, encoding="utf-8", errors="surrogatepass")
    argv = ["precompute", str(f)] if command == "precompute" else ["ask", "Where?", "--docs", str(f)]
    err = cli_error(capsys, argv)
    assert re.search(match, err), err


def test_cli_non_utf8_file_names_the_line(tmp_path, capsys, no_engine):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(b'{"id": "a", "text": "fine"}\n\n{"id": "b", "text": "caf\xe9"}\n')
    err = cli_error(capsys, ["precompute", str(f)])
    assert "latin1.jsonl:3: not UTF-8 text (byte 0xe9" in err


@pytest.mark.parametrize("argv_tail,match", [
    (["--cache-dir", "{file}"], "--cache-dir '.*' exists and is not a directory"),
    (["--cache-dir", "{file}/sub"], "--cache-dir '.*' cannot be created: .* is not a directory"),
    (["--threads", "0"], "--threads must be >= 1"),
])
def test_cli_bad_model_options_fail_before_any_model(tmp_path, capsys, no_engine, argv_tail, match):
    file = tmp_path / "plain-file"
    file.write_text("not a folder")
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "a", "text": "fine"}))
    tail = [a.replace("{file}", str(file)) for a in argv_tail]
    for argv in (["precompute", str(docs), *tail], ["ask", "Where?", "--docs", str(docs), *tail]):
        assert re.search(match, cli_error(capsys, argv))


@pytest.mark.parametrize("argv,match", [
    (["ask", "   "], "the question is empty"),
    (["ask", "Where\udcff?"], "the question contains a lone surrogate"),
    (["ask", "Where?", "--ratio", "nan"], "--ratio must be finite"),
    (["ask", "Where?", "--ratio", "2"], r"--ratio must be in \[0, 1\]"),
    (["ask", "Where?", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["ask", "Where?", "--temperature", "inf"], "--temperature must be finite"),
    (["ask", "Where?", "--strategy", "nope"], "unknown strategy"),
])
def test_cli_bad_generation_options_fail_before_any_model(capsys, no_engine, argv, match):
    assert re.search(match, cli_error(capsys, argv))


def test_cli_eval_out_that_is_a_file_fails_before_any_model(tmp_path, capsys, no_engine):
    from kvfuse.evaluation.data import smoke_data_path

    out = tmp_path / "results"
    out.write_text("an earlier file, kept")
    err = cli_error(capsys, ["eval", "--data", str(smoke_data_path()), "--out", str(out), "--no-progress"])
    assert "--out" in err and "exists and is not a directory" in err
    assert out.read_text() == "an earlier file, kept"


def test_cli_good_file_loses_nothing(tmp_path, capsys, monkeypatch, tiny_engine):
    """Blank lines, CRLF, a BOM, U+2028 inside a text, int ids, passages records and a repeated identical document
    all load; every distinct document is computed."""
    lines = ['{"id": "a", "text": "first line\u2028same record"}', "",
             '{"passages": [{"id": 7, "title": "T", "text": "seven"}, {"id": "a", "text": "first line\u2028same '
             'record"}]}', '{"text": "no id here"}', ""]
    f = tmp_path / "good.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode("utf-8"))
    docs = cli._load_docs(str(f))
    assert docs == [{"id": "a", "text": "first line\u2028same record", "title": ""},
                    {"id": "7", "text": "seven", "title": "T"},
                    {"id": "good-2", "text": "no id here", "title": ""}]
    engine = tiny_engine("llama")
    monkeypatch.setattr(cli, "_engine", lambda args: engine)
    assert cli.main(["precompute", str(f)]) == 0
    assert capsys.readouterr().out.startswith("3 documents: 3 computed")
