"""`kvfuse precompute FILE`: a progress bar on stderr when it is a terminal, --progress/--no-progress to choose."""
from __future__ import annotations

import json

import pytest

from kvfuse import cli
from kvfuse.engine.api import FusionEngine

DOCS = [
    {"id": "larkspur", "text": "The Larkspur Observatory was built in 1887 above the harbour town of Dunmore."},
    {"id": "quillon", "text": "The Quillon festival was founded in 1923 by Tomas Reyes.", "title": "Quillon"},
    {"id": "voss", "text": "Amelia Voss, its first director, measured the motion of double stars."},
]
BAR = "kvfuse precompute"  # the bar's description


@pytest.fixture
def docs_file(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps(d) + "\n" for d in DOCS), encoding="utf-8")
    return f


@pytest.fixture
def argv(tiny_model, docs_file, tmp_path):
    return ["precompute", str(docs_file), "--model", str(tiny_model("llama")), "--device", "cpu", "--dtype", "fp32",
            "--cache-dir", str(tmp_path / "cache")]


@pytest.fixture
def seen(monkeypatch):
    """Records the keywords every FusionEngine.precompute call gets (and still runs it)."""
    calls: list[dict] = []
    real = FusionEngine.precompute

    def spy(self, docs, *args, **kwargs):
        calls.append(kwargs)
        return real(self, docs, *args, **kwargs)

    monkeypatch.setattr(FusionEngine, "precompute", spy)
    return calls


def test_no_progress_prints_no_bar(argv, capsys, seen):
    assert cli.main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("3 documents: 3 computed")
    assert BAR not in out.err
    assert seen == [{"show_progress": False}]


def test_progress_draws_a_bar_on_stderr(argv, capsys, seen):
    assert cli.main([*argv, "--progress"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("3 documents: 3 computed")
    assert BAR in out.err and "3/3" in out.err, out.err
    assert BAR not in out.out
    assert seen == [{"show_progress": True}]
    assert cli.main([*argv, "--progress"]) == 0  # second run: everything cached, the bar still completes
    out = capsys.readouterr()
    assert out.out.startswith("3 documents: 0 computed") and "3 already cached" in out.out
    assert "3/3" in out.err


@pytest.mark.parametrize("tty", [True, False], ids=["tty", "not-a-tty"])
def test_default_follows_whether_stderr_is_a_terminal(argv, capsys, seen, monkeypatch, tty):
    monkeypatch.setattr(cli.sys.stderr, "isatty", lambda: tty, raising=False)
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    assert seen == [{"show_progress": tty}]
    assert (BAR in out.err) is tty


def test_flags_parse_and_are_documented(capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["precompute", "f.jsonl"]).progress is None
    assert parser.parse_args(["precompute", "f.jsonl", "--progress"]).progress is True
    assert parser.parse_args(["precompute", "f.jsonl", "--no-progress"]).progress is False
    with pytest.raises(SystemExit):
        parser.parse_args(["precompute", "--help"])
    assert "--progress, --no-progress" in capsys.readouterr().out


def test_a_closed_or_odd_stderr_counts_as_no_terminal(monkeypatch):
    class Odd:
        def isatty(self):
            raise ValueError("I/O operation on closed file")

    monkeypatch.setattr(cli.sys, "stderr", Odd())
    assert cli._stderr_is_tty() is False
    monkeypatch.setattr(cli.sys, "stderr", None)
    assert cli._stderr_is_tty() is False
