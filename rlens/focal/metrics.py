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

METRIC_NAMES = ("focal", "kappa", "disagreement", "yule_q", "correlation", "entropy")


def focal_diversity(correct: np.ndarray) -> float:
    """Focal diversity (RL-Focal / EnsembleBench): mean over focal models j of 1 - p(2)/p(1) on the rows where j failed."""
    n, m = correct.shape
    if n == 0 or m < 2:  # no rows, or no pair of models (an empty pool or a pool of one)
        return 0.0
    failed = (~correct).astype(np.float64)
    n_failed = failed.sum(1)  # [n] how many of the pool failed on each row
    rows_j = failed.sum(0)  # [m] rows where focal model j failed
    # p(1) = sum_i (i/m) p_i and p(2) = sum_i i(i-1)/(m(m-1)) p_i, with p_i taken over the rows where j failed
    # (both scaled by the row count, which cancels in the ratio).
    p1 = failed.T @ (n_failed / m)
    p2 = failed.T @ (n_failed * (n_failed - 1) / (m * (m - 1)))
    lam = np.where(rows_j > 0, 1.0 - p2 / np.where(p1 > 0, p1, 1.0), 1.0)
    return float(lam.sum() / m)


def fleiss_kappa(predictions: np.ndarray, n_categories: int | None = None) -> float:
    """Fleiss' kappa of the models (raters) over the rows (subjects), categories = predicted choices."""
    n, m = predictions.shape
    if n == 0:
        return 0.0
    if m == 1:
        return 1.0
    k = int(n_categories if n_categories is not None else predictions.max() + 1)
    counts = (
        np.bincount((np.arange(n)[:, None] * k + predictions).ravel(), minlength=n * k).reshape(n, k).astype(np.float64)
    )
    p_row = ((counts**2).sum(1) - m) / (m * (m - 1))
    p_cat = counts.sum(0) / (n * m)
    p_bar, p_e = p_row.sum() / n, float((p_cat**2).sum())
    if p_e >= 1.0 - 1e-12:
        return 1.0  # every model always gave the same single category: perfect agreement
    return float((p_bar - p_e) / (1.0 - p_e))


PairCounts = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@lru_cache(maxsize=64)
def _upper_pairs(m: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(m, k=1)


def pair_counts(correct: np.ndarray) -> PairCounts:
    """N11, N00, N10, N01 for every pair i < j (vectors of length m(m-1)/2)."""
    c = correct.astype(np.float64)
    w = 1.0 - c
    iu = _upper_pairs(correct.shape[1])
    return (c.T @ c)[iu], (w.T @ w)[iu], (c.T @ w)[iu], (w.T @ c)[iu]


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
    n_correct = correct.sum(1)
    return float(np.minimum(n_correct, m - n_correct).sum() / (n * (m - np.ceil(m / 2))))


def diversity_metrics(
    correct: np.ndarray, predictions: np.ndarray, names: tuple[str, ...] = METRIC_NAMES
) -> np.ndarray:
    """The metrics in ``names`` (a subset of METRIC_NAMES, in that order) as a float32 vector."""
    correct = np.asarray(correct, dtype=bool)
    predictions = np.asarray(predictions, dtype=np.int64)
    if correct.shape != predictions.shape or correct.ndim != 2:
        raise ValueError(f"correct {correct.shape} and predictions {predictions.shape} must both be [rows, models]")
    counts = pair_counts(correct) if correct.shape[0] and correct.shape[1] > 1 else None
    compute = {
        "focal": lambda: focal_diversity(correct),
        "kappa": lambda: fleiss_kappa(predictions),
        "disagreement": lambda: pairwise_disagreement(correct, counts),
        "yule_q": lambda: yule_q(correct, counts),
        "correlation": lambda: correlation(correct, counts),
        "entropy": lambda: binary_entropy(correct),
    }
    return np.array([compute[name]() for name in names], dtype=np.float32)
