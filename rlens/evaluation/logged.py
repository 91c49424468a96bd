"""Logged rl_focal traffic and candidate policies acting on it: what :mod:`rlens.evaluation.ope` estimates from.

A :class:`LoggedQuery` is one served query as the worker logged it (its :class:`rlens.messages.Behaviour`) with its
label from the feedback: the Decider's observation, every called model's distribution, the window statistics the
Fusion agent read, the served pool and answer and their propensity. A candidate policy (:class:`FocalPolicy`: the
greedy actions of an RL-Focal engine; :class:`FixedPool`: a fixed set of models fused by their summed distributions)
acts on the same context (an :class:`Action`): its pool from the logged observation, its answer from the pool's
logged answers, or None where it needs a model the query did not call, and the distribution an explored answer on
that pool is drawn from. :func:`evaluate` gives every estimator's value of a candidate's reward and accuracy, by
default under the serving mixture the log records (its greedy action on the greedy share, a sample of its Fusion on
the explored share), as the gate judges it (:meth:`rlens.service.learner.gate.Gate.serving_reward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Protocol

import numpy as np

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlens.evaluation.ope import Estimate, corrected_replay, direct, doubly_robust, ips, snips
from rlens.focal.budget import fit_pool, logit_shift
from rlens.focal.calibration import naive_bayes_vote
from rlens.focal.engine import FocalEngine
from rlens.focal.features import fusion_observation
from rlens.focal.greedy import voted_answers
from rlens.messages import MAX_CHOICES, Behaviour, Experience

RIDGE = 1.0  # the reward model's L2 penalty
MIN_RESIDUALS = 5  # probe rows that measure the reward model's error where it stands in


@dataclass
class LoggedQuery:
    state: np.ndarray  # the Decider's observation
    probs: np.ndarray  # [M, C]: each model's distribution; rows of models not called are 0
    known: np.ndarray  # bool [M]: models whose answer the log holds
    reliability: np.ndarray  # [M]: the window's per-model reliability
    label_prior: np.ndarray  # [C]
    pool: np.ndarray  # bool [M]: the pool served
    answer: int  # the answer served
    propensity: float  # the logging mixture's probability of (pool, answer)
    label: int  # the correct choice (-1: unknown)
    probe: bool  # every model was called
    query_id: str = ""
    budget: float | None = None  # the query's own budget (a cap on its pool's cost share), if it had one
    offset: float = 0.0  # the budget's offset on the greedy Decider's logits when it was served (0: no budget)
    calibrated: np.ndarray | None = None  # [M, C]: each model's calibrated log-probabilities (NaN where none)
    calibration_prior: np.ndarray | None = None  # [C]: the label prior the calibrated vote divides by
    joint: tuple[tuple[np.ndarray, np.ndarray], ...] = ()  # (pool bool [M], log-probabilities [C]): joint fits used
    explore_rate: float = 0.0  # the share of queries explored when this one was served

    @classmethod
    def from_experience(cls, experience: Experience, label: int) -> "LoggedQuery":
        """A joined experience (with its ``behaviour``) and its feedback's label."""
        if experience.behaviour is None:
            raise ValueError(f"experience {experience.query_id} has no behaviour (a worker before off-policy logging)")
        return cls.from_parts(
            experience.behaviour,
            experience.decider_state,
            experience.n_choices,
            experience.pool,
            experience.answer_index,
            label,
        )

    @classmethod
    def from_parts(
        cls,
        b: Behaviour,
        decider_state: list[float],
        n_choices: int,
        pool: list[bool],
        answer: int,
        label: int,
        query_id: str = "",
    ) -> "LoggedQuery":
        known = np.array([len(row) > 0 for row in b.model_probs])
        probs = np.array([row if row else [0.0] * n_choices for row in b.model_probs], dtype=np.float64)
        calibrated = (
            np.array([row if row else [np.nan] * n_choices for row in b.calibrated], dtype=np.float64)
            if b.calibrated and b.calibration_prior
            else None
        )
        return cls(
            state=np.asarray(decider_state, dtype=np.float32),
            probs=probs,
            known=known,
            reliability=np.asarray(b.reliability, dtype=np.float32),
            label_prior=np.asarray(b.label_prior, dtype=np.float32),
            pool=np.asarray(pool, dtype=bool),
            answer=answer,
            propensity=b.propensity,
            label=label,
            probe=b.probe,
            query_id=query_id,
            budget=b.budget,
            offset=b.offset,
            calibrated=calibrated,
            calibration_prior=np.asarray(b.calibration_prior, dtype=np.float64) if calibrated is not None else None,
            joint=tuple((np.asarray(j.pool, dtype=bool), np.asarray(j.log_probs, dtype=np.float64)) for j in b.joint),
            explore_rate=b.explore_rate,
        )


