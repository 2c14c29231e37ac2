"""Quality metrics: LongBench's QA F1, ROUGE-L F, fidelity to the full-prefill answer, KL, bootstrap CIs.

Text metrics work on LongBench's normalised tokens: lower-case, punctuation removed, the articles a/an/the
removed, whitespace-split.
"""
from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily: the report path does not need it
    import torch

__all__ = [
    "SUMMARY_DATASETS", "normalize_answer", "answer_tokens", "token_f1", "qa_f1", "lcs_length", "rouge_l",
    "metric_name", "task_score", "fidelity", "kl_per_token", "mean_kl", "bootstrap_ci",
]

# Datasets scored with ROUGE-L (reference summaries) instead of token F1.
SUMMARY_DATASETS = frozenset({"qmsum", "samsum", "multi_news", "gov_report", "vcsum"})

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """LongBench / SQuAD normalisation: lower-case, drop punctuation, drop articles, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def answer_tokens(s: str) -> list[str]:
    """Normalised whitespace tokens of `s`."""
    return normalize_answer(s).split()


def token_f1(pred: Sequence[str], ref: Sequence[str]) -> float:
    """Bag-of-tokens F1 between two token lists; 0 when they share no token (both empty included)."""
    common = Counter(pred) & Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred)
    recall = same / len(ref)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, answers: str | Iterable[str]) -> float:
    """LongBench `qa_f1_score`, maximised over the gold answers."""
    if isinstance(answers, str):
        answers = [answers]
    pred = answer_tokens(prediction)
    return max((token_f1(pred, answer_tokens(a)) for a in answers), default=0.0)


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence (dynamic programming, O(len(a) * len(b)) time, O(len(b)) space)."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, references: str | Iterable[str]) -> float:
    """ROUGE-L F1 (beta = 1) on normalised tokens, maximised over the references."""
    if isinstance(references, str):
        references = [references]
    pred = answer_tokens(prediction)
    best = 0.0
    for ref in references:
        r = answer_tokens(ref)
        if not pred or not r:
            continue
        lcs = lcs_length(pred, r)
        if lcs == 0:
            continue
        p, rec = lcs / len(pred), lcs / len(r)
        best = max(best, 2 * p * rec / (p + rec))
    return best


def metric_name(dataset: str) -> str:
    """`"rouge_l"` for summarization datasets, `"f1"` otherwise."""
    return "rouge_l" if dataset.lower() in SUMMARY_DATASETS else "f1"


def task_score(dataset: str, prediction: str, answers: Iterable[str]) -> float:
    """The dataset's task metric of `prediction` against the gold `answers`."""
    answers = list(answers)
    return rouge_l(prediction, answers) if metric_name(dataset) == "rouge_l" else qa_f1(prediction, answers)


def fidelity(prediction: str, reference: str) -> float:
    """Token F1 of a strategy's answer against the full-prefill answer.

    Unlike the gold F1, two answers that normalise to the same (possibly empty) token list score 1.0, so the
    full answer always has fidelity 1 with itself.
    """
    pred, ref = answer_tokens(prediction), answer_tokens(reference)
    if pred == ref:
        return 1.0
    return token_f1(pred, ref)


def kl_per_token(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per row of two `[T, V]` log-probability tensors, in nats (float64).

    Rows where the reference puts no mass (-inf) contribute 0; a token the reference can emit but the other
    cannot makes that row +inf.
    """
    import torch

    if ref_logprobs.shape != logprobs.shape or ref_logprobs.dim() != 2:
        raise ValueError(f"KL needs two [T, V] tensors of one shape, got {tuple(ref_logprobs.shape)} and "
                         f"{tuple(logprobs.shape)}")
    p_log = ref_logprobs.detach().to(torch.float64)
    q_log = logprobs.detach().to(torch.float64)
    p = p_log.exp()
    diff = torch.where(p > 0, p_log - q_log, torch.zeros_like(p_log))
    return (p * diff).sum(dim=-1)


def mean_kl(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> float:
    """Mean over positions of KL(ref || other); NaN when there are no positions."""
    if ref_logprobs.shape[0] == 0:
        return math.nan
    kl = kl_per_token(ref_logprobs, logprobs)
    return float(kl.clamp_min(0.0).mean())  # tiny negative values are rounding noise


def bootstrap_ci(values: Sequence[float], n_resamples: int = 1000, seed: int = 0,
                 confidence: float = 0.95, strata: Sequence[object] | None = None) -> tuple[float, float, float]:
    """Mean and percentile bootstrap confidence interval of the mean.

    Args:
        values: the per-example values (non-finite values are dropped).
        n_resamples: bootstrap resamples.
        seed: RNG seed; the same inputs give the same interval.
        confidence: interval mass, 0.95 by default.
        strata: optional group label per value. Then the statistic is the mean of the group means (macro
            average), and each resample draws within each group.

    Returns:
        `(mean, low, high)`; all NaN for no values, `(v, v, v)` for a single one.
    """
    import numpy as np

    vals = np.asarray(values, dtype=np.float64)
    keep = np.isfinite(vals)
    if strata is not None:
        labels = np.asarray([str(s) for s in strata], dtype=object)
        if len(labels) != len(vals):
            raise ValueError("strata must have one label per value")
        labels = labels[keep]
    vals = vals[keep]
    if vals.size == 0:
        return (math.nan, math.nan, math.nan)
    rng = np.random.default_rng(seed)
    alpha = (1.0 - confidence) / 2.0
    if strata is None:
        mean = float(vals.mean())
        if vals.size == 1:
            return (mean, mean, mean)
        idx = rng.integers(0, vals.size, size=(n_resamples, vals.size))
        boots = vals[idx].mean(axis=1)
    else:
        groups = [vals[labels == g] for g in dict.fromkeys(labels.tolist())]
        mean = float(np.mean([g.mean() for g in groups]))
        if all(g.size == 1 for g in groups):
            return (mean, mean, mean)
        boots = np.zeros(n_resamples)
        for g in groups:
            idx = rng.integers(0, g.size, size=(n_resamples, g.size))
            boots += g[idx].mean(axis=1)
        boots /= len(groups)
    lo, hi = np.quantile(boots, [alpha, 1.0 - alpha])
    return (mean, float(lo), float(hi))
