"""benchmarks/fidelity_floor.py: the hand-over bound and the full-against-full table, on records written here."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def floor():
    spec = importlib.util.spec_from_file_location("fidelity_floor", ROOT / "benchmarks" / "fidelity_floor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rec(ex, strategy, ratio, fid, answer="a", score=0.0, ds="set"):
    return {"example_id": ex, "dataset": ds, "strategy": strategy, "ratio": ratio, "fidelity": fid,
            "answer": answer, "score": score}


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_hand_over_bound_hands_over_the_worst_within_the_budget(floor, tmp_path):
    # 20 examples; at 5% the fused fidelities are 0 (x4) and 1 (x16): within a 15% mean budget the oracle may hand
    # over floor(20 * 0.10 / 0.95) = 2 of them, the two zeros, so 18 of 20 answers read 1.
    fid5 = [0.0] * 4 + [1.0] * 16
    recs = [_rec(f"e{i}", "full", 1.0, 1.0) for i in range(20)]
    recs += [_rec(f"e{i}", "s", 0.05, f) for i, f in enumerate(fid5)]
    recs += [_rec(f"e{i}", "s", 0.15, 0.5) for i in range(20)]  # 50 at 15%, nothing to hand over there
    recs += [_rec(f"e{i}", "s", 0.5, 1.0) for i in range(20)]  # over the budget: never used
    runs = floor._load([_write(tmp_path / "r.jsonl", recs)])
    row = [ln for ln in floor.hand_over_bound(runs, "s", 0.15) if ln.startswith("| set ")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:] == ["90.0", "0.05", "2 of 20", "80.0"]
    # at a 5% budget nothing can be handed over from 5%, and the 15% point is over the budget
    row = [ln for ln in floor.hand_over_bound(runs, "s", 0.05) if ln.startswith("| set ")][0]
    assert [c.strip() for c in row.strip("|").split("|")][1:] == ["80.0", "0.05", "0 of 20", "80.0"]


def test_full_against_full_counts_flipped_answers(floor, tmp_path):
    a = [_rec(f"e{i}", "full", 1.0, 1.0, answer="Paris") for i in range(4)]
    b = [_rec(f"e{i}", "full", 1.0, 1.0, answer="Paris" if i else "Lyon") for i in range(4)]
    lines = floor.full_vs_full(_write(tmp_path / "a.jsonl", a), _write(tmp_path / "b.jsonl", b))
    row = [ln for ln in lines if ln.startswith("| set ")][0]
    assert [c.strip() for c in row.strip("|").split("|")] == ["set", "4", "3 (75.0%)", "75.0"]