class LogLine(BaseModel):
    """One line of the learner's off-policy log (:mod:`rlens.service.learner.ope_log`)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    query_id: str
    stream: str
    policy_version: int
    n_choices: int = Field(ge=1, le=MAX_CHOICES)
    decider_state: list[float]
    pool: list[bool]
    answer_index: int
    behaviour: Behaviour
    label: int = Field(ge=0)


def read_log(paths: list[Path]) -> list[LoggedQuery]:
    """The learner's off-policy log (oldest file first), each query once (its last line); ValueError naming the file
    and line of a line that does not parse. A last line without its newline is being written: left for later."""
    lines: dict[str, LoggedQuery] = {}
    for path in paths:
        with Path(path).open() as f:
            for number, text in enumerate(f, 1):
                if not text.strip() or not text.endswith("\n"):  # the last line, while the learner writes it
                    continue
                try:
                    line = LogLine.model_validate_json(text)
                except ValidationError as exc:
                    raise ValueError(
                        f"{path}:{number}: not an off-policy log line ({exc.errors()[0]['msg']})"
                    ) from None
                lines.pop(line.query_id, None)
                lines[line.query_id] = LoggedQuery.from_parts(
                    line.behaviour,
                    line.decider_state,
                    line.n_choices,
                    line.pool,
                    line.answer_index,
                    line.label,
                    line.query_id,
                )
    return list(lines.values())


class Action(NamedTuple):
    """A policy's action on a logged context."""

    pool: np.ndarray  # bool [M]
    answer: int | None  # its greedy answer; None where the pool holds a model the log has no answer of
    explored: np.ndarray | None = None  # [C]: what an explored answer on the pool is drawn from (None: never explores)


class Policy(Protocol):
    name: str

    def act(self, query: LoggedQuery) -> Action:
        """Its action on this context."""


def fuse_greedy(engine: FocalEngine, query: LoggedQuery, pool: np.ndarray) -> tuple[int, np.ndarray]:
    """The engine's greedy Fusion answer on the pool's logged answers and the logged window statistics, times the
    pool's calibrated vote where the log has every member's calibration (the deployment voted: a candidate is judged
    as it would serve there), or its joint fit where the log has the one the deployment used for this pool; and the
    Fusion's own distribution there (an explored answer's, no vote)."""
    features = fusion_observation(query.probs * pool[:, None], pool, query.reliability, query.label_prior)
    votes = None
    joint = [log_probs for members, log_probs in query.joint if np.array_equal(members, pool)]
    if joint:
        votes = joint[0][None]
    elif query.calibrated is not None and query.calibration_prior is not None:
        members = query.calibrated[pool]
        if len(members) and not np.isnan(members).any():
            votes = naive_bayes_vote(members, query.calibration_prior)[None]
    own = engine.greedy.fusion_log_probs(features[None], np.ones((1, len(features)), dtype=bool))
    answers, _, _ = voted_answers(own, votes)
    return int(answers[0]), np.exp(own[0])


@dataclass
class FocalPolicy:
    """The greedy actions of an RL-Focal engine (its Decider and Fusion agent)."""

    name: str
    engine: FocalEngine

    def act(self, query: LoggedQuery) -> Action:
        """Its greedy pool and answer, under the budget's shift the query was served under (as the worker's greedy
        Decider was), cut to the query's own budget if it had one."""
        engine = self.engine
        shift = logit_shift(query.offset, engine.prices) if query.offset else 0.0
        if engine.cfg.use_decider:
            pool = engine.greedy.pools(query.state[None], shift)[0][0]
        else:
            pool = np.ones(len(query.known), dtype=bool)
        if query.budget is not None:  # cut to the query's own budget, as the worker does
            logits = (
                engine.greedy.decider_logits(query.state[None])[0] + shift
                if engine.cfg.use_decider
                else engine.no_logits
            )
            pool = fit_pool(pool, logits, engine.cost_share, query.budget)
        if (pool & ~query.known).any():
            return Action(pool, None)
        return Action(pool, *fuse_greedy(self.engine, query, pool))


