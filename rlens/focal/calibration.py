"""Each model's calibration on a stream, and the calibrated naive-Bayes vote of a pool (pure numpy).

Per-task stacking learns how each model's log-probabilities map to the label, choice by choice: a model that leans
to one choice, a task with a favourite label. :class:`StreamCalibration` keeps, per stream, the last ``rows``
labelled outcomes of each model (its log-probabilities over the choices, the label) and fits, per model and choice
count, a multinomial logistic regression from the model's log-probabilities to the label
(:func:`fit_multinomial`): C + 1 weights a choice over C choices. While a model has fewer than ``scaling_below``
rows a choice, the fit is the scaling form instead (:func:`fit_scaling`: one scale on its log-probabilities and a
bias per choice, C + 1 weights in all): on a new stream's first rows the full fit overfits, most over many choices
(RL-Focal's cold start, BENCHMARKS.md). A pool's calibrated vote is the naive-Bayes combination of its members'
calibrated posteriors q_i:

    score(c) = sum_i log q_i(c) - (k - 1) log prior(c),   k members, prior the stream's smoothed label frequency,

normalised over the choices. The engine's greedy answers are the Fusion's distribution times this vote
(:meth:`rlens.focal.greedy.GreedyActor.answers`); a pool with a member not yet calibrated (fewer than ``min_rows``
rows of that choice count) has no vote.

On a long stream that vote leaves most rows unused and treats the models as independent. With ``joint_rows`` a
stream also keeps its last labelled queries whole (every called model's log-probabilities) and fits, per pool and
choice count, a joint multinomial logistic regression over the members' log-probabilities: the per-task stacker,
restricted to the pool (:class:`PoolCombiner`). It replaces the pool's vote only where it predicted the newest fifth
of those rows better than the vote did, so on short streams the vote stays.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Callable, Hashable

import numpy as np

from rlens.focal.features import LOG_FLOOR


def fit_multinomial(
    x: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    strength: float = 1.0,
    iterations: int = 50,
    start: np.ndarray | None = None,
) -> np.ndarray:
    """Multinomial logistic regression by Newton's method with a backtracking line search: minimises
    0.5 |theta|^2 + strength * sum_n cross-entropy(softmax([x_n, 1] theta), y_n) over theta [d + 1, K] (the last
    row the intercepts, penalised too, so a class never seen stays finite), from ``start`` (default zeros: an
    earlier fit on similar rows takes fewer steps to the same minimum). Deterministic; x [n, d], y int [n]."""
    n, d = x.shape
    k = n_classes
    features = np.hstack([np.asarray(x, dtype=np.float64), np.ones((n, 1))])
    targets = np.eye(k)[y]

    def objective(t: np.ndarray) -> float:
        return _penalised_cross_entropy(t, features @ t, y, strength)

    def derivatives(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = _softmax(features @ t)
        gradient = t + strength * features.T @ (p - targets)
        return gradient, strength * _hessian(features, p) + np.eye((d + 1) * k)

    theta = np.zeros((d + 1, k)) if start is None else np.array(start, dtype=np.float64)
    return _newton(objective, derivatives, theta, iterations)


def fit_scaling(
    x: np.ndarray, y: np.ndarray, n_classes: int, strength: float = 1.0, iterations: int = 50
) -> np.ndarray:
    """The scaling form of :func:`fit_multinomial`: posterior(c) = softmax_c(a x_c + b_c), one scale ``a`` on the
    log-probabilities and one bias b_c per class, by Newton's method with a backtracking line search minimising
    0.5 (a^2 + |b|^2) + strength * sum_n cross-entropy. Returned as :func:`fit_multinomial`'s theta [K + 1, K]
    (a times the identity, then the biases), so both forms are used alike. Deterministic; x [n, K], y int [n]."""
    k = n_classes
    x = np.asarray(x, dtype=np.float64)
    targets = np.eye(k)[y]

    def objective(w: np.ndarray) -> float:  # w: a, then b
        return _penalised_cross_entropy(w, w[0] * x + w[1:], y, strength)

    def derivatives(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = _softmax(w[0] * x + w[1:])
        residual = p - targets
        gradient = w + strength * np.concatenate([[(residual * x).sum()], residual.sum(0)])
        centred = x - (p * x).sum(1, keepdims=True)  # x less its mean under p, per row
        hessian = np.eye(k + 1)
        hessian[0, 0] += strength * float((p * centred**2).sum())
        cross = strength * (p * centred).sum(0)
        hessian[0, 1:] += cross
        hessian[1:, 0] += cross
        hessian[1:, 1:] += strength * (np.diag(p.sum(0)) - p.T @ p)
        return gradient, hessian

    w = _newton(objective, derivatives, np.zeros(k + 1), iterations)
    theta = np.zeros((k + 1, k))
    theta[:-1] = w[0] * np.eye(k)
    theta[-1] = w[1:]
    return theta


def _softmax(z: np.ndarray) -> np.ndarray:
    p = np.exp(z - z.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True)


def _penalised_cross_entropy(w: np.ndarray, z: np.ndarray, y: np.ndarray, strength: float) -> float:
    """0.5 |w|^2 + strength * the cross-entropy of the scores z [n, K] against the labels y."""
    z = z - z.max(1, keepdims=True)
    return float(0.5 * (w * w).sum() - strength * (z[np.arange(len(y)), y] - np.log(np.exp(z).sum(1))).sum())


def _newton(
    objective: Callable[[np.ndarray], float],
    derivatives: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
    w: np.ndarray,
    iterations: int,
) -> np.ndarray:
    """The minimum of a convex ``objective`` by Newton's method from ``w``, each step (one linear solve with
    ``derivatives``' gradient, shaped as w, and Hessian, flat) halved until it decreases the objective enough
    (Armijo); stops when a step gains less than 1e-10 of the objective."""
    value = objective(w)
    for _ in range(iterations):
        gradient, hessian = derivatives(w)
        step = np.linalg.solve(hessian, gradient.ravel()).reshape(w.shape)
        size, decrease = 1.0, float((gradient * step).sum())
        while True:
            candidate = w - size * step
            new_value = objective(candidate)
            if new_value <= value - 1e-4 * size * decrease or size < 1e-6:
                break
            size *= 0.5
        w, done = candidate, value - new_value < 1e-10 * max(1.0, abs(value))
        value = new_value
        if done:
            break
    return w


def _hessian(features: np.ndarray, p: np.ndarray) -> np.ndarray:
    """The cross-entropy's Hessian in theta, sum_n kron(f_n f_n^T, diag(p_n) - p_n p_n^T), as [(d + 1) K, (d + 1) K]
    (rows and columns ordered feature-major, as theta.ravel()), by matrix products: one block per class on the
    diagonal, less the Gram matrix of the f_n (x) p_n."""
    n, width = features.shape
    k = p.shape[1]
    hessian = np.zeros((width, k, width, k))
    for j in range(k):
        hessian[:, j, :, j] = (features * p[:, j : j + 1]).T @ features
    outer = (features[:, :, None] * p[:, None, :]).reshape(n, width * k)
    return hessian.reshape(width * k, width * k) - outer.T @ outer


def log_softmax(scores: np.ndarray) -> np.ndarray:
    return scores - np.logaddexp.reduce(scores, axis=-1, keepdims=True)


def naive_bayes_vote(calibrated: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """The vote of k models from their calibrated log-posteriors [k, C] and the label prior [C]: log-probabilities
    [C] proportional to sum_i log q_i(c) - (k - 1) log prior(c)."""
    return log_softmax(calibrated.sum(0) - (len(calibrated) - 1) * np.log(prior))


def pool_vote(rows: np.ndarray, pool: np.ndarray, prior: np.ndarray) -> np.ndarray | None:
    """A pool's vote (:func:`naive_bayes_vote`) from its query's calibrated rows [M, C]
    (:meth:`StreamCalibration.calibrated_rows`); None while a member has none."""
    members = rows[pool]
    if np.isnan(members).any():
        return None
    return naive_bayes_vote(members, prior)


def pool_votes(rows: np.ndarray, pools: np.ndarray, priors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pool_vote` of B queries with as many choices: rows [B, M, C], pools bool [B, M], priors [B, C] -> the
    votes [B, C] and whether each has one (bool [B]; its vote row is meaningless where not). The same numbers as one
    by one: a non-member adds an exact 0 to the members' sum."""
    members = pools[:, :, None]
    voted = ~(np.isnan(rows) & members).any((1, 2))
    scores = np.where(members, rows, 0.0).sum(1) - (pools.sum(1, keepdims=True) - 1) * np.log(priors)
    with np.errstate(invalid="ignore"):
        return log_softmax(np.where(voted[:, None], scores, 0.0)), voted


