import argparse
import json

import pytest
from fake_engine import FakeEngine

from kvfuse.evaluation import add_eval_parser, run_eval
from kvfuse.evaluation.cli import main


def parse(*argv):
    parser = argparse.ArgumentParser(prog="kvfuse")
    sub = parser.add_subparsers(dest="command")
    add_eval_parser(sub)
    if "--adapter" not in argv:  # the fake engines here have no adapter (the default would name the shipped one)
        argv = (*argv, "--adapter", "none")
    return parser.parse_args(["eval", *argv])


def test_the_default_adapter_is_the_one_the_engine_would_load():
    """`--adapter` defaults to auto: the embedded model's shipped adapter (so eval measures what a user gets), none
    for a model without one; 'packaged' for such a model is a clear error before any work."""
    from kvfuse.engine.adapter import packaged_adapter
    from kvfuse.evaluation.cli import _adapter_for, _adapter_tag

    from kvfuse.engine.adapter import load_adapter

    shipped = _adapter_for("auto", "qwen2.5-coder-0.5b")
    assert shipped.digest == load_adapter(packaged_adapter("qwen2.5-coder-0.5b")).digest
    assert _adapter_tag(shipped) == "+adapter"
    assert _adapter_for("auto", "smollm2-135m") is None and _adapter_tag(None) == ""
    assert _adapter_for("none", "qwen2.5-coder-0.5b") is None
    with pytest.raises(ValueError, match="no fusion adapter is shipped"):
        _adapter_for("packaged", "smollm2-135m")


def test_runs_are_tagged_with_the_adapter_only_where_it_acts(tmp_path):
    """A strategy that reads caches runs with the adapter ('+adapter'); full and sift read none, so their runs are
    the base model's and keep their plain label (and share records with the runs without an adapter)."""
    from kvfuse.evaluation.runner import Config, EvalRunner

    r = EvalRunner(lambda: None, tmp_path, model="m", adapter_tag="+adapter")
    assert [r.label(Config(s, 0.15)) for s in ("full", "sift", "infoflow", "cacheblend:check_layer=2")] == \
        ["full", "sift", "infoflow+adapter", "cacheblend:check_layer=2+adapter"]
    plain = EvalRunner(lambda: None, tmp_path, model="m")
    assert plain.label(Config("infoflow", 0.15)) == "infoflow"


def test_parser_registers_eval_with_run_eval():
    args = parse("--data", "x.jsonl", "--ratios", "0.15,0.3", "--limit", "3")
    assert args.func is run_eval and args.ratios == "0.15,0.3" and args.limit == 3
    assert args.smoke is False and args.max_new_tokens is None