@dataclass
class FixedPool:
    """Always the same models, answering the choice with the largest summed probability (one model: its answer); a
    reference for the benchmarks, which ignores a query's own budget and never explores."""

    name: str
    pool: np.ndarray

    def act(self, query: LoggedQuery) -> Action:
        if (self.pool & ~query.known).any():
            return Action(self.pool, None)
        return Action(self.pool, int(query.probs[self.pool].sum(0).argmax()))


def reward(pool: np.ndarray, answer: int, label: int, cost_share: np.ndarray, alpha: float) -> float:
    """The Decider's reward: +1 / -1 for the answer, minus alpha times the pool's share of the pool's cost."""
    return (1.0 if answer == label else -1.0) - alpha * float(cost_share[pool].sum())


def pool_features(query: LoggedQuery, pool: np.ndarray, cost_share: np.ndarray) -> np.ndarray:
    """The reward model's view of a pool in a context: which models, how reliable, how costly."""
    rel = query.reliability.astype(np.float64)
    chosen = pool.astype(np.float64)
    best = float(rel[pool].max()) if pool.any() else 0.0
    return np.concatenate([[1.0, best, float(cost_share[pool].sum())], chosen, chosen * rel])


def fit_ridge(x: np.ndarray, y: np.ndarray, penalty: float = RIDGE) -> np.ndarray:
    eye = np.eye(x.shape[1])
    eye[0, 0] = 0.0  # no penalty on the intercept
    return np.linalg.solve(x.T @ x + penalty * eye, x.T @ y)


def loo_residuals(x: np.ndarray, y: np.ndarray, penalty: float = RIDGE) -> np.ndarray:
    """Each row's error under the ridge model fitted without it: (y − ŷ) / (1 − h), h the hat matrix's diagonal
    (exact for ridge at a fixed penalty). In-sample errors would understate the model's error where it stands in."""
    eye = np.eye(x.shape[1])
    eye[0, 0] = 0.0
    inverse = np.linalg.inv(x.T @ x + penalty * eye)
    hat = np.einsum("ij,jk,ik->i", x, inverse, x)
    return (y - x @ (inverse @ (x.T @ y))) / np.maximum(1.0 - hat, 1e-9)


def replay_estimate(
    known: list[float | None],
    features: np.ndarray,
    probe: np.ndarray,
    held: np.ndarray,
    offset: np.ndarray | None = None,
) -> tuple[Estimate, np.ndarray]:
    """The replay estimator (:func:`rlens.evaluation.ope.corrected_replay`) of a policy's per-query values: ``known``
    where the log holds what the policy needs (None elsewhere), a ridge reward model of ``features`` fitted on the
    ``probe`` rows where it is known elsewhere, and the model's mean error corrected on the probe rows whose values
    the logged pool did not ``held`` (all probe rows when fewer than MIN_RESIDUALS are), each row's error that of the
    model fitted without it (:func:`loo_residuals`). ``offset`` is subtracted per query (another policy's known
    values: an estimate of the difference), and is one more feature of the reward model (a control variate: two
    policies' rewards on one query go together, and the difference's modelled rows vary less for it). The estimate
    and the model's weights."""
    if offset is not None and len(features):
        features = np.column_stack([features, offset])
    known_mask = np.array([v is not None for v in known], dtype=bool)
    exact = np.array([0.0 if v is None else v for v in known])
    complete = np.flatnonzero(probe & known_mask)
    model = fit_ridge(features[complete], exact[complete]) if len(complete) >= 2 else np.zeros(features.shape[1])
    predicted = features @ model
    errors = (
        loo_residuals(features[complete], exact[complete])
        if len(complete) >= 2
        else exact[complete] - predicted[complete]
    )
    stand_in = ~held[complete]
    if stand_in.sum() < MIN_RESIDUALS:
        stand_in[:] = True
    values = np.where(known_mask, exact, predicted) - (0.0 if offset is None else offset)
    return corrected_replay(values, ~known_mask, errors[stand_in]), model


def explore_share(query: LoggedQuery, action: Action, serving: bool = True) -> float:
    """The share of this query an action's explored answer serves: the logged explore rate under the serving mixture;
    0 for greedy actions alone, a query with its own budget (never explored) or a policy that never explores."""
    if not serving or query.budget is not None or action.explored is None:
        return 0.0
    return query.explore_rate


