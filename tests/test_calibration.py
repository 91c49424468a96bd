"""Each model's per-stream calibration and the pool's calibrated vote (rlens.focal.calibration)."""

import numpy as np
import pytest
import torch

from rlens.focal.agents import Decider, Fusion
from rlens.focal.calibration import StreamCalibration, fit_multinomial, log_softmax
from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.focal.features import (
    decider_obs_dim,
    fusion_feature_dim,
    model_features_in_decider_obs,
    reliability_weighted_log_probs,
)
from rlens.focal.greedy import GreedyActor


def test_the_fit_is_the_penalised_likelihoods_minimum():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 4)), rng.integers(0, 3, 60)
    theta = fit_multinomial(x, y, 3, strength=2.0)
    features = np.hstack([x, np.ones((60, 1))])
    p = np.exp(log_softmax(features @ theta))
    gradient = theta + 2.0 * features.T @ (p - np.eye(3)[y])
    assert np.abs(gradient).max() < 1e-6


def test_a_fit_on_a_constant_input_learns_the_label_frequency():
    """Labels 3 : 1 whatever the model says: the calibrated posterior is the frequency, shrunk a little by the
    penalty (0.5 |theta|^2 against 400 rows' likelihood)."""
    x = np.tile(np.log([[0.9, 0.1]]), (400, 1))
    y = np.array([0, 0, 0, 1] * 100)
    theta = fit_multinomial(x, y, 2)
    q = np.exp(log_softmax(x[0] @ theta[:-1] + theta[-1]))
    assert q == pytest.approx([0.75, 0.25], abs=0.01)


