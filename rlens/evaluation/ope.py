"""Off-policy evaluation: a candidate policy's expected reward and accuracy from traffic another policy served.

The estimators are small pure functions over per-query arrays, each returning an :class:`Estimate` with a normal 95 %
confidence interval and the effective sample size of its importance weights:
- :func:`direct` — the mean of per-query values: the candidate's reward where the log holds every answer it needs
  (on probe rows, which call the whole pool, an unbiased estimate: they are a random sample), or a reward model's;
- :func:`corrected_replay` — every query's value, exact where the log holds what the candidate needs and a reward
  model's elsewhere, with the model's mean error measured on the random sample where both are known;
- :func:`ips` — inverse propensity scoring, mean of w · r with w = π_candidate(a | x) / π_logging(a | x);
- :func:`snips` — its self-normalised form, Σ w r / Σ w (delta-method interval);
- :func:`doubly_robust` — a reward model's prediction for the candidate's action, corrected by w · (r − the model's
  prediction for the logged action).

Open Bandit Pipeline, the maintained-looking library for these, does not install on Python 3.11 (obp 0.5 requires
< 3.11; 0.4 predates numpy 2), so they are written here and tested against hand-computed cases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054


@dataclass(frozen=True)
class Estimate:
    value: float
    low: float
    high: float
    n: int  # queries the estimate used
    ess: float  # effective sample size of the weights (n for unweighted means)

    def covers(self, truth: float) -> bool:
        return self.low <= truth <= self.high

    def to_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high, "n": self.n, "ess": self.ess}


def effective_sample_size(weights: np.ndarray) -> float:
    """(Σ w)² / Σ w²: how many unweighted samples the weighted ones are worth (0 for no weight)."""
    w = np.asarray(weights, dtype=np.float64)
    squares = float((w**2).sum())
    return float(w.sum() ** 2 / squares) if squares > 0 else 0.0


def _mean(values: np.ndarray, ess: float | None = None) -> Estimate:
    v = np.asarray(values, dtype=np.float64)
    n = len(v)
    if n == 0:
        return Estimate(math.nan, math.nan, math.nan, 0, 0.0)
    mean = float(v.mean())
    half = Z95 * float(v.std(ddof=1)) / math.sqrt(n) if n > 1 else math.inf
    return Estimate(mean, mean - half, mean + half, n, float(n) if ess is None else ess)


def direct(values: np.ndarray) -> Estimate:
    """The mean of exactly known values (e.g. the candidate's reward on the complete rows)."""
    return _mean(values)


def corrected_replay(values: np.ndarray, modelled: np.ndarray, residuals: np.ndarray) -> Estimate:
    """The mean of per-query values, each exact or (``modelled``) a reward model's prediction, corrected by the
    model's mean error measured where the truth is known on a random sample (``residuals``: exact − predicted there).
    The interval adds that correction's uncertainty to the mean's: fraction modelled² · var(residuals) / k."""
    v = np.asarray(values, dtype=np.float64)
    n = len(v)
    if n == 0:
        return Estimate(math.nan, math.nan, math.nan, 0, 0.0)
    share = float(np.asarray(modelled, dtype=bool).mean())
    res = np.asarray(residuals, dtype=np.float64)
    bias = float(res.mean()) if share > 0 and len(res) else 0.0
    variance = float(v.var(ddof=1)) / n if n > 1 else math.inf
    if share > 0:
        variance += share**2 * (float(res.var(ddof=1)) / len(res) if len(res) > 1 else math.inf)
    value = float(v.mean()) + share * bias
    half = Z95 * math.sqrt(variance)
    return Estimate(value, value - half, value + half, n, float(n))


def weights(target_probs: np.ndarray, logging_probs: np.ndarray) -> np.ndarray:
    """Importance weights π_candidate(a | x) / π_logging(a | x) of the logged actions."""
    logging = np.asarray(logging_probs, dtype=np.float64)
    if (logging <= 0).any():
        raise ValueError("a logged action has propensity 0: the log cannot weigh it")
    return np.asarray(target_probs, dtype=np.float64) / logging


def ips(rewards: np.ndarray, target_probs: np.ndarray, logging_probs: np.ndarray) -> Estimate:
    w = weights(target_probs, logging_probs)
    return _mean(w * np.asarray(rewards, dtype=np.float64), effective_sample_size(w))


def snips(rewards: np.ndarray, target_probs: np.ndarray, logging_probs: np.ndarray) -> Estimate:
    w = weights(target_probs, logging_probs)
    r = np.asarray(rewards, dtype=np.float64)
    total = float(w.sum())
    if total <= 0:
        return Estimate(math.nan, math.nan, math.nan, len(r), 0.0)
    value = float((w * r).sum() / total)
    half = Z95 * math.sqrt(float((w**2 * (r - value) ** 2).sum())) / total
    return Estimate(value, value - half, value + half, len(r), effective_sample_size(w))


def doubly_robust(
    rewards: np.ndarray,
    target_probs: np.ndarray,
    logging_probs: np.ndarray,
    predicted_logged: np.ndarray,
    predicted_target: np.ndarray,
) -> Estimate:
    """``predicted_logged``: the reward model's value of the logged action; ``predicted_target``: its expected
    value of the candidate's action (for a deterministic candidate, of the action it takes)."""
    w = weights(target_probs, logging_probs)
    r = np.asarray(rewards, dtype=np.float64)
    values = np.asarray(predicted_target, dtype=np.float64) + w * (r - np.asarray(predicted_logged, dtype=np.float64))
    return _mean(values, effective_sample_size(w))
