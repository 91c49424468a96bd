"""Voting rules over several models' answers (pure numpy)."""

from __future__ import annotations

import numpy as np


def choice_counts(predictions: np.ndarray, n_choices: int | None = None, answered_only: bool = True) -> np.ndarray:
    """Votes per row and choice: predictions int [n, k] -> float [n, n_choices] (``n_choices`` at least the largest
    prediction + 1; that by default). A negative prediction (no answer) is no vote; ``answered_only`` promises there
    is none, and skips looking for them."""
    n = predictions.shape[0]
    k = int(n_choices if n_choices is not None else predictions.max(initial=0) + 1)
    cells = np.arange(n)[:, None] * k + predictions
    cells = cells.ravel() if answered_only else cells[predictions >= 0]
    return np.bincount(cells, minlength=n * k).reshape(n, k).astype(np.float64)


def plurality_vote(predictions: np.ndarray, n_choices: int, tiebreak: np.ndarray | None = None) -> np.ndarray:
    """Most frequent prediction per row of ``predictions`` int [n, k]; a negative prediction (no answer) is no vote.

    Ties go to the tied choice with the highest ``tiebreak`` score ([n, n_choices], e.g. summed
    probabilities), or to the lowest choice index without one.
    """
    votes = choice_counts(predictions, n_choices, answered_only=False)
    if tiebreak is not None:
        votes = votes + 1e-3 * tiebreak / np.maximum(np.abs(tiebreak).max(1, keepdims=True), 1e-12)
    return votes.argmax(1)


def soft_vote(probs: np.ndarray) -> np.ndarray:
    """Argmax of the models' mean distribution: probs [n, m, C] -> [n]."""
    return probs.sum(1).argmax(1)
