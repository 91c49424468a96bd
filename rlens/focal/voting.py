"""Voting rules over several models' answers (pure numpy)."""

from __future__ import annotations

import numpy as np


def plurality_vote(predictions: np.ndarray, n_choices: int, tiebreak: np.ndarray | None = None) -> np.ndarray:
    """Most frequent prediction per row of ``predictions`` int [n, k]; a negative prediction (no answer) is no vote.

    Ties go to the tied choice with the highest ``tiebreak`` score ([n, n_choices], e.g. summed
    probabilities), or to the lowest choice index without one.
    """
    n = predictions.shape[0]
    cells = (np.arange(n)[:, None] * n_choices + predictions)[predictions >= 0]
    votes = np.bincount(cells, minlength=n * n_choices).reshape(n, n_choices).astype(np.float64)
    if tiebreak is not None:
        votes = votes + 1e-3 * tiebreak / np.maximum(np.abs(tiebreak).max(1, keepdims=True), 1e-12)
    return votes.argmax(1)


def soft_vote(probs: np.ndarray) -> np.ndarray:
    """Argmax of the models' mean distribution: probs [n, m, C] -> [n]."""
    return probs.sum(1).argmax(1)
