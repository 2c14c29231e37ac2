import csv
import math

import pytest

from kvfuse.evaluation.report import ALL_QA, PARETO_Y, pareto_y, plot_pareto, summarize, to_markdown, write_report


def _rec(ds, ex, strategy, ratio, score, fid=1.0, kl=0.0, ttft=0.1, frac=0.0, metric="f1"):
    return {"dataset": ds, "example_id": ex, "strategy": strategy, "ratio": ratio, "score": score,
            "fidelity": fid, "kl": kl, "ttft_s": ttft, "recompute_fraction": frac, "metric": metric}


@pytest.fixture
def records():
    recs = []
    for ds, full_scores, cb_scores in (("qa1", [1.0, 0.5], [0.5, 0.5]), ("qa2", [1.0, 1.0, 1.0, 0.0],
                                                                        [1.0, 0.0, 0.0, 0.0])):
        for i, (f, c) in enumerate(zip(full_scores, cb_scores)):
            recs.append(_rec(ds, f"{ds}-{i}", "full", 1.0, f, ttft=1.0, frac=1.0))
            recs.append(_rec(ds, f"{ds}-{i}", "cacheblend", 0.15, c, fid=0.5, kl=0.2, ttft=0.2, frac=0.15))
            recs.append(_rec(ds, f"{ds}-{i}", "reuse", 0.0, 0.0, fid=0.0, kl=1.0, ttft=0.1, frac=0.0))
    recs.append(_rec("qmsum", "s-0", "full", 1.0, 0.3, metric="rouge_l"))
    recs.append(_rec("qmsum", "s-0", "reuse", 0.0, 0.15, fid=0.2, kl=0.5, metric="rouge_l"))
    return recs


def test_summarize_rows_and_relative_scores(records):
    rows = summarize(records)
    key = {(r.dataset, r.strategy, r.ratio): r for r in rows}
    # order: QA datasets, then summaries, then the all-QA rows; full first within each
    assert [r.dataset for r in rows][:3] == ["qa1"] * 3 and rows[0].strategy == "full"
    assert [r.strategy for r in rows[:3]] == ["full", "cacheblend", "reuse"]
    assert rows[6].dataset == "qmsum" and rows[6].metric == "rouge_l"
    cb1 = key[("qa1", "cacheblend", 0.15)]
    assert cb1.n == 2 and cb1.score == pytest.approx(0.5)
    assert cb1.rel_full_pct == pytest.approx(100 * 0.5 / 0.75)
    assert cb1.score_lo <= cb1.score <= cb1.score_hi
    assert cb1.fidelity == pytest.approx(0.5) and cb1.kl == pytest.approx(0.2)
    assert cb1.ttft_s == pytest.approx(0.2) and cb1.recompute_fraction == pytest.approx(0.15)
    assert key[("qa1", "full", 1.0)].rel_full_pct == pytest.approx(100.0)
    assert key[("qmsum", "reuse", 0.0)].rel_full_pct == pytest.approx(50.0)
    # all-QA: macro over qa1 and qa2, summaries excluded
    allcb = key[(ALL_QA, "cacheblend", 0.15)]
    assert allcb.n == 6
    assert allcb.score == pytest.approx((0.5 + 0.25) / 2)
    assert allcb.rel_full_pct == pytest.approx(100 * ((0.5 + 0.25) / 2) / ((0.75 + 0.75) / 2))
    assert allcb.score_lo <= allcb.score <= allcb.score_hi
    assert (ALL_QA, "reuse", 0.0) in key and (ALL_QA, "full", 1.0) in key
    assert len(rows) == 6 + 2 + 3


def test_relative_is_undefined_when_full_scores_zero(tmp_path):
    recs = [_rec("d", "e", "full", 1.0, 0.0), _rec("d", "e", "reuse", 0.0, 0.0)]
    write_report(recs, tmp_path)  # the plot falls back to fidelity
    assert (tmp_path / "pareto.png").stat().st_size > 0
    rows = summarize(recs)
    assert all(math.isnan(r.rel_full_pct) for r in rows)
    assert "n/a" in to_markdown(rows)
    assert not any(r.dataset == ALL_QA for r in rows)  # a single QA dataset needs no average row


def test_write_report_files(tmp_path, records):
    rows, md = write_report(records, tmp_path, pareto_x="fraction")
    assert md.count("\n") == len(rows) + 2
    assert md.startswith("| dataset | strategy | ratio | n |")
    assert "| qa1 | cacheblend | 0.15 | 2 | f1 | 50.0 [" in md
    text = (tmp_path / "summary.md").read_text()
    assert text == md
    with open(tmp_path / "summary.csv") as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == len(rows) and float(table[1]["score"]) == pytest.approx(0.5)
    png = (tmp_path / "pareto.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    write_report(records, tmp_path / "t", pareto_x="ttft")
    assert (tmp_path / "t" / "pareto.png").exists()
    with pytest.raises(ValueError):
        write_report(records, tmp_path / "u", pareto_x="nope")


def test_empty_records_still_write(tmp_path):
    rows, md = write_report([], tmp_path)
    assert rows == [] and md.count("\n") == 2


def test_pareto_y_axis_choices(tmp_path, records):
    rows = summarize(records)
    cb = next(r for r in rows if (r.dataset, r.strategy, r.ratio) == ("qa1", "cacheblend", 0.15))
    assert pareto_y(cb, "score") == pytest.approx(cb.rel_full_pct)
    assert pareto_y(cb, "fidelity") == pytest.approx(100 * cb.fidelity)
    assert pareto_y(cb, "kl") == pytest.approx(cb.kl)
    assert pareto_y(cb, "score", use_fid=True) == pytest.approx(100 * cb.fidelity)
    assert len({pareto_y(cb, y) for y in PARETO_Y}) == 3  # the three axes really differ on this row
    for y in PARETO_Y:
        write_report(records, tmp_path / y, pareto_y=y)
        assert (tmp_path / y / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="pareto y axis"):
        plot_pareto(rows, tmp_path / "bad.png", y="f1")
