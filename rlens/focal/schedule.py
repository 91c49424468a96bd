"""The RL-Focal training schedule over recorded outputs (the paper's Algorithms 1 and 2).

* :func:`warm_start` (Algorithm 1): the Decider first, rewarded by the interim plurality vote of the pool it picks;
  then the Fusion agent on the pools of the warm Decider (which is not updated meanwhile), first supervised by the
  labels (cross-entropy, :mod:`rlens.focal.supervised`), then by MAPPO; then a few joint MAPPO passes in which both
  agents learn from the Fusion agent's final answers.
* :func:`run_online` (Algorithm 2): each query is answered before its label is seen, greedily or, on a share
  ``explore_rate`` of them, with both agents sampling; its feedback arrives ``feedback_delay`` queries later; both
  agents are updated once ``update_period`` explored queries have their feedback. Each query is served by
  :mod:`rlens.focal.serving`, the worker's own code (a batch of one).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Literal

import numpy as np

from rlens.records.recorded import RecordedDataset
from rlens.drift import DriftMonitor, signals_of_outcome
from rlens.focal.config import FocalConfig
from rlens.focal.engine import Answer, Decision, FocalEngine
from rlens.focal.features import critic_states
from rlens.focal.serving import answer_batch, decide_batch
from rlens.focal.voting import plurality_vote

Progress = Callable[[int], None]
Reaction = Literal["none", "trim", "reset"]  # what run_online does to a stream's window on a drift detection


@dataclass(frozen=True)
class Question:
    """One question restricted to its valid choices (indices below are positions among them)."""

    key: int
    probs: np.ndarray  # [M, C_valid]
    predictions: np.ndarray  # [M] each model's argmax; -1 for a model that gave no answer (a zero row: open-ended)
    label: int  # C_valid when the right answer is none of the choices (open-ended: no model gave it)
    decider_choices: int  # what the Decider is told of the choice count: C_valid, or 0 for an open-ended question


def questions(data: RecordedDataset) -> list[Question]:
    out = []
    for i in range(data.n_questions):
        valid = np.flatnonzero(data.choice_mask[i])
        probs = data.probs[i][:, valid]
        predictions = np.where(probs.max(1) > 0, probs.argmax(1), -1)
        out.append(
            Question(
                int(data.task[i]),
                probs,
                predictions,
                int(np.searchsorted(valid, data.labels[i])),
                0 if data.open_ended else len(valid),
            )
        )
    return out


@dataclass
class OnlineTrace:
    """Per test question: the answer (position among valid choices), correctness and calls."""

    answers: np.ndarray
    correct: np.ndarray
    pool_size: np.ndarray  # models whose answers were fused
    models_called: np.ndarray  # models actually called (pool plus window-refresh probes)
    explored: np.ndarray  # both agents sampled (the others are greedy)
    greedy_correct: np.ndarray  # whether the greedy policy's answer from the same state would have been right
    cost_share: np.ndarray  # the called models' share of the whole pool's cost
    # (question, the signals whose drift its outcome completed)
    detections: list[tuple[int, list[str]]] = field(default_factory=list)
    # questions whose answer's confidence completed a drift detection (no reaction)
    label_free: list[int] = field(default_factory=list)


def _pool_vote(q: Question, pool: np.ndarray) -> int:
    """The interim answer of a pool without the Fusion agent: its plurality vote (ties to the larger summed
    probability) over the models that answered; -1 (wrong) when none did."""
    answered = pool & (q.predictions >= 0)
    if not answered.any():
        return -1
    return int(plurality_vote(q.predictions[answered][None, :], q.probs.shape[1], q.probs[answered].sum(0)[None, :])[0])


def _calibrating(q: Question) -> np.ndarray | None:
    """What a question gives the stream's calibrations: its models' distributions, none for an open-ended one."""
    return q.probs if q.decider_choices else None


def _warm_pass(
    engine: FocalEngine, qs: list[Question], train_decider: bool, train_fusion: bool, progress: Progress | None
) -> None:
    """One pass over the warm-start split from empty windows, updating the selected agents every ``warm_batch``.

    Each question is played ``warm_rollouts`` times from the same state (parallel environments over recorded
    data). Recorded data observes every model, so the window gets every model's outcome. Without the Fusion
    agent the answer is the interim plurality vote of the pool (ties to the larger summed probability).
    """
    rollouts = engine.cfg.warm_rollouts
    engine.reset_windows()
    for q in qs:
        rewards = []
        decisions = engine.decide(q.key, q.decider_choices, greedy=False, rollouts=rollouts)
        answers: list[Answer | None] = [None] * rollouts
        critic_inputs: list[np.ndarray | None] = [None] * rollouts  # an answer carries its own
        if train_fusion:  # one Fusion forward for the rollouts
            answers = list(engine.fuse_batch(decisions, [q.probs] * rollouts))
        else:
            critic_inputs = list(
                critic_states(
                    np.stack([d.state for d in decisions]),
                    np.stack([q.probs] * rollouts),
                    np.stack([d.pool for d in decisions]),
                )
            )
        for decision, answer, critic_input in zip(decisions, answers, critic_inputs):
            chosen = answer.answer if answer is not None else _pool_vote(q, decision.pool)
            rewards.append(engine.reward(decision.pool, chosen == q.label))
            engine.remember(
                decision, answer, rewards[-1], engine.fusion_reward(chosen == q.label), critic_input, q.label
            )
        # the window keeps the first rollout's reward
        engine.observe(q.key, q.predictions, q.label, rewards[0], _calibrating(q), decisions[0].pool)
        if len(engine.buffer) >= engine.cfg.warm_batch * rollouts:
            engine.update(train_decider, train_fusion, envs=rollouts)
        if progress:
            progress(1)
    engine.update(train_decider, train_fusion, envs=rollouts)


def _supervised_fusion_pass(engine: FocalEngine, qs: list[Question], progress: Progress | None) -> dict[str, float]:
    """One pass over the warm-start split that collects the Fusion's features for the warm Decider's pools
    (``warm_rollouts`` sampled pools per question, windows filled as in :func:`_warm_pass`), then
    ``fusion_supervised_epochs`` of cross-entropy against the labels (of the questions whose right answer is one
    of the choices)."""
    rollouts = engine.cfg.warm_rollouts
    engine.reset_windows()
    features, labels = [], []
    for q in qs:
        decisions = engine.decide(q.key, q.decider_choices, greedy=False, rollouts=rollouts)
        if q.label < q.probs.shape[1]:
            features += [engine.fusion_features(d, q.probs) for d in decisions]
            labels += [q.label] * rollouts
        members = decisions[0].pool
        engine.observe(
            q.key,
            q.predictions,
            q.label,
            engine.reward(members, _pool_vote(q, members) == q.label),
            _calibrating(q),
            members,
        )
        if progress:
            progress(1)
    return engine.fit_fusion(features, labels) if features else {}  # no question with a right choice: nothing to fit


def warm_start(engine: FocalEngine, data: RecordedDataset, progress: Progress | None = None) -> None:
    """Algorithm 1 (with the Fusion's supervised start), then joint MAPPO passes in which the Decider is judged by
    the Fusion agent's answers."""
    qs = questions(data)
    decider_passes, fusion_passes, joint_passes = _warm_passes(engine.cfg)
    for _ in range(decider_passes):
        _warm_pass(engine, qs, train_decider=True, train_fusion=False, progress=progress)
    if engine.cfg.fusion_supervised_epochs:
        _supervised_fusion_pass(engine, qs, progress)
    for _ in range(fusion_passes):
        _warm_pass(engine, qs, train_decider=False, train_fusion=True, progress=progress)
    for _ in range(joint_passes):
        _warm_pass(engine, qs, train_decider=True, train_fusion=True, progress=progress)


def _warm_passes(cfg: FocalConfig) -> tuple[int, int, int]:
    if not cfg.use_decider:
        return 0, cfg.fusion_warm_passes + cfg.joint_warm_passes, 0
    return cfg.decider_warm_passes, cfg.fusion_warm_passes, cfg.joint_warm_passes


def warm_start_steps(cfg: FocalConfig, n_questions: int) -> int:
    """Questions the warm start goes through (for progress bars)."""
    return n_questions * (sum(_warm_passes(cfg)) + (cfg.fusion_supervised_epochs > 0))


def run_online(
    engine: FocalEngine,
    data: RecordedDataset,
    progress: Progress | None = None,
    stream: Hashable | None = None,
    drift: DriftMonitor | None = None,
    reaction: Reaction = "none",
    keep: int = 10,
    served: Callable[[int, Decision, Answer], None] | None = None,
    cap: float | None = None,
) -> OnlineTrace:
    """Algorithm 2 over ``data``. The window key is each question's task, or ``stream`` for all of them (the task
    unknown, as in the service). ``drift`` is fed each outcome when its feedback arrives (the learner's signals:
    ``outcome`` and each called model's ``model:<index>``) and each answer's confidence as it is given (label-free);
    its detections are in the trace, and ``reaction`` applies on each question whose outcome completed one: ``trim`` the stream's window to its last ``keep``
    outcomes, ``reset`` it, or ``none``. ``served(i, decision, answer)`` sees each answer as it is given, before its
    feedback (what a worker would log). ``cap``: every query's own budget (greedy, no probe: :func:`decide_batch`)."""
    qs = questions(data)
    cfg = engine.cfg
    n = len(qs)
    trace = OnlineTrace(
        np.zeros(n, np.int64),
        np.zeros(n, bool),
        np.zeros(n, np.int64),
        np.zeros(n, np.int64),
        np.zeros(n, bool),
        np.zeros(n, bool),
        np.zeros(n),
    )
    pending: deque = deque()

    def deliver(i, decision, answer) -> None:
        q = qs[i]
        key = q.key if stream is None else stream
        reward = engine.reward(decision.pool, answer.answer == q.label)
        engine.observe(
            key, np.where(decision.called, q.predictions, -1), q.label, reward, _calibrating(q), decision.pool
        )
        engine.remember(decision, answer, reward, engine.fusion_reward(answer.answer == q.label), label=q.label)
        if drift is not None:
            called = np.where(decision.called, q.predictions, -1).tolist()
            signals = signals_of_outcome(
                answer.answer, q.label, reward, called, [str(m) for m in range(engine.n_models)]
            )
            found = [signal for signal, value in signals.items() if drift.observe(str(key), signal, value) is not None]
            if found:
                trace.detections.append((i, found))
                if reaction != "none":
                    engine.window(key).keep_last(keep if reaction == "trim" else 0)
                    if reaction == "reset" and engine.calibrations is not None:
                        engine.calibrations.streams.pop(key, None)
        if engine.update_due():
            engine.update()

    for i, q in enumerate(qs):
        decided = decide_batch(engine, [(q.key if stream is None else stream, q.decider_choices, cap)])
        (decision,) = decided.decisions
        explore = decision.explored
        # recorded data holds every called model's answer, so the pool always answers
        (answer,) = answer_batch(engine, decided, [q.probs], [decision.called], log=False).answers
        assert answer is not None
        if served is not None:
            served(i, decision, answer)
        trace.answers[i], trace.correct[i], trace.explored[i] = answer.answer, answer.answer == q.label, explore
        trace.greedy_correct[i] = (engine.greedy_answer(decision, q.probs) if explore else answer.answer) == q.label
        if (
            drift is not None
            and drift.observe(str(q.key if stream is None else stream), "confidence", math.exp(answer.answer_logp))
            is not None
        ):
            trace.label_free.append(i)
        trace.pool_size[i], trace.models_called[i] = decision.pool.sum(), decision.called.sum()
        trace.cost_share[i] = engine.cost_share[decision.called].sum()
        pending.append((i, decision, answer))
        while len(pending) > cfg.feedback_delay:
            deliver(*pending.popleft())
        if progress:
            progress(1)
    while pending:
        deliver(*pending.popleft())
    return trace
