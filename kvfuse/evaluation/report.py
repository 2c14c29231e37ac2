"""Aggregates run records into the summary table (CSV, markdown) and the quality/cost Pareto plot.

One row per dataset x strategy x ratio: n, task score (F1, or ROUGE-L for summaries) with its bootstrap 95% CI,
score relative to full on the same examples (%), fidelity to the full answer with its CI, mean KL(full || strategy),
mean TTFT and mean recompute fraction. When two or more QA datasets are present, an "all QA" row per
strategy x ratio macro-averages them (each dataset weighs the same; the CI resamples within each dataset).
"""
from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from .metrics import bootstrap_ci

__all__ = ["SummaryRow", "summarize", "to_markdown", "write_csv", "plot_pareto", "write_report", "ALL_QA", "PARETO_Y", "pareto_y"]

ALL_QA = "all QA (macro)"
REFERENCE = "full"


@dataclass
class SummaryRow:
    dataset: str
    strategy: str
    ratio: float
    n: int
    metric: str
    score: float
    score_lo: float
    score_hi: float
    rel_full_pct: float  # mean score / mean full score on the same examples, in %
    fidelity: float
    fidelity_lo: float
    fidelity_hi: float
    kl: float
    ttft_s: float
    recompute_fraction: float


def _num(x: Any) -> float:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return math.nan
    return x