class StreamCalibration:
    """Per model, its last ``rows`` labelled outcomes on one stream and its calibration per choice count, refitted
    once ``refit_every`` new rows of the model have come since the last fit."""

    def __init__(
        self,
        n_models: int,
        rows: int,
        refit_every: int = 16,
        min_rows: int = 16,
        strength: float = 1.0,
        joint_rows: int = 0,
        scaling_below: int = 10,
    ):
        self.n_models, self.rows, self.refit_every, self.min_rows, self.strength = (
            n_models,
            rows,
            refit_every,
            min_rows,
            strength,
        )
        # rows a choice under which a fit is the scaling form (chosen on bbh_dev's tuning half)
        self.scaling_below = scaling_below
        self.combiner = PoolCombiner(joint_rows, strength) if joint_rows else None  # None: the vote alone
        self.history: list[deque] = [deque(maxlen=rows) for _ in range(n_models)]  # (log p [C], label) per model
        self.labels: deque = deque(maxlen=rows)
        self.seen = np.zeros(n_models, dtype=np.int64)  # rows ever pushed per model
        self.fits: dict[tuple[int, int], tuple[int, np.ndarray]] = {}  # (model, C) -> (seen at the fit, theta)
        self._priors: dict[int, np.ndarray] = {}  # per choice count, until the next push

    def push(self, probs: np.ndarray, called: np.ndarray, label: int, pool: np.ndarray | None = None) -> None:
        """One answered query: ``probs`` [M, C] (rows of models not called are ignored), ``called`` bool [M], the
        label (position among the C choices; a label outside them, or -1, adds nothing), the pool that answered."""
        n_choices = probs.shape[1]
        if not 0 <= label < n_choices:
            return
        self.labels.append((n_choices, label))
        self._priors.clear()
        log_p = np.log(np.maximum(probs, LOG_FLOOR))
        for m in np.flatnonzero(called):
            self.history[m].append((n_choices, log_p[m], label))
            self.seen[m] += 1
        if self.combiner is not None:
            self.combiner.push(log_p, called, pool, label)

    def _theta(self, model: int, n_choices: int, start: np.ndarray | None = None) -> np.ndarray | None:
        """The model's calibration over ``n_choices`` choices, fitted again once ``refit_every`` new rows came; None
        before ``min_rows`` rows. Below ``scaling_below`` rows a choice the scaling form, from zero (C + 1 weights:
        a few Newton steps); from then the full form, from the last fit (or ``start``: fewer Newton steps to the same
        minimum)."""
        fitted = self.fits.get((model, n_choices))
        if fitted is not None and self.seen[model] - fitted[0] < self.refit_every:
            return fitted[1]
        rows = [(x, y) for c, x, y in self.history[model] if c == n_choices]
        if len(rows) < self.min_rows:
            return None if fitted is None else fitted[1]
        inputs, labels = np.stack([x for x, _ in rows]), np.array([y for _, y in rows])
        if len(rows) < self.scaling_below * n_choices:
            theta = fit_scaling(inputs, labels, n_choices, self.strength)
        else:
            last = start if fitted is None else fitted[1]
            theta = fit_multinomial(inputs, labels, n_choices, self.strength, start=last)
        self.fits[model, n_choices] = (int(self.seen[model]), theta)
        return theta

    def prior(self, n_choices: int) -> np.ndarray:
        """The stream's label frequency over ``n_choices`` choices, add-one smoothed."""
        if n_choices not in self._priors:
            counts = self._counts(n_choices)
            self._priors[n_choices] = counts / counts.sum()
        return self._priors[n_choices]

    def _counts(self, n_choices: int) -> np.ndarray:
        """Each choice's count among the labels of questions with ``n_choices`` choices, plus one."""
        counts = np.ones(n_choices)
        for c, label in self.labels:
            if c == n_choices:
                counts[label] += 1
        return counts

    def vote(self, probs: np.ndarray, pool: np.ndarray) -> np.ndarray | None:
        """The pool's calibrated naive-Bayes vote: log-probabilities [C] over the choices of ``probs`` [M, C], or
        None while a member has no calibration for this choice count."""
        return pool_vote(self.calibrated_rows(probs, pool, for_vote=True), pool, self.prior(probs.shape[1]))

    def joint(self, probs: np.ndarray, pool: np.ndarray) -> np.ndarray | None:
        """The pool's joint log-probabilities [C] (:class:`PoolCombiner`), its fits made again first when due; None
        where it has none (the pool's vote then)."""
        if self.combiner is None:
            return None
        if self.combiner.due():
            self.combiner.refit(self.votes_of)
        return self.combiner.combined(probs, pool)

    def votes_of(self, log_p: np.ndarray, pool: np.ndarray) -> np.ndarray | None:
        """The pool's vote (:func:`naive_bayes_vote`) on each of the queries ``log_p`` [n, M, C] (floored
        log-probabilities; the vote's log-probabilities [n, C]), or None while a member has no calibration for C
        choices: what a joint fit must beat (:class:`PoolCombiner`)."""
        n_choices = log_p.shape[2]
        members = np.flatnonzero(pool)
        calibrated = np.zeros(log_p.shape[::2])
        for m in members:
            theta = self._theta(int(m), n_choices)
            if theta is None:
                return None
            calibrated += log_softmax(log_p[:, m] @ theta[:-1] + theta[-1])
        return log_softmax(calibrated - (len(members) - 1) * np.log(self.prior(n_choices)))

    def calibrated_rows(self, probs: np.ndarray, models: np.ndarray, for_vote: bool = False) -> np.ndarray:
        """:meth:`calibrated` of each of ``models`` (bool [M]) given ``probs`` [M, C]: [M, C], NaN rows for the other
        models and those with no calibration for this choice count yet. Computed once, a query's rows give any pool
        of its models a vote (:func:`pool_vote`). ``for_vote``: ``models`` is a pool, and the rows stop at its first
        member without a calibration (it has no vote; a later member's fit, due, is then made at its next use)."""
        out = np.full(probs.shape, np.nan)
        n_choices = probs.shape[1]
        fitted = []
        for m in np.flatnonzero(models).tolist():
            theta = self._theta(m, n_choices)
            if theta is not None:
                fitted.append((m, theta))
            elif for_vote:
                return out
        if not fitted:
            return out
        index = [m for m, _ in fitted]
        log_p = np.log(np.maximum(probs[index], LOG_FLOOR))
        scores = np.stack([x @ theta[:-1] + theta[-1] for x, (_, theta) in zip(log_p, fitted)])
        out[index] = log_softmax(scores)  # the numbers :meth:`calibrated` gives row by row
        return out

    def calibrated(self, probs: np.ndarray, model: int) -> np.ndarray | None:
        """Model ``model``'s calibrated log-posterior [C] given its distribution ``probs`` [C]; None while it has no
        calibration for this choice count."""
        theta = self._theta(model, len(probs))
        if theta is None:
            return None
        return log_softmax(np.log(np.maximum(probs, LOG_FLOOR)) @ theta[:-1] + theta[-1])

    def fit_all(self, starts: dict | None = None, joint_starts: dict | None = None) -> None:
        """Fit every (model, choice count) that has ``min_rows`` rows, then the pools' joint fits where the stream's
        queries are kept whole (the service's learner, before it publishes). Each full fit starts from the last one
        (fewer Newton steps to the same minimum): this one's :attr:`fits` and its combiner's, or ``starts`` and
        ``joint_starts`` (the learner's last fits of a stream it loaded afresh)."""
        starts = dict(self.fits if starts is None else starts)
        self.fits = {}
        for model, history in enumerate(self.history):
            for n_choices in sorted({c for c, _, _ in history}):
                last = starts.get((model, n_choices))
                self._theta(model, n_choices, start=None if last is None else last[1])
        if self.combiner is not None and self.combiner.history:
            self.combiner.refit(self.votes_of, joint_starts)

    def state(self) -> dict:
        """The fits, the label counts (add-one) and the pools' joint fits (``joint``: members, choice count, theta)
        as JSON-ready lists: what a worker needs to vote (:meth:`restored`), 6 significant digits."""
        state = {
            "fits": [[m, c, significant(theta).tolist()] for (m, c), (_, theta) in sorted(self.fits.items())],
            "prior": [[c, self._counts(c).astype(int).tolist()] for c in sorted({c for c, _ in self.labels})],
        }
        if self.combiner is not None and self.combiner.fits:
            state["joint"] = [
                [np.flatnonzero(np.frombuffer(pool, dtype=bool)).tolist(), c, significant(theta).tolist()]
                for (pool, c), theta in sorted(self.combiner.fits.items())
            ]
        return state

    @classmethod
    def restored(cls, n_models: int, state: dict) -> StreamCalibration:
        """A calibration that votes with published fits, label counts and joint fits (:meth:`state`) and keeps no
        rows."""
        calibration = cls(n_models, rows=1)
        for model, n_choices, theta in state["fits"]:
            calibration.fits[int(model), int(n_choices)] = (0, np.asarray(theta, dtype=np.float64))
        for n_choices, counts in state["prior"]:
            counts = np.asarray(counts, dtype=np.float64)
            calibration._priors[int(n_choices)] = counts / counts.sum()
        if state.get("joint"):
            calibration.combiner = PoolCombiner(rows=1)
            for members, n_choices, theta in state["joint"]:
                pool = np.zeros(n_models, dtype=bool)
                pool[list(members)] = True
                calibration.combiner.fits[pool.tobytes(), int(n_choices)] = np.asarray(theta, dtype=np.float64)
        return calibration


