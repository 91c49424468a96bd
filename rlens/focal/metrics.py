"""Ensemble diversity metrics over a window of outcomes of one pool (pure numpy, no I/O).

Inputs are the window rows on which every model of the pool was observed:
``correct`` bool [n, m] (model answered right) and ``predictions`` int [n, m] (chosen choice).

Edge cases are defined so that every metric is always a finite number:
an empty window gives 0 for every metric (no evidence; the agents also see how full the window is);
a pool of one model gives focal diversity 0, kappa 1, disagreement 0, Yule's Q 1, correlation 1, entropy 0
(a model agrees perfectly with itself); a pair statistic with a zero denominator is 0 (no evidence of dependence);
a focal model that never failed in the window has lambda_j = 1 (none of its failures coincide with another's).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from rlens.focal.voting import choice_counts

METRIC_NAMES = ("focal", "kappa", "disagreement", "yule_q", "correlation", "entropy")


def focal_diversity(correct: np.ndarray) -> float:
    """Focal diversity (RL-Focal / EnsembleBench): mean over focal models j of 1 - p(2)/p(1) on the rows where j failed."""
    n, m = correct.shape
    if n == 0 or m < 2:  # no rows, or no pair of models (an empty pool or a pool of one)
        return 0.0
    c = correct.astype(np.float64)
    return _focal(c, _row_sums(c))


def _row_sums(c: np.ndarray) -> np.ndarray:
    """How many models were right on each row (a product: cheaper than ``sum(1)`` on small arrays, and exact)."""
    return c @ np.ones(c.shape[1])


def _focal(c: np.ndarray, n_right: np.ndarray) -> float:
    """:func:`focal_diversity` of float correctness [n, m] with its :func:`_row_sums`, n >= 1, m >= 2."""
    m = c.shape[1]
    failed = (1.0 - c).T  # [m, n]
    n_failed = m - n_right  # [n] how many of the pool failed on each row
    # p(1) = sum_i (i/m) p_i and p(2) = sum_i i(i-1)/(m(m-1)) p_i, with p_i taken over the rows where j failed
    # (both scaled by the row count, which cancels in the ratio); p(1) = 0: j never failed.
    p1 = failed @ (n_failed / m)
    p2 = failed @ (n_failed * (n_failed - 1) / (m * (m - 1)))
    lam = np.where(p1 > 0, 1.0 - p2 / np.where(p1 > 0, p1, 1.0), 1.0)
    return float(lam.sum() / m)


def fleiss_kappa(predictions: np.ndarray, n_categories: int | None = None, counts: np.ndarray | None = None) -> float:
    """Fleiss' kappa of the models (raters) over the rows (subjects), categories = predicted choices; ``counts``:
    their :func:`choice_counts` when already known."""
    n, m = predictions.shape
    if n == 0:
        return 0.0
    if m == 1:
        return 1.0
    if counts is None:
        counts = choice_counts(predictions, n_categories)
    p_bar = (((counts**2).sum(1) - m) / (m * (m - 1))).sum() / n
    p_cat = counts.sum(0) / (n * m)
    p_e = float((p_cat**2).sum())
    if p_e >= 1.0 - 1e-12:
        return 1.0  # every model always gave the same single category: perfect agreement
    return float((p_bar - p_e) / (1.0 - p_e))


PairCounts = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@lru_cache(maxsize=64)
def _upper_pairs(m: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(m, k=1)


def pair_counts(correct: np.ndarray) -> PairCounts:
    """N11, N00, N10, N01 for every pair i < j (vectors of length m(m-1)/2), from one product."""
    return _pair_counts(correct.astype(np.float64))


def _pair_counts(c: np.ndarray) -> PairCounts:
    both = c.T @ c  # [m, m]: rows where i and j were both right; its diagonal: rows where each was right
    i, j = _upper_pairs(c.shape[1])
    n11, right_i, right_j = both[i, j], both[i, i], both[j, j]
    n10, n01 = right_i - n11, right_j - n11
    return n11, c.shape[0] - n11 - n10 - n01, n10, n01


def _mean_ratio(numerator: np.ndarray, denominator: np.ndarray) -> float:
    """Mean over pairs of numerator / denominator, counting a pair with a zero denominator as 0."""
    safe = np.where(denominator > 0, denominator, 1.0)
    return float(np.where(denominator > 0, numerator / safe, 0.0).sum() / len(denominator))


def pairwise_disagreement(correct: np.ndarray, counts: PairCounts | None = None) -> float:
    """Mean over pairs of the fraction of rows where exactly one of the two models is correct."""
    n, m = correct.shape
    if n == 0 or m == 1:
        return 0.0
    _, _, n10, n01 = counts or pair_counts(correct)
    return float((n10 + n01).sum() / (n * len(n10)))


def yule_q(correct: np.ndarray, counts: PairCounts | None = None) -> float:
    """Mean over pairs of Yule's Q = (N11 N00 - N01 N10) / (N11 N00 + N01 N10)."""
    n, m = correct.shape
    if n == 0:
        return 0.0
    if m == 1:
        return 1.0
    n11, n00, n10, n01 = counts or pair_counts(correct)
    return _mean_ratio(n11 * n00 - n01 * n10, n11 * n00 + n01 * n10)


