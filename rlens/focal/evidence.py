"""What off-policy evaluation needs of a batch's served answers, from the engine that served them: each answer's
:class:`Behaviour` (its propensity, the greedy pool and answer, the models' distributions and calibrations as
logged: :mod:`rlens.focal.propensity`) and a candidate policy's greedy action on the same query, in shadow
(:class:`Shadow`). One forward per agent for the batch; the worker turns what it gives into messages."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from rlens.focal.calibration import significant
from rlens.focal.engine import Answer, Decision, FocalEngine
from rlens.messages import Behaviour, JointVote, Shadow


@dataclass
class Candidate:
    """A policy scored in shadow beside the one served: its agents (greedy only; they read the served engine's
    windows and calibrations), its (epoch, version), and the share of queries that also call the models its pool
    needs (``calls``, its policy's ``shadow_calls``; None: none)."""

    engine: FocalEngine
    epoch: int
    version: int
    calls: float | None = None


def shadow_pools(engine: FocalEngine, candidate: Candidate, decisions: list[Decision]) -> tuple[list[np.ndarray], int]:
    """The candidate's greedy pool on each query, from the same state and windows (one Decider forward for the
    batch), and the model calls added for it: on a share ``candidate.calls`` of the queries (those without a budget
    of their own, which caps what they call) each decision's ``called`` grows, in the list, by the models its pool
    needs and the served pool lacks, so that its answer there is exact."""
    candidate.engine.follow(engine)
    pools = candidate.engine.greedy_pools(decisions, every=True)
    share, added_calls = candidate.calls, 0
    if share:
        for i, (d, pool) in enumerate(zip(decisions, pools)):
            added = int((pool & ~d.called).sum())
            if d.cap is None and added and (share >= 1 or engine.rng.random() < share):
                decisions[i] = replace(d, called=d.called | pool)
                added_calls += added
    return pools, added_calls


def evidence(
    engine: FocalEngine,
    decisions: list[Decision],
    probs: list[np.ndarray],
    answered: list[np.ndarray],
    fused: list[Answer],
    fused_pools: list[np.ndarray],
    probes: list[bool],
    calibrated: list[np.ndarray | None],
    candidate: Candidate | None = None,
    candidate_pools: list[np.ndarray] | None = None,
) -> list[tuple[Behaviour, Shadow | None]]:
    """Per answered query: what off-policy evaluation needs of it, and the candidate's greedy action in shadow
    (None without a candidate). Every list holds the answered queries in one order: their decisions, models'
    distributions [M, C], the models that answered, the served answers, the pools fused, whether each was a probe,
    and the answers' ``calibrated`` rows (:meth:`FocalEngine.calibrated_rows`); ``candidate_pools``:
    :func:`shadow_pools` of them. The Fusion observations of the served answers are reused where a greedy answer
    fuses the same models."""
    if not decisions:
        return []
    served = [(pool, answer.features) for pool, answer in zip(fused_pools, fused)]
    greedy_pools = engine.greedy_pools(decisions)
    greedy_answers = [answer.answer for answer in fused]  # a greedy query's answer is the greedy one
    explored = [j for j, d in enumerate(decisions) if d.explored]
    if explored:
        found = engine.greedy_actions(
            [decisions[j] for j in explored],
            [probs[j] for j in explored],
            [decisions[j].called for j in explored],
            [answered[j] for j in explored],
            [greedy_pools[j] for j in explored],
            [served[j] for j in explored],
            [calibrated[j] for j in explored],
        )
        for j, (answer, _) in zip(explored, found):
            greedy_answers[j] = answer
    shadows = (
        _shadows(candidate, decisions, candidate_pools, probs, answered, served, calibrated)
        if candidate is not None and candidate_pools is not None
        else [None] * len(decisions)
    )
    windows: dict = {}  # each stream's window statistics, once per batch
    logged = logged_distributions(probs)
    calibration_logs = _calibration_logs(engine, decisions, calibrated)
    return [
        (
            _behaviour(
                engine,
                decisions[j],
                answered[j],
                probs[j],
                logged[j],
                fused[j],
                probes[j],
                greedy_pools[j],
                greedy_answers[j],
                windows,
                calibration_logs[j],
            ),
            shadows[j],
        )
        for j in range(len(decisions))
    ]


def _shadows(
    candidate: Candidate,
    decisions: list[Decision],
    pools: list[np.ndarray],
    probs: list[np.ndarray],
    answered: list[np.ndarray],
    served: list[tuple[np.ndarray, np.ndarray]],
    calibrated: list[np.ndarray | None],
) -> list[Shadow | None]:
    """The candidate's greedy action on each query, on its ``pools``, from the answers the query's calls got (one
    Fusion forward for the batch); ``served``: each query's fused pool and its Fusion observation, reused where the
    candidate fuses the same models; ``calibrated``: the answers' calibrated rows (the same calibrations)."""
    actions = candidate.engine.greedy_actions(
        decisions, probs, [d.called for d in decisions], answered, pools, served, calibrated
    )
    owns = [own for _, own in actions if own is not None]
    flat = significant(np.concatenate(owns), 4) if owns else np.empty(0)  # rounded in one pass for the batch
    shadows: list[Shadow | None] = []
    at = 0
    for p, (a, own) in zip(pools, actions):
        explored = [] if own is None else flat[at : at + len(own)].tolist()
        at += 0 if own is None else len(own)
        shadows.append(
            Shadow(epoch=candidate.epoch, version=candidate.version, pool=p.tolist(), answer=a, explored=explored)
        )
    return shadows


def _behaviour(
    engine: FocalEngine,
    decision: Decision,
    answered: np.ndarray,
    probs: np.ndarray,
    logged: list,
    answer: Answer,
    probe: bool,
    greedy_pool: np.ndarray,
    greedy: int,
    windows: dict,
    calibration_log: dict,
) -> Behaviour:
    """What off-policy evaluation needs of this query, given its models' distributions (``probs``, and ``logged``
    as the log keeps them), its greedy pool and answer, and its calibrations as logged (:func:`_calibration_logs`);
    ``windows`` caches each stream's window statistics for the batch."""
    n_choices = probs.shape[1]
    propensity = engine.propensity(decision, answer, greedy_pool)
    if (decision.key, n_choices) not in windows:
        window = engine.window(decision.key)
        windows[decision.key, n_choices] = (
            np.round(window.reliability(), 6).tolist(),
            np.round(window.label_prior(n_choices), 6).tolist(),
        )
    reliability, label_prior = windows[decision.key, n_choices]
    return Behaviour(
        explore_rate=engine.cfg.explore_rate if decision.cap is None else 0.0,
        probe=probe,
        greedy_pool=greedy_pool.tolist(),
        greedy_answer=greedy,
        propensity=min(propensity, 1.0),
        offset=decision.offset,
        budget=decision.cap,
        model_probs=[row if ok else [] for row, ok in zip(logged, answered.tolist())],
        reliability=reliability,
        label_prior=label_prior,
        joint=_joint_votes(engine, decision, probs, answered, greedy_pool) if calibration_log else [],
        **calibration_log,
    )


def _joint_votes(
    engine: FocalEngine, decision: Decision, probs: np.ndarray, answered: np.ndarray, greedy_pool: np.ndarray
) -> list[JointVote]:
    """The served and the greedy pool's joint log-probabilities where the stream has a joint fit for them and
    every member answered (what replaced their votes: off-policy evaluation gives such a pool the same)."""
    calibrations, found = engine.calibrations, list[JointVote]()
    if calibrations is None:
        return found
    calibration = calibrations(decision.key)
    for pool in (decision.pool, greedy_pool):
        if any(np.array_equal(pool, j.pool) for j in found) or not answered[pool].all():
            continue
        joint = calibration.joint(probs, pool)
        if joint is not None:
            found.append(JointVote(pool=pool.tolist(), log_probs=np.minimum(significant(joint), 0.0).tolist()))
    return found


def _calibration_logs(
    engine: FocalEngine, decisions: list[Decision], calibrated: list[np.ndarray | None]
) -> list[dict]:
    """With calibrations, per query: each answering model's calibrated log-probabilities (its ``calibrated``
    rows) and the stream's label prior, what off-policy evaluation needs to give a candidate pool its calibrated
    vote (nothing without calibrations, or for an open-ended query); rounded in one pass for the batch."""
    calibrations = engine.calibrations
    if calibrations is None:
        return [{} for _ in decisions]
    priors = [
        None if found is None else calibrations(d.key).prior(found.shape[1]) for d, found in zip(decisions, calibrated)
    ]
    blocks = [found.ravel() for found in calibrated if found is not None]  # NaN rows: no answer
    parts = [np.minimum(np.concatenate(blocks), 0.0)] if blocks else []  # log-probabilities at most 0
    parts += [p for p in priors if p is not None]  # then the priors, above 0
    flat = significant(np.concatenate(parts)).tolist() if parts else []
    at, logs = 0, list[dict]()
    for found in calibrated:
        if found is None:  # open-ended
            logs.append({})
            continue
        models, width = found.shape
        rows = [flat[at + m * width : at + (m + 1) * width] for m in range(models)]
        at += found.size
        logs.append({"calibrated": [[] if row[0] != row[0] else row for row in rows]})  # NaN: []
    for log_, prior in zip(logs, priors):
        if prior is not None:
            log_["calibration_prior"] = flat[at : at + len(prior)]
            at += len(prior)
    return logs


def logged_distributions(probs: list[np.ndarray]) -> list:
    """Each query's model distributions [M, C] as the log keeps them (:func:`significant`), rounded in one pass for
    the batch."""
    flat = significant(np.concatenate([p.ravel() for p in probs])) if probs else np.empty(0)
    ends = np.cumsum([p.size for p in probs])
    return [flat[end - p.size : end].reshape(p.shape).tolist() for p, end in zip(probs, ends)]