class PoolCombiner:
    """A stream's last ``rows`` labelled queries whole (each called model's log-probabilities, the pool that answered,
    the label) and a joint fit for each of its ``pools`` most served pools and each choice count: a multinomial
    logistic regression from the members' log-probabilities (concatenated) to the label (:func:`fit_multinomial`) on
    the rows where every member was called, from ``min_rows`` of them (default an eighth of ``rows``, at least 100: a
    joint fit has k times a calibration's parameters, and on short streams it lost to the vote, BENCHMARKS.md).

    The fits are made again each time the rows grow by a tenth (at least ``refit_every``, at most ``refit_most``). A
    fit is kept only where it beat the pool's vote on the newest fifth of its rows (mean log-likelihood, fitted on
    the older four fifths; the vote there uses the stream's current calibrations, which saw those rows: a comparison
    that favours the vote)."""

    def __init__(
        self,
        rows: int,
        strength: float = 1.0,
        pools: int = 8,
        min_rows: int | None = None,
        refit_every: int = 16,
        refit_most: int = 256,
    ):
        self.rows, self.strength, self.pools = rows, strength, pools
        self.min_rows = max(100, rows // 8) if min_rows is None else min_rows
        self.refit_every, self.refit_most = refit_every, refit_most
        self.history: deque = deque(maxlen=rows)  # (log p [M, C], called [M], served pool bytes, label)
        self.seen, self.fitted_at = 0, 0
        self.fits: dict[tuple[bytes, int], np.ndarray] = {}  # (pool, C) -> theta, where it beat the vote

    def push(self, log_p: np.ndarray, called: np.ndarray, pool: np.ndarray | None, label: int) -> None:
        """One labelled query: the models' log-probabilities [M, C], which were called, the pool that answered."""
        served = None if pool is None else np.asarray(pool, dtype=bool).tobytes()
        self.history.append((log_p, np.asarray(called, dtype=bool), served, label))
        self.seen += 1

    def due(self) -> bool:
        """Whether the rows grew enough since the last fits to make them again (the learner asks it too)."""
        grown = self.seen - self.fitted_at
        return grown >= min(max(self.refit_every, self.fitted_at // 10), self.refit_most)

    def refit(self, votes_of, starts: dict | None = None) -> None:
        """Fit the most served pools again, each from its last fit (or ``starts``'); ``votes_of(log_p [n, M, C],
        pool)`` gives the vote's log-probabilities [n, C] there (None: no vote yet, and then no joint fit either)."""
        if len(self.history) < self.min_rows:
            return  # no pool can have a fit yet
        starts = self.fits if starts is None else starts
        self.fitted_at = self.seen
        served = Counter(pool for _, _, pool, _ in self.history if pool is not None)
        by_choices = {}  # C -> the rows over C choices: log p [n, M, C], called [n, M], labels [n]
        for n_choices in sorted({x.shape[1] for x, _, _, _ in self.history}):
            rows = [row for row in self.history if row[0].shape[1] == n_choices]
            by_choices[n_choices] = (
                np.stack([x for x, _, _, _ in rows]),
                np.stack([called for _, called, _, _ in rows]),
                np.array([y for _, _, _, y in rows]),
            )
        fits = {}
        for key, _ in served.most_common(self.pools):
            pool = np.frombuffer(key, dtype=bool)
            for n_choices, (log_p, called, labels) in by_choices.items():
                members = called[:, pool].all(1)  # the rows where every member was called
                theta = self._fit(pool, log_p[members], labels[members], votes_of, starts.get((key, n_choices)))
                if theta is not None:
                    fits[key, n_choices] = theta
        self.fits = fits

    def _fit(
        self, pool: np.ndarray, log_p: np.ndarray, labels: np.ndarray, votes_of, start: np.ndarray | None
    ) -> np.ndarray | None:
        """The pool's joint fit on the rows ``log_p`` [n, M, C] where every member was called, or None; ``start``:
        its last one (fewer Newton steps)."""
        n, n_choices = len(labels), log_p.shape[2]
        if n < self.min_rows:
            return None
        features = log_p[:, pool].reshape(n, -1)
        cut = n - n // 5
        votes = votes_of(log_p[cut:], pool)
        if votes is None:
            return None
        theta = fit_multinomial(features[:cut], labels[:cut], n_choices, self.strength, start=start)
        held = np.arange(n - cut), labels[cut:]
        if log_softmax(features[cut:] @ theta[:-1] + theta[-1])[held].mean() <= votes[held].mean():
            return None
        return fit_multinomial(features, labels, n_choices, self.strength, start=theta)

    def combined(self, probs: np.ndarray, pool: np.ndarray) -> np.ndarray | None:
        """The pool's joint log-probabilities [C] given ``probs`` [M, C], or None (it has no joint fit: its vote)."""
        theta = self.fits.get((np.asarray(pool, dtype=bool).tobytes(), probs.shape[1]))
        if theta is None:
            return None
        features = np.log(np.maximum(probs[pool], LOG_FLOOR)).ravel()
        return log_softmax(features @ theta[:-1] + theta[-1])


def significant(values: np.ndarray, digits: int = 6) -> np.ndarray:
    """``values`` rounded to ``digits`` significant digits (what a logged distribution or a published fit keeps)."""
    values = np.asarray(values, dtype=np.float64)
    with np.errstate(divide="ignore"):
        magnitude = np.floor(np.log10(np.abs(values)))
    scale = 10.0 ** (digits - 1 - np.where(np.isfinite(magnitude), magnitude, 0.0))
    return np.round(values * scale) / scale


class Calibrations:
    """The :class:`StreamCalibration` of each stream key (created on first use)."""

    def __init__(self, n_models: int, rows: int, refit_every: int = 16, joint_rows: int = 0):
        self.n_models, self.rows, self.refit_every, self.joint_rows = n_models, rows, refit_every, joint_rows
        self.streams: dict[Hashable, StreamCalibration] = {}

    def __call__(self, key: Hashable) -> StreamCalibration:
        if key not in self.streams:
            self.streams[key] = StreamCalibration(
                self.n_models, self.rows, self.refit_every, joint_rows=self.joint_rows
            )
        return self.streams[key]

    def clear(self) -> None:
        self.streams.clear()