def test_run_eval_end_to_end_with_fake_engine(tmp_path, capsys):
    from kvfuse.evaluation.data import smoke_data_path

    args = parse("--data", str(smoke_data_path()), "--strategies", "reuse,cacheblend", "--ratios", "0.15,0.3",
                 "--out", str(tmp_path), "--no-progress", "--max-new-tokens", "4")
    assert run_eval(args, engine_factory=FakeEngine) == 0
    out = capsys.readouterr()
    assert "| 2wikimqa | cacheblend | 0.3 | 3 |" in out.out
    assert "served" in out.err
    for name in ("records.jsonl", "summary.csv", "summary.md", "pareto.png", "run_stats.json"):
        assert (tmp_path / name).stat().st_size > 0
    recs = [json.loads(l) for l in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(recs) == 3 * 4 and all(r["max_new_tokens"] == 4 and r["model"] == "qwen2.5-coder-0.5b" for r in recs)
    # the report covers the current selection only
    args = parse("--data", str(smoke_data_path()), "--strategies", "reuse", "--limit", "1", "--out", str(tmp_path),
                 "--no-progress", "--max-new-tokens", "4")
    assert run_eval(args, engine_factory=lambda: pytest.fail("nothing should run")) == 0
    md = (tmp_path / "summary.md").read_text()
    assert md.count("\n") == 2 + 2 and "cacheblend" not in md


def test_smoke_mode_bookkeeping_with_fake_engine(tmp_path, capsys):
    # the real proof is test_eval_smoke.py; this checks the smoke assertions themselves
    assert run_eval(parse("--smoke", "--out", str(tmp_path), "--no-progress"), engine_factory=FakeEngine) == 0
    err = capsys.readouterr().err
    assert "SMOKE OK" in err and "resume skipped 8/8" in err


def test_smoke_mode_reports_failures(tmp_path, capsys):
    class Broken(FakeEngine):
        def generate(self, *a, **kw):
            r = super().generate(*a, **kw)
            r.ttft_s = float("nan")
            return r

    assert run_eval(parse("--smoke", "--out", str(tmp_path), "--no-progress"), engine_factory=Broken) == 1
    assert "ttft_s = None is not finite" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    ((), "--data is required"),
    (("--data", "/nonexistent/x.jsonl"), "no such file"),
    (("--smoke", "--ratios", "0"), r"not in \(0, 1\]"),
    (("--smoke", "--ratios", "abc"), "not a number"),
    (("--smoke", "--ratios", ","), "empty list"),
    (("--smoke", "--guard", "0"), r"--guard: 0 is not a margin > 0"),
    (("--smoke", "--guard", "x"), r"--guard: 'x' is not a number"),
    (("--smoke", "--guard", "1", "--guard-tokens", "0"), r"--guard-tokens must be >= 1"),
    (("--smoke", "--guard", "1", "--guard-at", "probe", "--guard-tokens", "1"), r"--guard-at probe reads no answer"),
    (("--smoke", "--limit", "-1"), "--limit"),
    (("--smoke", "--skip", "-1"), "--skip"),
    (("--smoke", "--max-new-tokens", "0"), "--max-new-tokens"),
    (("--smoke", "--datasets", "nope"), "unknown dataset"),
    (("--smoke", "--strategies", "full,nosuch"), "unknown strategy"),
    (("--smoke", "--report-only"), "do not combine"),
])
def test_bad_input_is_one_value_error(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message) as ei:
        run_eval(parse(*argv, "--out", str(tmp_path)), engine_factory=FakeEngine)
    assert "\n" not in str(ei.value)


