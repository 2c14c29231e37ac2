"""`kvfuse demo`: full prefill, the fused default and the same with a guard, per bundled question."""
from __future__ import annotations

import re

import pytest

from kvfuse import cli


def _rows(out: str) -> list[tuple[str, str]]:
    """(label, answer) of every answer row."""
    return [(m.group(1).strip(), m.group(2)) for m in re.finditer(r"^  (\S.*?)\s+ttft .*?-> (.*?)(?:   \(|$)", out,
                                                                  re.M)]


def test_demo_shows_full_fused_and_guarded_rows(tiny_model, capsys):
    model = str(tiny_model("qwen2"))
    assert cli.main(["demo", "--model", model, "--device", "cpu", "--dtype", "fp32", "--max-new-tokens", "3",
                     "--strategy", "reuse", "--guard", "1e9"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert len(rows) == 3 * 3 and out.count("handed to full prefill at token 0") == 3
    for i in range(0, 9, 3):  # a guard above every margin: each guarded answer is full prefill's
        (full, a), (fused, _), (guarded, c) = rows[i:i + 3]
        assert full == "full" and fused == "reuse@15%" and guarded == "reuse@15% guard 1e+09" and c == a
    assert cli.main(["demo", "--model", model, "--device", "cpu", "--dtype", "fp32", "--max-new-tokens", "2",
                     "--strategy", "reuse", "--guard", "0"]) == 0
    assert len(_rows(capsys.readouterr().out)) == 3 * 2  # --guard 0: no guarded row


def test_a_bad_guard_is_refused_before_the_model_loads(capsys):
    assert cli.main(["demo", "--model", "/nonexistent", "--guard", "-1"]) != 0
    assert "--guard" in capsys.readouterr().err


def test_ask_takes_a_guard(tiny_model, tmp_path, capsys):
    import json

    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"id": f"d{i}", "text": t}) for i, t in enumerate(
        ["The Larkspur Observatory was built in 1887.", "Its first director was born in Dunmore."])))
    base = ["ask", "Where was the director born?", "--docs", str(docs), "--model", str(tiny_model("qwen2")),
            "--device", "cpu", "--dtype", "fp32", "--max-new-tokens", "3", "--strategy", "reuse",
            "--cache-dir", str(tmp_path / "cache")]
    assert cli.main([*base, "--guard-margin", "1e9"]) == 0
    assert "reuse handed to full prefill at token 0" in capsys.readouterr().err
    assert cli.main([*base, "--guard-margin", "-1"]) != 0
    assert "guard_margin" in capsys.readouterr().err
    probe = [a if a != "reuse" else "infoflow" for a in base]
    assert cli.main([*probe, "--guard-margin", "1e9", "--guard-at", "probe"]) == 0
    assert "infoflow handed to full prefill at token 0 (read at the question probe)" in capsys.readouterr().err
    assert cli.main([*base, "--guard-margin", "1", "--guard-at", "probe"]) != 0  # reuse runs no probe
    assert "runs none" in capsys.readouterr().err