def _permuted(n: int, n_choices: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n questions where the model is confident in the choice after the right one (mod C)."""
    labels = rng.integers(0, n_choices, n)
    probs = np.full((n, n_choices), 0.1 / (n_choices - 1))
    probs[np.arange(n), (labels + 1) % n_choices] = 0.9
    return probs, labels


def test_the_calibration_undoes_a_models_systematic_mistake():
    """A model that always names the choice after the right one is always wrong raw, and right once calibrated."""
    rng = np.random.default_rng(1)
    calibration = StreamCalibration(n_models=2, rows=64, refit_every=8, min_rows=16)
    probs, labels = _permuted(48, 3, rng)
    uniform = np.full(3, 1 / 3)
    for p, label in zip(probs, labels):
        calibration.push(np.stack([p, uniform]), np.array([True, False]), int(label))
    new_probs, new_labels = _permuted(20, 3, rng)
    for p, label in zip(new_probs, new_labels):
        vote = calibration.vote(np.stack([p, uniform]), np.array([True, False]))
        assert vote is not None and vote.argmax() == label and p.argmax() != label


def test_a_pools_vote_is_the_naive_bayes_combination_of_its_members():
    """Two models that say nothing (constant inputs), labels 3 : 1: each calibrated posterior is about (3/4, 1/4),
    the prior (add-one) too, so the vote q1 q2 / prior is about (3/4, 1/4) again (not (9/10, 1/10), the product)."""
    calibration = StreamCalibration(n_models=2, rows=400, refit_every=8, min_rows=16)
    flat = np.full((2, 2), 0.5)
    for label in [0, 0, 0, 1] * 100:
        calibration.push(flat, np.array([True, True]), label)
    both = np.exp(calibration.vote(flat, np.array([True, True])))
    one = np.exp(calibration.vote(flat, np.array([True, False])))
    assert both == pytest.approx([0.75, 0.25], abs=0.01)
    assert one == pytest.approx([0.75, 0.25], abs=0.01)


def test_no_vote_until_every_member_has_its_rows_and_refits_come_every_few_rows():
    calibration = StreamCalibration(n_models=2, rows=64, refit_every=8, min_rows=16)
    rng = np.random.default_rng(2)
    probs, labels = _permuted(40, 2, rng)
    pool = np.array([True, True])
    for i in range(15):
        calibration.push(np.stack([probs[i], probs[i]]), np.array([True, False]), int(labels[i]))
    assert calibration.vote(np.stack([probs[0], probs[0]]), np.array([True, False])) is None  # 15 rows < 16
    calibration.push(np.stack([probs[15], probs[15]]), np.array([True, False]), int(labels[15]))
    assert calibration.vote(np.stack([probs[0], probs[0]]), np.array([True, False])) is not None
    assert calibration.vote(np.stack([probs[0], probs[0]]), pool) is None  # model 1 was never called
    first = calibration.fits[0, 2][1].copy()
    for i in range(16, 23):  # 7 new rows: no refit yet
        calibration.push(np.stack([probs[i], probs[i]]), np.array([True, False]), int(labels[i]))
    calibration.vote(np.stack([probs[0], probs[0]]), np.array([True, False]))
    assert np.array_equal(calibration.fits[0, 2][1], first)
    calibration.push(np.stack([probs[23], probs[23]]), np.array([True, False]), int(labels[23]))
    calibration.vote(np.stack([probs[0], probs[0]]), np.array([True, False]))
    assert not np.array_equal(calibration.fits[0, 2][1], first)


def test_the_greedy_answer_is_the_fusions_distribution_times_the_vote():
    torch.manual_seed(0)
    fusion = Fusion(fusion_feature_dim(3), 8, reliability_weighted_log_probs(3))
    actor = GreedyActor(Decider(decider_obs_dim(3, 1), 3, 8, model_features_in_decider_obs(3, 1)), fusion)
    features = np.random.default_rng(3).normal(size=(2, 4, fusion_feature_dim(3))).astype(np.float32)
    mask = np.array([[True] * 4, [True, True, True, False]])
    votes = np.log(np.array([[0.1, 0.2, 0.3, 0.4], [0.7, 0.2, 0.1, 1.0]]))
    _, _, own = actor.answers(features, mask)
    answers, logps, blended = actor.answers(features, mask, votes)
    expected = own * np.exp(votes) * mask
    expected /= expected.sum(1, keepdims=True)
    assert blended == pytest.approx(expected, abs=1e-6)
    assert np.array_equal(answers, expected.argmax(1))
    assert logps == pytest.approx(np.log(expected.max(1)), abs=1e-5)


def test_the_engines_greedy_answer_follows_the_calibrated_vote():
    """Stream 'a': model 0 always names the choice after the right one. With calibrations the greedy answer of a
    pool of model 0 is the right choice once 32 outcomes are in (an untrained Fusion alone follows model 0); a
    stream without outcomes answers as without calibrations; explored answers are the Fusion's own."""
    rng = np.random.default_rng(4)
    probs, labels = _permuted(52, 3, rng)
    uniform = np.full(3, 1 / 3)
    engines = {
        rows: FocalEngine(2, config=FocalConfig(calibration_rows=rows, calibration_refit=8), seed=0) for rows in (0, 64)
    }
    for engine in engines.values():
        for p, label in zip(probs[:32], labels[:32]):
            engine.observe("a", np.array([p.argmax(), -1]), int(label), 0.0, np.stack([p, uniform]))
    for p, label in zip(probs[32:], labels[32:]):
        answers = {}
        for rows, engine in engines.items():
            (decision,) = engine.decide("a", 3, greedy=True)
            decision.pool = decision.called = np.array([True, False])
            answers[rows] = engine.fuse(decision, np.stack([p, uniform])).answer
            pool = [decision.pool]
            assert engine.greedy_answers([decision], [np.stack([p, uniform])], pool, [None], pool) == [answers[rows]]
            (cold,) = engine.decide("b", 3, greedy=True)
            cold.pool = cold.called = np.array([True, False])
            answers[rows, "b"] = engine.fuse(cold, np.stack([p, uniform])).answer
        assert answers[0] == p.argmax() != label and answers[64] == label
        assert answers[0, "b"] == answers[64, "b"] == p.argmax()