def test_standalone_main_prints_one_line(tmp_path, capsys):
    assert main(["--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvfuse eval: error: --data") and "no such file" in err[-1]


def test_smoke_without_out_cleans_its_temporary_folder(capsys):
    assert run_eval(parse("--smoke", "--no-progress"), engine_factory=FakeEngine) == 0
    err = capsys.readouterr().err
    folder = err.split("removed the temporary ")[1].split(";")[0]
    import os

    assert not os.path.exists(folder)


def test_bad_smoke_input_leaves_no_temporary_folder(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for argv in (("--smoke", "--ratios", "2"), ("--smoke", "--strategies", "nosuch"), ("--smoke", "--datasets", "x")):
        with pytest.raises(ValueError):
            run_eval(parse(*argv), engine_factory=FakeEngine)
    assert list(tmp_path.iterdir()) == []


def test_report_only_runs_nothing_and_reports_what_is_on_record(tmp_path, capsys):
    from kvfuse.evaluation.data import smoke_data_path

    data = str(smoke_data_path())
    common = ("--data", data, "--out", str(tmp_path), "--no-progress", "--max-new-tokens", "4")
    assert run_eval(parse(*common, "--strategies", "reuse,cacheblend", "--ratios", "0.15"),
                    engine_factory=FakeEngine) == 0
    stats_before = (tmp_path / "run_stats.json").read_text()
    capsys.readouterr()
    # ratio 0.3 was never run: it is left out (not computed), and the rest is reported
    args = parse(*common, "--strategies", "reuse,cacheblend", "--ratios", "0.15,0.3", "--report-only",
                 "--pareto-y", "kl")
    assert run_eval(args, engine_factory=lambda: pytest.fail("report-only must not load an engine")) == 0
    out = capsys.readouterr()
    assert "report only: 9 of 12 selected runs on record" in out.err
    md = (tmp_path / "summary.md").read_text()
    assert "| cacheblend | 0.15 |" in md and "| cacheblend | 0.3 |" not in md
    assert (tmp_path / "run_stats.json").read_text() == stats_before  # the run's own stats are kept
    with pytest.raises(ValueError, match="none of the selected runs"):
        run_eval(parse("--data", data, "--out", str(tmp_path), "--max-new-tokens", "8", "--report-only"),
                 engine_factory=FakeEngine)  # another token budget: nothing of it is on record


def test_runs_with_and_without_an_adapter_are_reported_side_by_side(tmp_path, capsys):
    """--adapter none, then an adapter file: its runs are recorded as '<strategy>+adapter', full is not rerun (the
    base model either way), and the report lists both variants; a bad adapter file fails before any work."""
    import torch

    from kvfuse.engine.adapter import FusionAdapter
    from kvfuse.evaluation.data import smoke_data_path

    class _Dec:  # the shapes FusionAdapter.init reads
        class spec:
            n_layers, hidden, n_heads, n_kv_heads, head_dim = 2, 8, 2, 1, 4
        layers = [type("L", (), {"w_up": torch.zeros(16, 8)})()]
        device = torch.device("cpu")

    path = FusionAdapter.init(_Dec, rank=2, targets=("k", "v")).save(tmp_path / "ad.safetensors")
    common = ("--data", str(smoke_data_path()), "--strategies", "reuse", "--ratios", "0.15", "--out",
              str(tmp_path / "out"), "--no-progress", "--max-new-tokens", "4")
    assert run_eval(parse(*common, "--adapter", "none"), engine_factory=FakeEngine) == 0
    calls = []

    def factory():
        calls.append(1)
        return FakeEngine()

    assert run_eval(parse(*common, "--adapter", str(path)), engine_factory=factory) == 0
    recs = [json.loads(l) for l in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert sorted({r["strategy"] for r in recs}) == ["full", "reuse", "reuse+adapter"]
    assert sum(r["strategy"] == "full" for r in recs) == 3  # full ran once per example, in the first run only
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| reuse+adapter |" in md and "| reuse |" in md
    assert all(r["adapter_digest"] for r in recs if r["strategy"] == "reuse+adapter")
    assert not any("adapter_digest" in r for r in recs if r["strategy"] != "reuse+adapter")
    # the same adapter again resumes (nothing to run); another adapter into the same folder is refused before any
    # work: its runs would be taken as done and reported under the first adapter's label
    assert run_eval(parse(*common, "--adapter", str(path)), engine_factory=lambda: pytest.fail("no work")) == 0
    other = FusionAdapter.init(_Dec, rank=3, targets=("k", "v")).save(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="already holds 'reuse\\+adapter' runs made with an adapter of digest"):
        run_eval(parse(*common, "--adapter", str(other)), engine_factory=lambda: pytest.fail("no work"))
    assert len((tmp_path / "out" / "records.jsonl").read_text().splitlines()) == len(recs)  # nothing written
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a readable adapter"):
        run_eval(parse(*common, "--adapter", str(bad)), engine_factory=lambda: pytest.fail("no work"))


def test_guarded_runs_are_reported_beside_the_unguarded_ones(tmp_path, capsys, tiny_engine):
    from kvfuse.evaluation.data import smoke_data_path

    args = parse("--data", str(smoke_data_path()), "--strategies", "reuse", "--guard", "1000", "--adapter", "none",
                 "--out", str(tmp_path), "--no-progress", "--max-new-tokens", "3")
    assert run_eval(args, engine_factory=lambda: tiny_engine("qwen2")) == 0
    md = (tmp_path / "summary.md").read_text()
    rows = {line.split("|")[2].strip(): line for line in md.splitlines() if line.startswith("| 2wikimqa")}
    assert set(rows) == {"full", "reuse", "reuse+guard1000"}
    guarded = rows["reuse+guard1000"].split("|")
    assert guarded[8].strip().startswith("100.0") and guarded[-2].strip() == "100.0%"  # full's answers, all recomputed
    assert rows["reuse"].split("|")[-2].strip() == "0.0%"
