"""Sliding window of recent outcomes per stream key (pure, in memory).

Each row is one answered query: for every model whether it was right (1), wrong (0) or not called (-1),
its predicted choice (-1 when not called), the correct label (-1 when feedback gave only a reward) and the
reward the ensemble received. Only models that were actually called have outcomes, so pool statistics use
the rows on which every member of the pool was observed.
"""

from __future__ import annotations

import numpy as np

from rlens.focal.metrics import METRIC_NAMES, diversity_metrics, focal_diversity
from rlens.focal.voting import choice_counts


class OutcomeWindow:
    """Ring buffer of the last ``size`` outcomes of one stream."""

    def __init__(self, n_models: int, size: int):
        if size < 1:
            raise ValueError("window size must be at least 1")
        self.n_models, self.size = n_models, size
        self.correct = np.full((size, n_models), -1, dtype=np.int8)
        self.predictions = np.full((size, n_models), -1, dtype=np.int16)
        self.labels = np.full(size, -1, dtype=np.int16)
        self.rewards = np.zeros(size, dtype=np.float32)
        self.count = 0  # rows ever pushed
        self._reliability: np.ndarray | None = None  # cached until the next push
        self._label_prior: dict[int, np.ndarray] = {}  # per choice count, cached until the next push

    def push(self, predictions: np.ndarray, label: int, reward: float) -> None:
        """Record one query: ``predictions`` int [M] with -1 for models not called, the label (-1 if unknown)."""
        row = self.count % self.size
        predictions = np.asarray(predictions)
        observed = predictions >= 0
        self.predictions[row] = predictions
        if label >= 0:
            self.correct[row] = np.where(observed, predictions == label, -1)
        else:  # reward-only feedback: nothing is known of the models' correctness
            self.correct[row] = -1
        self.labels[row] = label
        self.rewards[row] = reward
        self.count += 1
        self._forget_cache()

    def extend(self, predictions: np.ndarray, labels: np.ndarray, rewards: np.ndarray) -> None:
        """Record several queries at once, in order: ``predictions`` int [n, M], ``labels`` int [n], ``rewards`` [n];
        the same as :meth:`push` on each row in turn."""
        n = len(labels)
        keep = min(n, self.size)  # only the last ``size`` rows stay
        predictions, labels = np.asarray(predictions)[n - keep :], np.asarray(labels)[n - keep :]
        rows = (self.count + n - keep + np.arange(keep)) % self.size
        correct = np.where(predictions >= 0, predictions == labels[:, None], -1)
        correct[labels < 0] = -1  # reward-only feedback: nothing is known of the models' correctness
        self.predictions[rows], self.correct[rows] = predictions, correct
        self.labels[rows], self.rewards[rows] = labels, np.asarray(rewards)[n - keep :]
        self.count += n
        self._forget_cache()

    def keep_last(self, k: int) -> None:
        """Forget all but the last ``k`` rows, in order (a reaction to drift: the old task's outcomes go)."""
        n = min(k, self.n_rows)
        index = (self.count - n + np.arange(n)) % self.size
        rows = [(self.predictions[i].copy(), int(self.labels[i]), float(self.rewards[i])) for i in index]
        self.correct[:], self.predictions[:], self.labels[:], self.rewards[:] = -1, -1, -1, 0.0
        self.count = 0
        self._forget_cache()
        for predictions, label, reward in rows:
            self.push(predictions, label, reward)

    def _forget_cache(self) -> None:
        self._reliability = None
        self._label_prior.clear()

    @property
    def n_rows(self) -> int:
        return min(self.count, self.size)

    @property
    def fill(self) -> float:
        return self.n_rows / self.size

    def _valid(self) -> slice:
        return slice(0, self.n_rows)

    def reliability(self) -> np.ndarray:
        """Per-model accuracy over its observed rows, Laplace-smoothed: (right + 1) / (observed + 2)."""
        if self._reliability is None:
            c = self.correct[self._valid()]
            right = (c == 1).sum(0)
            seen = (c >= 0).sum(0)
            self._reliability = ((right + 1.0) / (seen + 2.0)).astype(np.float32)
        return self._reliability

    def label_prior(self, n_choices: int) -> np.ndarray:
        """Frequency of each choice index among the known labels of the window (zeros when none); do not modify it
        (cached until the next push)."""
        if n_choices not in self._label_prior:
            labels = self.labels[self._valid()]
            labels = labels[(labels >= 0) & (labels < n_choices)]
            prior = np.zeros(n_choices) if labels.size == 0 else np.bincount(labels, minlength=n_choices) / labels.size
            self._label_prior[n_choices] = prior.astype(np.float32)
        return self._label_prior[n_choices]

    def recent_reward(self, last: int) -> float:
        """Mean reward of the last ``last`` rows (0 when empty)."""
        n = self.n_rows
        if n == 0:
            return 0.0
        k = min(last, n)
        index = (self.count - 1 - np.arange(k)) % self.size
        return float(self.rewards[index].mean())

    def pool_rows(self, pool: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """correct bool [n, k], predictions [n, k], labels [n] on the rows where every pool member was observed."""
        members = np.flatnonzero(pool)
        n = self.n_rows
        c = self.correct[:n, members]
        rows = np.flatnonzero((c >= 0).all(1))
        return c[rows].astype(bool), self.predictions[rows[:, None], members].astype(np.int64), self.labels[rows]

    def marginal_focal_diversity(self, pool: np.ndarray) -> np.ndarray:
        """Per model j, the change in ``pool``'s focal diversity that j makes: FD(pool) - FD(pool without j) for a
        member, FD(pool with j) - FD(pool) for an outsider, on the window rows where the pool and j were all observed
        (0 with fewer than 2 such rows). Positive: j fails where the others do not (it adds error diversity)."""
        correct = self.correct[self._valid()]
        out = np.zeros(self.n_models, dtype=np.float32)
        for j in range(self.n_models):
            with_j = pool.copy()
            with_j[j] = True
            members = np.flatnonzero(with_j)
            rows = (correct[:, members] >= 0).all(1)
            if rows.sum() < 2:
                continue
            right = correct[rows][:, members] == 1
            others = members != j
            out[j] = focal_diversity(right) - focal_diversity(right[:, others])
        return out

    def pool_statistics(
        self, pool: np.ndarray, metric_names: tuple[str, ...] = METRIC_NAMES
    ) -> tuple[np.ndarray, float]:
        """Diversity metrics of ``pool`` and the accuracy of its plurality vote over the window (0.5 when unknown)."""
        correct, predictions, labels = self.pool_rows(pool)
        if not len(labels):
            return diversity_metrics(correct, predictions, metric_names), 0.5
        counts = choice_counts(predictions, int(max(predictions.max(), labels.max()) + 1))  # votes per row and choice
        metrics = diversity_metrics(correct, predictions, metric_names, counts)
        known = int((labels >= 0).sum())
        if not known:
            return metrics, 0.5
        # plurality_vote's answer from the same counts (ties to the lowest choice) against the known labels (an
        # unknown label, -1, is never a vote's choice)
        return metrics, float((counts.argmax(1) == labels).sum() / known)
