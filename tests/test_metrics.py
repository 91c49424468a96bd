"""Diversity metrics against hand-computed values, and their edge cases."""

import numpy as np
import pytest

from rlens.focal.metrics import (
    METRIC_NAMES,
    binary_entropy,
    correlation,
    diversity_metrics,
    fleiss_kappa,
    focal_diversity,
    pairwise_disagreement,
    yule_q,
)
from rlens.focal.voting import choice_counts

# 3 models x 5 rows (1 = correct). Failures per row: 0, 1 (m0), 2 (m0, m1), 3, 1 (m1).
CORRECT = np.array([[1, 1, 1], [0, 1, 1], [0, 0, 1], [0, 0, 0], [1, 0, 1]], dtype=bool)


def test_focal_diversity_hand_computed():
    # m0 failed on rows with 1, 2, 3 failures: p(1) = 2/3, p(2) = 4/9, lambda = 1/3; m1 the same;
    # m2 failed only with all three: lambda = 0. Mean = 2/9.
    assert focal_diversity(CORRECT) == pytest.approx(2 / 9)


def test_pairwise_metrics_hand_computed():
    assert pairwise_disagreement(CORRECT) == pytest.approx(0.4)
    # Q(0,1) = (1*2 - 1*1) / (1*2 + 1*1) = 1/3; Q(0,2) = Q(1,2) = 1 (no N10)
    assert yule_q(CORRECT) == pytest.approx(7 / 9)
    # rho(0,1) = 1/6; rho(0,2) = rho(1,2) = 2 / sqrt(24)
    assert correlation(CORRECT) == pytest.approx((1 / 6 + 2 * 2 / np.sqrt(24)) / 3)


def test_binary_entropy_hand_computed():
    # l = 3, 2, 1, 0, 2 correct; min(l, 3 - l) / (3 - 2) = 0, 1, 1, 0, 1
    assert binary_entropy(CORRECT) == pytest.approx(0.6)


def test_fleiss_kappa_hand_computed():
    predictions = np.array([[0, 0, 0], [1, 1, 1], [0, 0, 1], [0, 1, 1]])
    # P_i = 1, 1, 1/3, 1/3 -> P_bar = 2/3; p_0 = p_1 = 1/2 -> P_e = 1/2; kappa = (2/3 - 1/2) / (1/2)
    assert fleiss_kappa(predictions) == pytest.approx(1 / 3)


def test_edge_cases_are_finite_and_defined():
    empty = np.zeros((0, 3), dtype=bool)
    assert diversity_metrics(empty, np.zeros((0, 3), int)).tolist() == [0.0] * len(METRIC_NAMES)

    one = np.array([[1], [0], [1]], dtype=bool)
    values = dict(zip(METRIC_NAMES, diversity_metrics(one, np.array([[0], [1], [0]]))))
    assert values == {
        "focal": 0.0,
        "kappa": 1.0,
        "disagreement": 0.0,
        "yule_q": 1.0,
        "correlation": 1.0,
        "entropy": 0.0,
    }

    never_fail = np.ones((4, 3), dtype=bool)
    assert focal_diversity(never_fail) == 1.0  # no failure coincides with another
    assert yule_q(never_fail) == 0.0 and correlation(never_fail) == 0.0  # zero denominators: no evidence

    all_fail = np.zeros((4, 3), dtype=bool)
    assert focal_diversity(all_fail) == 0.0  # every failure is shared by the whole pool
    assert binary_entropy(all_fail) == 0.0 and pairwise_disagreement(all_fail) == 0.0

    same = np.zeros((5, 4), dtype=int)
    assert fleiss_kappa(same) == 1.0  # one category only: perfect agreement


def test_metric_subset_order_and_shape_check():
    predictions = np.where(CORRECT, 0, 1)
    full = diversity_metrics(CORRECT, predictions)
    assert diversity_metrics(CORRECT, predictions, ("kappa", "focal")).tolist() == [full[1], full[0]]
    with pytest.raises(ValueError):
        diversity_metrics(CORRECT, predictions[:, :2])


def test_focal_diversity_is_permutation_invariant():
    rng = np.random.default_rng(0)
    correct = rng.random((50, 6)) < 0.6
    assert focal_diversity(correct) == pytest.approx(focal_diversity(correct[:, rng.permutation(6)]))
    assert focal_diversity(correct) == pytest.approx(focal_diversity(correct[rng.permutation(50)]))


def test_choice_counts_and_metrics_from_given_counts():
    predictions = np.array([[0, 0, 2], [1, 2, 2]])
    assert choice_counts(predictions).tolist() == [[2, 0, 1], [0, 1, 2]]
    assert choice_counts(predictions, 4).tolist() == [[2, 0, 1, 0], [0, 1, 2, 0]]  # a choice nobody took
    assert choice_counts(np.array([[0, -1, 2]]), answered_only=False).tolist() == [[1, 0, 1]]  # -1: no vote
    correct = predictions == 2
    # counts over more choices than were predicted (as the window passes them) change no metric
    assert diversity_metrics(correct, predictions, counts=choice_counts(predictions, 5)).tolist() == (
        diversity_metrics(correct, predictions).tolist()
    )
