"""Guarded promotion (``RLENS_PROMOTION=gated``): a policy the learner trains is published as a *candidate*; the
workers serve the champion and log the candidate's greedy action beside it (:class:`rlens.messages.Shadow`, no extra
model call); the gate promotes the candidate only when, after at least ``min_events`` labelled queries, the lower
95 % bound of (candidate − champion) reward is at least −``delta``, and drops it after ``max_events`` without.

After a promotion the champion it replaced is scored in shadow in its turn (*probation*), and judged once, after
``min_events``: if the new champion's reward falls below it by more than ``delta`` with confidence (the lower bound
of their difference above ``delta``), the learner rolls back to it; otherwise the new champion has passed. Only then
does the next candidate come. (The two thresholds, −delta to promote and +delta to roll back, keep a candidate
within delta of its predecessor from going back and forth. One look keeps the rollback's error rate at its bound's
2.5 %: looking again every ``every`` queries up to ``max_events`` rolled good promotions back, BENCHMARKS.md.)

The difference is estimated per query as the replay estimator does (:mod:`rlens.evaluation.logged`): exact where the
query called every model the candidate's pool needs, a ridge reward model of the candidate elsewhere, that model's
mean error measured, and corrected, on the probe rows (a random sample with every answer known). The champion's
reward is always exact: it served the query.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from rlens.evaluation.logged import LoggedQuery, pool_features, replay_estimate, reward
from rlens.evaluation.ope import Estimate
from rlens.messages import Experience

log = logging.getLogger("rlens.learner")
Verdict = Literal["promote", "drop", "roll back", "passed"]
Kind = Literal["challenger", "probation"]


@dataclass(frozen=True)
class GateConfig:
    min_events: int = 400  # labelled queries scored in shadow before any verdict
    max_events: int = 4000  # without a promotion by then, the candidate is dropped (probation: one look, at min_events)
    every: int = 50  # queries between two looks at the evidence
    delta: float = 0.02  # the reward a candidate may lose against the champion, at the lower 95 % bound
    drift_reset: bool = False  # a drift detection restarts the candidate's evidence (only what came after counts)


@dataclass
class Evidence:
    champion: list[float] = field(default_factory=list)  # the served reward, per query
    candidate: list[float | None] = field(default_factory=list)  # the candidate's reward where known
    features: list[np.ndarray] = field(default_factory=list)  # the reward model's view of the candidate's pool
    probe: list[bool] = field(default_factory=list)
    held: list[bool] = field(default_factory=list)  # the served pool held the candidate's pool

    def __len__(self) -> int:
        return len(self.champion)


class Gate:
    def __init__(self, config: GateConfig, cost_share: np.ndarray, alpha: float):
        self.config, self.cost_share, self.alpha = config, cost_share, alpha
        self.champion: tuple[int, int] | None = None  # (epoch, version) the workers serve, when known
        self.champion_tensors: dict[str, torch.Tensor] | None = None
        self.candidate: tuple[int, int] | None = None
        self.candidate_tensors: dict[str, torch.Tensor] | None = None
        self.kind: Kind = "challenger"  # probation: the candidate is the champion the last promotion replaced
        self.previous: dict[str, torch.Tensor] | None = None  # that champion's weights, until its probation ends
        self.evidence = Evidence()
        self.last: Estimate | None = None  # the latest estimate of candidate − champion
        self._looked_at = 0  # evidence size at the last look

    def propose(self, order: tuple[int, int], tensors: dict[str, torch.Tensor], kind: Kind = "challenger") -> None:
        self.candidate, self.candidate_tensors, self.evidence, self.last = order, tensors, Evidence(), None
        self.kind, self._looked_at = kind, 0

    def observe(self, experience: Experience, label: int) -> None:
        """One labelled query the champion served, if it carries the current candidate's shadow action."""
        shadow, behaviour = experience.shadow, experience.behaviour
        if shadow is None or behaviour is None or (shadow.epoch, shadow.version) != self.candidate or label < 0:
            return
        query = LoggedQuery.from_experience(experience, label)
        pool = np.asarray(shadow.pool, dtype=bool)
        e = self.evidence
        e.champion.append(reward(query.pool, query.answer, label, self.cost_share, self.alpha))
        e.candidate.append(
            reward(pool, shadow.answer, label, self.cost_share, self.alpha) if shadow.answer >= 0 else None
        )
        e.features.append(pool_features(query, pool, self.cost_share))
        e.probe.append(behaviour.probe)
        e.held.append(not (pool & ~query.pool).any())

    def estimate(self) -> Estimate:
        """Candidate − champion reward per query (:func:`rlens.evaluation.logged.replay_estimate`)."""
        e = self.evidence
        estimate, _ = replay_estimate(
            e.candidate, np.array(e.features), np.array(e.probe), np.array(e.held), np.array(e.champion)
        )
        return estimate

    def verdict(self) -> Verdict | None:
        """A challenger: promote, drop, or None (keep collecting); on probation: roll back or passed (or None before
        ``min_events``)."""
        n = len(self.evidence)
        if self.candidate is None or n < self.config.min_events or n - self._looked_at < self.config.every:
            return None
        self._looked_at = n
        self.last = self.estimate()
        done = n >= self.config.max_events
        if self.kind == "probation":
            return "roll back" if self.last.low > self.config.delta else "passed"
        return "promote" if self.last.low >= -self.config.delta else "drop" if done else None

    def drifted(self) -> bool:
        """A drift was detected: with ``drift_reset``, the candidate's evidence starts again. Whether it did."""
        if not self.config.drift_reset or self.candidate is None or not len(self.evidence):
            return False
        self.evidence, self.last, self._looked_at = Evidence(), None, 0
        return True

    def promoted(self) -> None:
        """The candidate is the champion now; a challenger's predecessor is kept for its probation."""
        self.previous = self.champion_tensors if self.kind == "challenger" else None
        self.champion, self.champion_tensors = self.candidate, self.candidate_tensors
        self.candidate, self.candidate_tensors = None, None

    def dropped(self) -> None:
        self.candidate, self.candidate_tensors = None, None
        if self.kind == "probation":
            self.previous = None