def mixed_value(
    value: Callable[[np.ndarray, int, int], float], query: LoggedQuery, action: Action, rate: float
) -> float | None:
    """The action's expected ``value`` here: its greedy answer's on the (1 - rate) greedy share, a sample of its
    explored distribution's on the rest (the Decider's explored pools are not modelled); None without an answer."""
    if action.answer is None:
        return None
    greedy = value(action.pool, action.answer, query.label)
    if not rate or action.explored is None:
        return greedy
    hit = float(action.explored[query.label]) if query.label < len(action.explored) else 0.0
    right, wrong = value(action.pool, query.label, query.label), value(action.pool, -1, query.label)
    return (1 - rate) * greedy + rate * (hit * right + (1 - hit) * wrong)


def action_probability(query: LoggedQuery, action: Action, rate: float) -> float:
    """The probability that the action, under the mixture, takes the logged (pool, answer) (the IPS numerator)."""
    if action.answer is None or not (action.pool == query.pool).all():
        return 0.0
    p = (1 - rate) * float(action.answer == query.answer)
    if rate and action.explored is not None and 0 <= query.answer < len(action.explored):
        p += rate * float(action.explored[query.answer])
    return p


def evaluate(
    queries: list[LoggedQuery], policy: Policy, cost_share: np.ndarray, alpha: float, serving: bool = True
) -> dict[str, dict[str, Estimate]]:
    """Every estimator's value of ``policy``'s reward and accuracy on the labelled logged queries, under the serving
    mixture each query logged (``serving``; greedy actions alone otherwise): ``exact`` (the probe rows, where the log
    holds every model's answer: a random sample), ``replay`` (every query whose log holds the answers the policy
    needs, exactly; the reward model elsewhere, its mean error there corrected on the probe rows), ``ips``, ``snips``
    and ``dr`` (the reward model, a ridge regression of the policy's value on the probe rows, corrected by IPS)."""
    labelled = [q for q in queries if q.label >= 0]
    actions = [policy.act(q) for q in labelled]
    rates = [explore_share(q, a, serving) for q, a in zip(labelled, actions)]
    taken = np.array([action_probability(q, a, r) for q, a, r in zip(labelled, actions, rates)])
    logging = np.array([q.propensity for q in labelled])
    # probe rows: a random sample of the queries on which every model was called (a failed model aside)
    complete = [i for i, q in enumerate(labelled) if q.probe and actions[i].answer is not None]
    out: dict[str, dict[str, Estimate]] = {}
    for metric in ("reward", "accuracy"):

        def value(pool, answer, label):
            return reward(pool, answer, label, cost_share, alpha) if metric == "reward" else float(answer == label)

        logged = np.array([value(q.pool, q.answer, q.label) for q in labelled])
        known = [mixed_value(value, q, a, r) for q, a, r in zip(labelled, actions, rates)]
        exact = np.array([known[i] for i in complete])
        x_target = np.array([pool_features(q, a.pool, cost_share) for q, a in zip(labelled, actions)])
        x_logged = np.array([pool_features(q, q.pool, cost_share) for q in labelled])
        probe = np.array([q.probe for q in labelled], dtype=bool)
        held = np.array([not (a.pool & ~q.pool).any() for q, a in zip(labelled, actions)])
        replayed, model = replay_estimate(known, x_target, probe, held)
        out[metric] = {
            "exact": direct(exact),
            "replay": replayed,
            "ips": ips(logged, taken, logging),
            "snips": snips(logged, taken, logging),
            "dr": doubly_robust(logged, taken, logging, x_logged @ model, x_target @ model),
        }
    return out


def true_value(
    queries: list[LoggedQuery], policy: Policy, cost_share: np.ndarray, alpha: float, serving: bool = True
) -> dict[str, float]:
    """The policy's mean reward and accuracy (under the serving mixture, as :func:`evaluate`) on queries whose every
    model's answer is known (a replay's truth)."""
    rewards: list[float | None] = []
    correct: list[float | None] = []
    for q in queries:
        action = policy.act(q)
        if action.answer is None:
            raise ValueError("true_value needs complete queries (every model's answer)")
        rate = explore_share(q, action, serving)
        rewards.append(mixed_value(lambda p, a, y: reward(p, a, y, cost_share, alpha), q, action, rate))
        correct.append(mixed_value(lambda p, a, y: float(a == y), q, action, rate))
    return {
        "reward": float(np.mean(np.array(rewards, dtype=float))),
        "accuracy": float(np.mean(np.array(correct, dtype=float))),
    }
