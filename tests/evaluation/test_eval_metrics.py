import math

import pytest
import torch

from kvfuse.evaluation.metrics import (bootstrap_ci, fidelity, kl_per_token, lcs_length, mean_kl, metric_name,
                                       normalize_answer, qa_f1, rouge_l, task_score, token_f1)


def test_normalize_removes_case_punctuation_and_articles():
    assert normalize_answer("The  Quick, brown-fox!") == "quick brownfox"
    assert normalize_answer("An apple a day keeps THE doctor away.") == "apple day keeps doctor away"
    # articles only as whole words
    assert normalize_answer("Theatre and anthem") == "theatre and anthem"
    assert normalize_answer("  ") == ""


def test_qa_f1_known_values():
    assert qa_f1("Paris", ["Paris"]) == 1.0
    # 5 prediction tokens (eiffel tower is in paris), 1 gold token: P = 1/5, R = 1 -> F1 = 1/3
    assert qa_f1("The Eiffel Tower is in Paris.", ["Paris"]) == pytest.approx(1 / 3)
    # max over gold answers
    assert qa_f1("Weston-super-Mare", ["Somerset", "Westonsupermare"]) == 1.0
    # P = 1/2, R = 1/3 -> 2 * (1/6) / (5/6) = 0.4
    assert qa_f1("Henry Edwards", ["Henry Walter Moore"]) == pytest.approx(0.4)
    assert qa_f1("yes", ["no"]) == 0.0
    assert qa_f1("", ["Paris"]) == 0.0
    # a LongBench-style case: repeated tokens count by multiplicity
    assert token_f1(["a", "a", "b"], ["a", "b", "b"]) == pytest.approx(2 / 3)


def test_rouge_l_hand_computed_lcs():
    assert lcs_length(list("wxyz"), list("xwz")) == 2
    assert lcs_length("cat sat on mat".split(), "cat lay on mat".split()) == 3
    # normalised: "cat sat on mat" vs "cat lay on mat": LCS 3, P = R = 3/4
    assert rouge_l("The cat sat on the mat.", ["The cat lay on a mat"]) == pytest.approx(0.75)
    # LCS 2, P = 2/4, R = 2/3 -> F = 4/7
    assert rouge_l("w x y z", "x w z") == pytest.approx(4 / 7)
    assert rouge_l("w x y z", ["nothing", "x w z"]) == pytest.approx(4 / 7)
    assert rouge_l("", "x") == 0.0


def test_task_metric_dispatch():
    assert metric_name("qmsum") == "rouge_l"
    assert metric_name("2wikimqa") == "f1"
    assert task_score("qmsum", "w x y z", ["x w z"]) == pytest.approx(4 / 7)
    assert task_score("hotpotqa", "w x y z", ["x w z"]) == pytest.approx(2 * (3 / 4) * 1 / (3 / 4 + 1))


def test_fidelity():
    assert fidelity("Alpha beta.", "alpha beta") == 1.0
    assert fidelity("", "") == 1.0  # the full answer always matches itself
    assert fidelity("The.", "") == 1.0
    assert fidelity("alpha beta", "alpha beta gamma") == pytest.approx(0.8)
    assert fidelity("delta", "alpha") == 0.0


def test_kl_identical_is_zero():
    lp = torch.log_softmax(torch.randn(5, 11, generator=torch.Generator().manual_seed(0)), dim=-1)
    assert mean_kl(lp, lp.clone()) == pytest.approx(0.0, abs=1e-12)
    assert torch.allclose(kl_per_token(lp, lp), torch.zeros(5, dtype=torch.float64), atol=1e-12)


def test_kl_matches_closed_form():
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]])
    q = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    expected = [0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75), 0.9 * math.log(1.8) + 0.1 * math.log(0.2)]
    got = kl_per_token(p.log(), q.log())
    assert got.tolist() == pytest.approx(expected)
    assert mean_kl(p.log(), q.log()) == pytest.approx(sum(expected) / 2)
    # zero-mass reference entries contribute nothing; mass where q has none is infinite
    p0 = torch.tensor([[1.0, 0.0]])
    assert mean_kl(p0.log(), torch.tensor([[0.5, 0.5]]).log()) == pytest.approx(math.log(2))
    assert math.isinf(kl_per_token(torch.tensor([[0.5, 0.5]]).log(), p0.log())[0].item())
    assert math.isnan(mean_kl(torch.zeros(0, 3), torch.zeros(0, 3)))
    with pytest.raises(ValueError):
        kl_per_token(torch.zeros(2, 3), torch.zeros(2, 4))


def test_kl_bfloat16_inputs():
    lp = torch.log_softmax(torch.randn(3, 7), dim=-1)
    assert mean_kl(lp.bfloat16(), lp.bfloat16()) == 0.0


def test_bootstrap_ci_contains_mean_and_shrinks():
    import numpy as np

    rng = np.random.default_rng(1)
    small = rng.random(20).tolist()
    big = rng.random(2000).tolist()
    m, lo, hi = bootstrap_ci(small, seed=0)
    assert m == pytest.approx(float(np.mean(small)))
    assert lo <= m <= hi
    m2, lo2, hi2 = bootstrap_ci(big, seed=0)
    assert lo2 <= m2 <= hi2
    assert (hi2 - lo2) < (hi - lo) / 3
    # seeded: identical twice
    assert bootstrap_ci(small, seed=0) == (m, lo, hi)
    assert bootstrap_ci(small, seed=1) != (m, lo, hi)


def test_bootstrap_edge_cases_and_strata():
    assert all(math.isnan(x) for x in bootstrap_ci([]))
    assert bootstrap_ci([0.3]) == (0.3, 0.3, 0.3)
    assert bootstrap_ci([0.2, 0.2, 0.2]) == pytest.approx((0.2, 0.2, 0.2))
    assert bootstrap_ci([1.0, float("nan")])[0] == 1.0
    # macro mean: mean of the group means, not the pooled mean
    vals = [1.0, 1.0, 1.0, 0.0]
    m, lo, hi = bootstrap_ci(vals, strata=["a", "a", "a", "b"])
    assert m == pytest.approx(0.5)
    assert lo <= m <= hi