def correlation(correct: np.ndarray, counts: PairCounts | None = None) -> float:
    """Mean over pairs of the correlation coefficient of the two models' correctness."""
    n, m = correct.shape
    if n == 0:
        return 0.0
    if m == 1:
        return 1.0
    n11, n00, n10, n01 = counts or pair_counts(correct)
    return _mean_ratio(n11 * n00 - n01 * n10, np.sqrt((n11 + n10) * (n01 + n00) * (n11 + n01) * (n10 + n00)))


def binary_entropy(correct: np.ndarray) -> float:
    """Kuncheva's entropy measure E = mean over rows of min(l, m - l) / (m - ceil(m/2)), l = models correct."""
    n, m = correct.shape
    if n == 0 or m == 1:
        return 0.0
    return _entropy(_row_sums(correct.astype(np.float64)), m)


def _entropy(n_right: np.ndarray, m: int) -> float:
    return float(np.minimum(n_right, m - n_right).sum() / (len(n_right) * (m - np.ceil(m / 2))))


# Every metric's value for a pool of one model (it agrees perfectly with itself)
_ONE_MODEL = {"focal": 0.0, "kappa": 1.0, "disagreement": 0.0, "yule_q": 1.0, "correlation": 1.0, "entropy": 0.0}


def diversity_metrics(
    correct: np.ndarray,
    predictions: np.ndarray,
    names: tuple[str, ...] = METRIC_NAMES,
    counts: np.ndarray | None = None,
) -> np.ndarray:
    """The metrics in ``names`` (a subset of METRIC_NAMES, in that order) as a float32 vector; ``counts``: the
    rows' :func:`choice_counts`, when already known. The intermediate counts are computed once for all metrics."""
    correct = np.asarray(correct, dtype=bool)
    predictions = np.asarray(predictions, dtype=np.int64)
    if correct.shape != predictions.shape or correct.ndim != 2:
        raise ValueError(f"correct {correct.shape} and predictions {predictions.shape} must both be [rows, models]")
    n, m = correct.shape
    if n == 0:
        return np.zeros(len(names), dtype=np.float32)
    if m == 1:
        return np.array([_ONE_MODEL[name] for name in names], dtype=np.float32)
    c = correct.astype(np.float64)
    n_right = _row_sums(c)
    pairs = _pair_counts(c) if {"disagreement", "yule_q", "correlation"} & set(names) else None
    compute = {
        "focal": lambda: _focal(c, n_right),
        "kappa": lambda: fleiss_kappa(predictions, counts=counts),
        "disagreement": lambda: pairwise_disagreement(correct, pairs),
        "yule_q": lambda: yule_q(correct, pairs),
        "correlation": lambda: correlation(correct, pairs),
        "entropy": lambda: _entropy(n_right, m),
    }
    return np.array([compute[name]() for name in names], dtype=np.float32)