def _mean(xs: Iterable[Any]) -> float:
    vals = [v for v in (_num(x) for x in xs) if math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def _ratio(a: float, b: float) -> float:
    return 100.0 * a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan


def summarize(records: Sequence[dict[str, Any]], seed: int = 0, n_resamples: int = 1000) -> list[SummaryRow]:
    """The summary rows of `records` (one model and token budget; mixing them would mix results).

    Row order: datasets by name (QA first, summaries after, then the all-QA rows); within a dataset, strategies
    in order of first appearance (the runner writes `full` first), ratios ascending.
    """
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    strat_order: dict[str, int] = {}
    metric_of: dict[str, str] = {}
    for r in records:
        ratio = round(float(r["ratio"]), 4)
        groups.setdefault((r["dataset"], r["strategy"], ratio), []).append(r)
        strat_order.setdefault(r["strategy"], len(strat_order))
        metric_of.setdefault(r["dataset"], r.get("metric", "f1"))
    if REFERENCE in strat_order:
        strat_order[REFERENCE] = -1

    full_score: dict[tuple[str, str], float] = {}  # (dataset, example id) -> full's score
    for (ds, s, _), recs in groups.items():
        if s == REFERENCE:
            for r in recs:
                full_score[(ds, r["example_id"])] = _num(r["score"])

    def order(key: tuple[str, str, float]) -> tuple:
        ds, s, ratio = key
        return (metric_of[ds] != "f1", ds, strat_order[s], ratio)

    rows: list[SummaryRow] = []
    for key in sorted(groups, key=order):
        ds, s, ratio = key
        recs = groups[key]
        score = bootstrap_ci([_num(r["score"]) for r in recs], n_resamples, seed)
        fid = bootstrap_ci([_num(r["fidelity"]) for r in recs], n_resamples, seed)
        paired = [r for r in recs if (ds, r["example_id"]) in full_score]
        rel = _ratio(_mean(r["score"] for r in paired), _mean(full_score[(ds, r["example_id"])] for r in paired))
        rows.append(SummaryRow(ds, s, ratio, len(recs), metric_of[ds], *score, rel, *fid,
                               _mean(r.get("kl") for r in recs), _mean(r.get("ttft_s") for r in recs),
                               _mean(r.get("recompute_fraction") for r in recs)))

    qa_sets = sorted({ds for ds, m in metric_of.items() if m == "f1"})
    if len(qa_sets) >= 2:
        configs = sorted({(s, ratio) for (ds, s, ratio) in groups if ds in qa_sets},
                         key=lambda c: (strat_order[c[0]], c[1]))
        for s, ratio in configs:
            recs = [r for ds in qa_sets for r in groups.get((ds, s, ratio), [])]
            labels = [r["dataset"] for r in recs]
            score = bootstrap_ci([_num(r["score"]) for r in recs], n_resamples, seed, strata=labels)
            fid = bootstrap_ci([_num(r["fidelity"]) for r in recs], n_resamples, seed, strata=labels)
            # relative to full: macro mean over datasets of the paired means
            per_ds_s, per_ds_f = [], []
            for ds in qa_sets:
                paired = [r for r in groups.get((ds, s, ratio), []) if (ds, r["example_id"]) in full_score]
                if paired:
                    per_ds_s.append(_mean(r["score"] for r in paired))
                    per_ds_f.append(_mean(full_score[(ds, r["example_id"])] for r in paired))
            rel = _ratio(_mean(per_ds_s), _mean(per_ds_f))

            def macro(field_name: str) -> float:
                return _mean(_mean(r.get(field_name) for r in groups[(ds, s, ratio)])
                             for ds in qa_sets if (ds, s, ratio) in groups)

            rows.append(SummaryRow(ALL_QA, s, ratio, len(recs), "f1", *score, rel, *fid, macro("kl"),
                                   macro("ttft_s"), macro("recompute_fraction")))
    return rows


def _fmt(x: float, scale: float = 1.0, digits: int = 1) -> str:
    return "n/a" if not math.isfinite(x) else f"{x * scale:.{digits}f}"


def to_markdown(rows: Sequence[SummaryRow]) -> str:
    """A markdown table; scores and fidelity are shown x100, KL in nats, TTFT in seconds."""
    head = ["dataset", "strategy", "ratio", "n", "metric", "score [95% CI]", "vs full", "fidelity [95% CI]",
            "KL", "TTFT s", "recompute"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 4 + ["---"] + ["---:"] * 6) + "|"]
    for r in rows:
        score = f"{_fmt(r.score, 100)} [{_fmt(r.score_lo, 100)}, {_fmt(r.score_hi, 100)}]"
        fid = f"{_fmt(r.fidelity, 100)} [{_fmt(r.fidelity_lo, 100)}, {_fmt(r.fidelity_hi, 100)}]"
        rel = "n/a" if not math.isfinite(r.rel_full_pct) else f"{r.rel_full_pct:.1f}%"
        kl = "n/a" if not math.isfinite(r.kl) else f"{r.kl:.4f}"
        cells = [r.dataset, r.strategy, f"{r.ratio:g}", str(r.n), r.metric, score, rel, fid, kl,
                 _fmt(r.ttft_s, 1, 3), _fmt(r.recompute_fraction, 100, 1) + ("%" if math.isfinite(
                     r.recompute_fraction) else "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(rows: Sequence[SummaryRow], path: str | Path) -> None:
    """Raw values (scores in [0, 1]); empty cells for undefined values."""
    names = [f.name for f in fields(SummaryRow)]
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=names)
        w.writeheader()
        for r in rows:
            d = asdict(r)
            w.writerow({k: ("" if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()})


PARETO_Y = {"score": "score relative to full (%)", "fidelity": "fidelity to full answer (%)",
            "kl": "KL to full per answer token (nats)"}


def pareto_y(row: SummaryRow, y: str, use_fid: bool = False) -> float:
    """The y value of one summary row: "score" (relative to full, %; fidelity when `use_fid`), "fidelity" (%)
    or "kl"."""
    if y == "kl":
        return row.kl
    if y == "fidelity" or use_fid:
        return row.fidelity * 100
    return row.rel_full_pct


def plot_pareto(rows: Sequence[SummaryRow], path: str | Path, x: str = "fraction", y: str = "score") -> None:
    """Quality vs cost: one panel per dataset (and the all-QA average), one line per strategy across ratios.

    Args:
        x: "fraction" (mean recompute fraction) or "ttft" (mean time to first token).
        y: "score" (relative to full, %; a panel where full scores 0 throughout, so that is undefined, shows
            fidelity instead, titled accordingly), "fidelity" (F1 against full's answer, %; with a weak model
            the gold score is noisy and fidelity isolates what the strategy changed) or "kl" (lower is better).
    """
    if x not in ("fraction", "ttft"):
        raise ValueError(f"pareto x axis must be 'fraction' or 'ttft', got {x!r}")
    if y not in PARETO_Y:
        raise ValueError(f"pareto y axis must be one of {', '.join(PARETO_Y)}, got {y!r}")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(r.dataset for r in rows))
    if ALL_QA in panels:  # the average first: it is the headline
        panels.remove(ALL_QA)
        panels.insert(0, ALL_QA)
    n = max(1, len(panels))
    cols = min(3, n)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5.0 * cols, 3.8 * nrows), squeeze=False)
    strategies = list(dict.fromkeys(r.strategy for r in rows))
    cmap = plt.get_cmap("tab10")
    markers = "os^Dv<>pP*X"
    for i, ds in enumerate(panels):
        ax = axes[i // cols][i % cols]
        panel_rows = [r for r in rows if r.dataset == ds]
        # y: score relative to full; when full scores 0 on the whole panel (tiny models) that is undefined
        # everywhere, so the panel shows fidelity to the full answer instead, and says so.
        use_fid = y == "score" and not any(math.isfinite(r.rel_full_pct) for r in panel_rows)
        missing = plotted = 0
        for j, s in enumerate(strategies):
            pts = sorted((r for r in panel_rows if r.strategy == s),
                         key=lambda r: (r.recompute_fraction if x == "fraction" else r.ttft_s))
            xs, ys, labels = [], [], []
            for r in pts:
                xv = r.recompute_fraction * 100 if x == "fraction" else r.ttft_s
                yv = pareto_y(r, y, use_fid)
                if math.isfinite(xv) and math.isfinite(yv):
                    xs.append(xv)
                    ys.append(yv)
                    labels.append(f"{r.ratio:g}")
                else:
                    missing += 1
            if not xs:
                continue
            ax.plot(xs, ys, marker=markers[j % len(markers)], color=cmap(j % 10), label=s,
                    linestyle="-" if len(xs) > 1 else "none")
            plotted += 1
            if len(xs) > 1:
                for xv, yv, lab in zip(xs, ys, labels):
                    ax.annotate(lab, (xv, yv), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.axhline(0.0 if y == "kl" else 100.0, color="gray", linewidth=0.8, linestyle=":")
        ax.set_title(ds if not use_fid else f"{ds} (full scores 0: fidelity shown)", fontsize=10)
        ax.set_xlabel("recompute fraction (%)" if x == "fraction" else "mean TTFT (s)")
        ax.set_ylabel(PARETO_Y["fidelity" if use_fid else y])
        ax.grid(True, alpha=0.3)
        if missing:
            ax.text(0.02, 0.02, f"{missing} point(s) undefined", transform=ax.transAxes, fontsize=7, color="gray")
        if plotted:
            ax.legend(fontsize=8, loc="upper right" if y == "kl" else "lower right")
    for k in range(len(panels), nrows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(records: Sequence[dict[str, Any]], out_dir: str | Path, seed: int = 0,
                 pareto_x: str = "fraction", pareto_y: str = "score") -> tuple[list[SummaryRow], str]:
    """Writes summary.csv, summary.md and pareto.png into `out_dir`; returns the rows and the markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(records, seed=seed)
    md = to_markdown(rows)
    write_csv(rows, out / "summary.csv")
    (out / "summary.md").write_text(md, encoding="utf-8")
    plot_pareto(rows, out / "pareto.png", x=pareto_x, y=pareto_y)
    return rows, md
