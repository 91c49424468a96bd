"""Baselines run on the same test questions as RL-Focal (pure numpy / scikit-learn, no I/O).

Every baseline returns its answer to each test question as an index into the full choice axis, plus
how many models it calls per question. Methods "chosen on the warm-start split" need one: under the
``stream`` protocol (no warm start) best-single and best-single-per-task are chosen in hindsight on the
test stream itself (an optimistic reference) and stacking is not run.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression

from rlens.focal.features import LOG_FLOOR
from rlens.focal.voting import plurality_vote, soft_vote
from rlens.records.recorded import RecordedDataset


@dataclass
class BaselineRun:
    answers: np.ndarray  # [n_test] choice index
    models_called: float  # per question
    cost_share: float = 1.0  # the share of the whole pool's cost per question (mean); 1.0: every model called


def cost_shares(data: RecordedDataset) -> np.ndarray:
    """Each model's share of the whole pool's cost [M]."""
    return data.model_costs / data.model_costs.sum()


def model_predictions(data: RecordedDataset) -> np.ndarray:
    """Each model's argmax choice [N, M] (padded choices carry probability 0); -1 where a model gave no answer (an
    all-zero row: open-ended datasets)."""
    return np.where(data.probs.max(2) > 0, np.where(data.choice_mask[:, None, :], data.probs, -1.0).argmax(2), -1)


def single_models(test: RecordedDataset) -> dict[int, BaselineRun]:
    predictions = model_predictions(test)
    shares = cost_shares(test)
    return {j: BaselineRun(predictions[:, j], 1.0, float(shares[j])) for j in range(test.n_models)}


def best_single(warm: RecordedDataset, test: RecordedDataset) -> BaselineRun:
    reference = warm if warm.n_questions else test
    j = int((model_predictions(reference) == reference.labels[:, None]).mean(0).argmax())
    return BaselineRun(model_predictions(test)[:, j], 1.0, float(cost_shares(test)[j]))


def best_single_per_task(warm: RecordedDataset, test: RecordedDataset) -> BaselineRun:
    reference = warm if warm.n_questions else test
    ref_correct = model_predictions(reference) == reference.labels[:, None]
    overall = int(ref_correct.mean(0).argmax())
    predictions = model_predictions(test)
    answers = predictions[:, overall].copy()
    shares, spent = cost_shares(test), np.zeros(test.n_questions)
    for task_id in np.unique(test.task):
        rows = reference.task == task_id
        best = int(ref_correct[rows].mean(0).argmax()) if rows.any() else overall
        answers[test.task == task_id] = predictions[test.task == task_id, best]
        spent[test.task == task_id] = shares[best]
    return BaselineRun(answers, 1.0, float(spent.mean()) if len(spent) else 0.0)


def plurality(test: RecordedDataset) -> BaselineRun:
    answers = plurality_vote(model_predictions(test), test.choice_mask.shape[1], test.probs.sum(1))
    return BaselineRun(answers, float(test.n_models))


def soft_voting(test: RecordedDataset) -> BaselineRun:
    return BaselineRun(soft_vote(test.probs), float(test.n_models))


def oracle(test: RecordedDataset) -> BaselineRun:
    """Any-model-correct upper bound: the label whenever some model predicted it."""
    predictions = model_predictions(test)
    any_right = (predictions == test.labels[:, None]).any(1)
    return BaselineRun(np.where(any_right, test.labels, predictions[:, 0]), float(test.n_models))


def hedge(test: RecordedDataset) -> BaselineRun:
    """Online Hedge over the models (loss 1 for a wrong answer), weighted vote of their predictions.

    Learning rate sqrt(8 ln M / n) (the standard fixed-horizon choice); weights updated after each label.
    """
    predictions = model_predictions(test)
    n, m = predictions.shape
    eta = np.sqrt(8 * np.log(max(m, 2)) / max(n, 1))
    log_w = np.zeros(m)
    answers = np.zeros(n, dtype=np.int64)
    for i in range(n):
        weights = np.exp(log_w - log_w.max())
        votes = np.zeros(test.choice_mask.shape[1])
        answered = predictions[i] >= 0
        np.add.at(votes, predictions[i][answered], weights[answered])
        answers[i] = int(votes.argmax())
        log_w -= eta * (predictions[i] != test.labels[i])
    return BaselineRun(answers, float(m))


def online_stacking(test: RecordedDataset, lr: float = 0.01) -> BaselineRun:
    """An online per-task stacker: a conditional logit over the choices, score(c) = sum_m w_m log p_m(c) + b_c, one
    (w, b) per task, starting from w = 1 / M, b = 0 (the product of the models' distributions), one SGD step on the
    cross-entropy after each label. Every model is called. ``lr`` 0.01: the best of 0.005–0.2 on bbh_dev's tuning
    half (BENCHMARKS.md)."""
    n, m, width = test.probs.shape
    answers = np.zeros(n, dtype=np.int64)
    weights: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for i in range(n):
        w, b = weights.setdefault(int(test.task[i]), (np.full(m, 1.0 / m), np.zeros(width)))
        valid = test.choice_mask[i]
        log_p = np.log(np.maximum(test.probs[i], LOG_FLOOR))  # [M, C]
        scores = np.where(valid, w @ log_p + b, -np.inf)
        answers[i] = int(scores.argmax())
        p = np.exp(scores - scores.max())
        p /= p.sum()
        p[test.labels[i]] -= 1.0  # the gradient of the cross-entropy on the scores
        w -= lr * (log_p @ np.where(valid, p, 0.0))
        b -= lr * np.where(valid, p, 0.0)
    return BaselineRun(answers, float(m))


def _stacking_features(data: RecordedDataset, rows: np.ndarray) -> np.ndarray:
    return np.log(np.maximum(data.probs[rows], LOG_FLOOR)).reshape(len(rows), -1)


def stacking(warm: RecordedDataset, test: RecordedDataset) -> BaselineRun | None:
    """Supervised per-task stacking (LLM-TOPLA-like anchor): logistic regression on every model's
    log-probabilities of the task's choices, fit on the warm-start split of that task."""
    if warm.n_questions == 0:
        return None
    fallback = best_single_per_task(warm, test).answers
    answers = fallback.copy()
    for task_id in np.unique(test.task):
        train_rows, test_rows = np.flatnonzero(warm.task == task_id), np.flatnonzero(test.task == task_id)
        if len(np.unique(warm.labels[train_rows])) < 2:
            continue  # one class (or none) on the warm split: keep the best single model of the task
        model = LogisticRegression(C=1.0, max_iter=2000)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            model.fit(_stacking_features(warm, train_rows), warm.labels[train_rows])
        scores = np.full((len(test_rows), test.choice_mask.shape[1]), -np.inf)
        scores[:, model.classes_] = model.predict_log_proba(_stacking_features(test, test_rows))
        scores[~test.choice_mask[test_rows]] = -np.inf
        answers[test_rows] = scores.argmax(1)
    return BaselineRun(answers, float(test.n_models))
