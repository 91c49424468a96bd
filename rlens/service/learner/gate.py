"""Guarded promotion (``RLENS_PROMOTION=gated``): a policy the learner trains is published as a *candidate*; the
workers serve the champion and log the candidate's greedy action beside it (:class:`rlens.messages.Shadow`, no extra
model call but on probation, below). The gate looks at the (candidate − champion) reward every ``every`` labelled queries from
``min_events`` on, through anytime-valid bounds (:func:`anytime_bounds`, a confidence sequence: the chance that the
truth ever leaves them is 5 %, however often they are looked at). It promotes the candidate when the lower bound is
at least −``delta``, and drops it when the upper bound is below −``delta`` (shown worse), or after ``max_events``.

After a promotion the champion it replaced is scored in shadow in its turn (*probation*), looked at the same way:
as soon as the new champion's reward falls below it by more than ``delta`` with confidence (the lower bound of their
difference above ``delta``), however late, the learner rolls back to it; as soon as the upper bound is below
``delta`` (the new champion shown within delta of it), or after ``max_events`` with the estimate at most ``delta``,
the new champion has passed. A probation whose estimate still leans to the replaced champion at ``max_events`` is
watched on, up to ``WATCH`` times as long: a worse policy is rolled back whenever the bounds show it. Only then does
the next candidate come. (The two thresholds, −delta to promote and +delta to roll back, keep a candidate
within delta of its predecessor from going back and forth. A fixed 95 % interval looked at again and again rolled
good promotions back, so probation used to be one look, which a bad policy could survive on one lucky draw, issue
61; the confidence sequence's error holds over every look.)

rl_focal (:class:`ShadowEvidence`): the difference is estimated per query as the replay estimator does
(:mod:`rlens.evaluation.logged`): exact where the query called every model the candidate's pool needs, a ridge reward
model of the candidate elsewhere (the champion's reward on the query among its features), that model's mean error
measured, and corrected, on the probe rows (a random sample with every answer known). The replaced champion on
probation is published with ``shadow_calls`` (:attr:`GateConfig.shadow_calls`): on that share of the queries the
workers also call the models its pool needs, so that its evidence is exact and paired, and a worse policy is shown
worse sooner (BENCHMARKS.md). The candidate's reward is the one it would get serving, under the serving mixture in
force (:meth:`Gate.serving_reward`, as ``rlens ope`` judges it): its greedy answer on the greedy share, an answer sampled
from its Fusion on the explored share (the calibrated vote shields the greedy answers from a Fusion trained to be
wrong, not the explored ones). The champion's reward is always exact: it served the query.

rlae (:class:`SplitEvidence`): RLAE's span weights change what the models generate, so the champion's answer says
nothing of the candidate's, and an estimate from the champion's log was not good enough (BENCHMARKS.md, "RLAE's
continuous span weights"). The candidate serves a random share of the queries itself (an A/B split, drawn by the
workers), and the difference is that of the two arms' mean rewards over the same period, with Welch's interval;
``min_events`` counts the scarcer arm's queries (the candidate's own, at a split under one half). A challenger is
judged at one look, with that interval, and so is probation: promoted or dropped, and the learner's newest weights
are the next candidate (a candidate that keeps collecting holds back the newer weights).

rlae, holdback (``GateConfig.holdback``, ``RLENS_PROMOTION=holdback``): the other way round. While the learner is
trusted, every update is the candidate at once and serves most of the queries (its *line*); the champion, the last
policy shown not worse, keeps serving the holdback share as the control. The line's evidence counts every candidate
since the last verdict, the newest replacing the one before without restarting it. After ``min_events`` of the
control's queries the line is looked at, then every ``every`` more: rolled back when the control leads it by more
than ``delta`` with confidence (the anytime-valid upper bound of line − control below −delta; the learner is reset
to the champion, and no longer trusted), verified when its lower bound is at least −delta (the newest weights become
the champion); after ``max_events`` without either, inconclusive (the evidence starts again, the line serves on). An
untrusted learner's updates are challengers as under gated promotion, each serving the small ``split``, judged once:
promoted as under gated promotion, or, when its mean reward is within delta of the champion's though its bound is
not, the learner is trusted again (*resume*: the next update starts a line; the champion stays); else dropped. So a
learner whose updates serve at once keeps what it gains from recency, at the price of serving what went wrong until
the evidence shows it.

rl_focal, holdback: no split is needed, since the champion can be scored in shadow. The line serves every query
(each update published live at once) and the champion is the shadow policy beside it: republished as a candidate
under a number above each of the line's updates, so that the workers score it (they score only candidates newer
than what they serve). The evidence is the replay estimate of (champion − line) per query, turned round to (line −
champion) for the verdicts above; queries the line did not serve do not count. A verified line is republished live
under a new number, so the workers stop scoring the old champion.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np
import torch

from rlens.evaluation.logged import (
    Action,
    LoggedQuery,
    explore_share,
    mixed_value,
    pool_features,
    replay_estimate,
    reward,
)
from rlens.evaluation.ope import Estimate
from rlens.messages import Experience, RLAEExperience, Shadow

log = logging.getLogger("rlens.learner")
Verdict = Literal["promote", "drop", "roll back", "passed", "inconclusive", "resume"]
Kind = Literal["challenger", "probation", "line"]
Z95 = 1.959963984540054  # the normal's 97.5 % quantile
ALPHA = 0.05  # the anytime-valid bounds' error: the chance that they ever exclude the truth, however often looked at
TUNED_VARIANCE = 0.25  # the per-query variance of a reward difference the bounds are tightest for, at min_events
WATCH = 10  # a probation still leaning to the replaced champion at max_events is watched on to WATCH × max_events


def anytime_bounds(e: Estimate, tightest_at: int, alpha: float = ALPHA) -> Estimate:
    """``e`` (a mean of ``e.n`` per-query differences with its normal 95 % interval) with a confidence sequence's
    bounds instead: Robbins' normal mixture (Howard et al. 2021), with the variance estimated as the asymptotic
    confidence sequences of Waudby-Smith et al. (2024) do. Bounds that hold at every look at once, so that the gate
    may look after every batch, for as long as it likes: the chance that the true difference ever leaves them is at
    most ``alpha``. The sum's variance V = n²·se²; the mixture's ρ² makes them tightest where V = ``tightest_at`` ·
    TUNED_VARIANCE; the half-width is √(2 (Vρ² + 1) / ρ² · ln(√(Vρ² + 1) / α)) / n."""
    if e.n == 0 or not all(math.isfinite(x) for x in (e.value, e.low, e.high)):
        return e
    variance = (e.n * (e.high - e.low) / (2 * Z95)) ** 2
    rho2 = (-2 * math.log(alpha) + math.log(1 - 2 * math.log(alpha))) / (tightest_at * TUNED_VARIANCE)
    half = math.sqrt(2 * (variance * rho2 + 1) / rho2 * math.log(math.sqrt(variance * rho2 + 1) / alpha)) / e.n
    return Estimate(e.value, e.value - half, e.value + half, e.n, e.ess)


def default_events(strategy: str, promotion: str) -> tuple[int, int, int]:
    """(min_events, max_events, every) where the settings leave the first two unset. rlae's were chosen on the zoo's
    validation streams (BENCHMARKS.md: gated, one look at 50 of the candidate's queries; holdback, looks at 25 and 50
    of the champion's queries); rl_focal's judge a candidate on shadow evidence over longer streams, and a line's
    evidence starts again after three times its first look (as ``bench.robustness.gate``'s 200 / 600)."""
    if strategy == "rlae":
        return (25, 50, 25) if promotion == "holdback" else (50, 50, 25)
    return (400, 1200, 50) if promotion == "holdback" else (400, 4000, 50)


@dataclass(frozen=True)
class GateConfig:
    min_events: int = 400  # labelled queries scored in shadow before any verdict
    # without a promotion by then, the candidate is dropped; probation passes then unless it leans to the replaced one
    max_events: int = 4000
    every: int = 50  # queries between two looks at the evidence
    delta: float = 0.02  # the reward a candidate may lose against the champion, at the lower 95 % bound
    drift_reset: bool = False  # a drift detection restarts the candidate's evidence (only what came after counts)
    split: float = 0.2  # rlae: the share of the queries a challenger (or a champion on probation) serves itself
    holdback: float | None = None  # holdback promotion; rlae: the champion's share while the line serves the rest
    # rl_focal: the share of the queries on which the workers also call what the replaced champion on probation needs:
    # exact, paired evidence (0: none)
    shadow_calls: float = 1.0


@dataclass
class ShadowEvidence:
    """rl_focal: the candidate's greedy action beside the champion's, on the champion's queries."""

    champion: list[float] = field(default_factory=list)  # the served reward, per query
    candidate: list[float | None] = field(default_factory=list)  # the candidate's reward where known
    features: list[np.ndarray] = field(default_factory=list)  # the reward model's view of the candidate's pool
    probe: list[bool] = field(default_factory=list)
    held: list[bool] = field(default_factory=list)  # the served pool held the candidate's pool

    def __len__(self) -> int:
        return len(self.champion)

    def estimate(self) -> Estimate:
        """Candidate − champion reward per query (:func:`rlens.evaluation.logged.replay_estimate`)."""
        estimate, _ = replay_estimate(
            self.candidate,
            np.array(self.features),
            np.array(self.probe),
            np.array(self.held),
            np.array(self.champion),
        )
        return estimate


@dataclass
class SplitEvidence:
    """rlae: the rewards of the queries each arm of the A/B split served, over the same period."""

    champion: list[float] = field(default_factory=list)
    candidate: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return min(len(self.candidate), len(self.champion))  # the scarcer arm's (the candidate's at a split < 1/2)

    def estimate(self) -> Estimate:
        """Candidate − champion mean reward, with Welch's normal 95 % interval (NaN with fewer than 2 in an arm)."""
        a, b = np.asarray(self.candidate, dtype=np.float64), np.asarray(self.champion, dtype=np.float64)
        if len(a) < 2 or len(b) < 2:
            return Estimate(math.nan, math.nan, math.nan, len(a), float(len(a)))
        value = float(a.mean() - b.mean())
        half = Z95 * math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
        return Estimate(value, value - half, value + half, len(a), float(len(a)))


Evidence = ShadowEvidence | SplitEvidence


class Gate:
    """One candidate at a time against the champion. ``cost_share`` and ``alpha`` (rl_focal's reward) make a gate
    on shadow evidence; without them the gate judges an A/B split (rlae)."""

    def __init__(self, config: GateConfig, cost_share: np.ndarray | None = None, alpha: float = 0.0):
        self.config, self.cost_share, self.alpha = config, cost_share, alpha
        self.champion: tuple[int, int] | None = None  # (epoch, version) the workers serve, when known
        self.champion_tensors: dict[str, torch.Tensor] | None = None
        self.candidate: tuple[int, int] | None = None
        self.candidate_tensors: dict[str, torch.Tensor] | None = None
        self.kind: Kind = "challenger"  # probation: the candidate is the champion the last promotion replaced
        self.previous: dict[str, torch.Tensor] | None = None  # that champion's weights, until its probation ends
        self.evidence: Evidence = self._fresh()
        self.last: Estimate | None = None  # the latest estimate of candidate − champion
        self._looked_at = 0  # evidence size at the last look
        self.line: tuple[int, int] | None = None  # the first candidate the current evidence counts
        # holdback: the learner's updates serve at once (not after a roll back, until a challenger does as well)
        self.trusted = True

    def _fresh(self) -> Evidence:
        return ShadowEvidence() if self.cost_share is not None else SplitEvidence()

    def checkpoint(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a learner's checkpoint keeps of the gate, so that a restart judges on where it stopped: the orders,
        the verdict's progress and trust as JSON; the champion's, the candidate's and the replaced champion's weights
        and the evidence as tensors."""
        state = {
            "mode": self.mode,
            "champion": self.champion,
            "candidate": self.candidate,
            "line": self.line,
            "kind": self.kind,
            "looked_at": self._looked_at,
            "last": asdict(self.last) if self.last is not None else None,
            "trusted": self.trusted,
        }
        policies = {"champion": self.champion_tensors, "candidate": self.candidate_tensors, "previous": self.previous}
        tensors = {
            f"{name}/{key}": value.detach().clone()  # cloned: a probation's candidate is the replaced champion's
            for name, weights in policies.items()
            if weights is not None
            for key, value in weights.items()
        }
        e = self.evidence
        tensors["evidence/champion"] = torch.tensor(e.champion, dtype=torch.float64)
        if isinstance(e, ShadowEvidence):
            known = [math.nan if r is None else r for r in e.candidate]
            tensors["evidence/candidate"] = torch.tensor(known, dtype=torch.float64)
            features = np.array(e.features, dtype=np.float64) if len(e) else np.zeros((0, 0))
            tensors["evidence/features"] = torch.from_numpy(features)
            tensors["evidence/probe"] = torch.tensor(e.probe, dtype=torch.bool)
            tensors["evidence/held"] = torch.tensor(e.held, dtype=torch.bool)
        else:
            tensors["evidence/candidate"] = torch.tensor(e.candidate, dtype=torch.float64)
        return state, tensors

    @property
    def mode(self) -> str:
        return "holdback" if self.config.holdback is not None else "gated"

    def restore(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        """The gate as :meth:`checkpoint` kept it; only its champion where the checkpoint's learner promoted in
        another mode (``RLENS_PROMOTION`` changed across the restart)."""

        def order(value: list | None) -> tuple[int, int] | None:
            return (int(value[0]), int(value[1])) if value is not None else None

        def weights(name: str) -> dict[str, torch.Tensor] | None:
            prefix = f"{name}/"
            found = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            return found or None

        self.champion, self.candidate, self.line = (
            order(state["champion"]),
            order(state["candidate"]),
            order(state["line"]),
        )
        self.kind, self._looked_at, self.trusted = state["kind"], state["looked_at"], state["trusted"]
        self.last = Estimate(**state["last"]) if state["last"] is not None else None
        self.champion_tensors, self.candidate_tensors = weights("champion"), weights("candidate")
        self.previous = weights("previous")
        if state["mode"] != self.mode:
            log.warning(
                "the checkpoint's gate promoted %s, this learner %s: its champion is kept, its candidate dropped",
                state["mode"],
                self.mode,
            )
            self.candidate = self.candidate_tensors = self.previous = self.line = self.last = None
            self.kind, self._looked_at, self.trusted = "challenger", 0, True
            return
        e = self.evidence = self._fresh()
        e.champion = tensors["evidence/champion"].tolist()
        if isinstance(e, ShadowEvidence):
            e.candidate = [None if math.isnan(r) else r for r in tensors["evidence/candidate"].tolist()]
            e.features = list(tensors["evidence/features"].numpy())
            e.probe = tensors["evidence/probe"].tolist()
            e.held = tensors["evidence/held"].tolist()
        else:
            e.candidate = tensors["evidence/candidate"].tolist()

    def propose(self, order: tuple[int, int], tensors: dict[str, torch.Tensor], kind: Kind = "challenger") -> None:
        self.candidate, self.candidate_tensors, self.evidence, self.last = order, tensors, self._fresh(), None
        self.kind, self._looked_at, self.line = kind, 0, order

    def advance(self, order: tuple[int, int], tensors: dict[str, torch.Tensor]) -> None:
        """Holdback: the learner's newest weights are the candidate; the line's evidence goes on (a new line after a
        verdict)."""
        if self.candidate is None or self.kind != "line" or self.line is None:
            self.propose(order, tensors, "line")
        else:
            self.candidate, self.candidate_tensors = order, tensors

    @property
    def serves_updates(self) -> bool:
        """Holdback with the learner trusted: its next update serves at once, as the newest of the line."""
        return self.config.holdback is not None and self.trusted

    def share(self) -> float | None:
        """The share of the queries the candidate serves itself (an A/B split); None for shadow evidence (rl_focal)."""
        if self.cost_share is not None:
            return None
        if self.kind == "line" and self.config.holdback is not None:
            return 1 - self.config.holdback
        return self.config.split

    def shadow_calls(self) -> float | None:
        """The share of the queries on which the workers call the models the shadow needs (rl_focal): the replaced
        champion on probation is scored exactly on those; None for another shadow (a challenger, the champion beside
        a holdback line), which reads only what the served pool and the probes called."""
        if self.cost_share is None or self.kind != "probation" or not self.config.shadow_calls:
            return None
        return self.config.shadow_calls

    def restart(self) -> None:
        """The evidence starts again (an inconclusive look); the line's next queries count from its newest candidate."""
        self.evidence, self.last, self._looked_at, self.line = self._fresh(), None, 0, self.candidate

    def observe(self, experience: Experience, label: int) -> None:
        """One labelled query the champion served, if it carries the current candidate's shadow action; under
        holdback, one the line served, with the champion's shadow action (rl_focal)."""
        shadow, behaviour, e = experience.shadow, experience.behaviour, self.evidence
        if shadow is None or behaviour is None or not self._scored(experience, shadow) or label < 0:
            return
        assert isinstance(e, ShadowEvidence) and self.cost_share is not None
        query = LoggedQuery.from_experience(experience, label)
        pool = np.asarray(shadow.pool, dtype=bool)
        e.champion.append(reward(query.pool, query.answer, label, self.cost_share, self.alpha))
        e.candidate.append(self.serving_reward(shadow, query, pool))
        e.features.append(pool_features(query, pool, self.cost_share))
        e.probe.append(behaviour.probe)
        e.held.append(not (pool & ~query.pool).any())

    def _scored(self, experience: Experience, shadow: Shadow) -> bool:
        """Whether the query's shadow action is evidence now: the candidate's, or under holdback the champion's
        beside the line (renumbered after the line started) on a query the line served."""
        order = (shadow.epoch, shadow.version)
        if self.kind == "line":
            line = self.line
            return line is not None and order > line and experience.policy_version >= line[1]
        return order == self.candidate

    def serving_reward(self, shadow: Shadow, query: LoggedQuery, pool: np.ndarray) -> float | None:
        """The candidate's expected reward here as it would serve, under the serving mixture in force
        (:func:`rlens.evaluation.logged.mixed_value`, as ``rlens ope`` judges it): its greedy answer on the greedy
        share, an answer sampled from its Fusion's own distribution on the same pool (``shadow.explored``) on the
        explored share; None where the query did not call the models its pool needs."""
        assert self.cost_share is not None
        action = Action(
            pool, shadow.answer if shadow.answer >= 0 else None, np.array(shadow.explored) if shadow.explored else None
        )
        cost_share, alpha = self.cost_share, self.alpha
        return mixed_value(
            lambda p, a, y: reward(p, a, y, cost_share, alpha), query, action, explore_share(query, action)
        )

    def observe_split(self, experience: RLAEExperience, reward: float) -> None:
        """One rewarded query of the current candidate's A/B split, served by either arm (rlae)."""
        split, e = experience.split, self.evidence
        if split is None or self.candidate is None or self.line is None or not isinstance(e, SplitEvidence):
            return
        order = (split.epoch, split.version)
        if not (order == self.candidate or (self.kind == "line" and self.line <= order <= self.candidate)):
            return
        (e.candidate if split.candidate else e.champion).append(reward)

    def estimate(self) -> Estimate:
        """Candidate − champion reward (:meth:`ShadowEvidence.estimate`, :meth:`SplitEvidence.estimate`); a line
        scored against the champion in shadow (rl_focal, holdback): the shadow's estimate turned round."""
        e = self.evidence.estimate()
        if self.kind == "line" and isinstance(self.evidence, ShadowEvidence):
            return Estimate(-e.value, -e.high, -e.low, e.n, e.ess)
        return e

    def sequential(self) -> bool:
        """Whether the evidence is looked at more than once (every ``every`` queries from ``min_events`` to
        ``max_events``): then its bounds are anytime-valid (:func:`anytime_bounds`). An rlae challenger or probation
        on an A/B split is judged at one look, with the normal interval."""
        one_look = isinstance(self.evidence, SplitEvidence) and self.kind != "line"
        return not one_look and self.config.max_events > self.config.min_events

    def verdict(self) -> Verdict | None:
        """A challenger: promote, drop, or None (keep collecting); on probation: roll back, passed, or None (keep
        looking); a line: roll back, promote (verified), inconclusive or None. None before ``min_events``."""
        n = len(self.evidence)
        if self.candidate is None or n < self.config.min_events or n - self._looked_at < self.config.every:
            return None
        self._looked_at = n
        sequential = self.sequential()
        self.last = anytime_bounds(self.estimate(), self.config.min_events) if sequential else self.estimate()
        done = n >= self.config.max_events or not sequential
        low, high, delta = self.last.low, self.last.high, self.config.delta
        if self.kind == "probation":  # the replaced champion − the promoted one: rolled back to as soon as clear
            if low > delta:
                return "roll back"
            if high < delta or not sequential or n >= WATCH * self.config.max_events:
                return "passed"
            return "passed" if done and self.last.value <= delta else None  # else watched on
        if self.kind == "line":  # looked at every `every` queries up to max_events, then the evidence starts again
            if high < -delta:
                return "roll back"
            if low >= -delta:
                return "promote"
            return "inconclusive" if n >= self.config.max_events else None
        if low >= -delta:
            return "promote"
        if self.config.holdback is not None and self.last.value >= -delta:
            return "resume"  # an untrusted learner's challenger did as well on its share: its next update is a line
        return "drop" if done or high < -delta else None

    def drifted(self) -> bool:
        """A drift was detected: with ``drift_reset``, the candidate's evidence starts again. Whether it did."""
        if not self.config.drift_reset or self.candidate is None or not len(self.evidence):
            return False
        self.evidence, self.last, self._looked_at = self._fresh(), None, 0
        return True

    def promoted(self) -> None:
        """The candidate is the champion now; a challenger's predecessor is kept for its probation (not under
        holdback: the lines that follow are judged against the new champion)."""
        holdback = self.config.holdback is not None
        self.previous = self.champion_tensors if self.kind == "challenger" and not holdback else None
        self.champion, self.champion_tensors = self.candidate, self.candidate_tensors
        self.candidate, self.candidate_tensors = None, None

    def dropped(self) -> None:
        self.candidate, self.candidate_tensors = None, None
        if self.kind == "probation":
            self.previous = None
