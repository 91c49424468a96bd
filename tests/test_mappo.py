"""GAE against a hand computation; MAPPO updates move both agents toward rewarded actions on toy problems."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.focal.mappo import gae


def test_gae_hand_computed():
    rewards = np.array([[1.0], [0.0], [2.0]], dtype=np.float32)
    values = np.array([[0.5], [1.0], [0.0]], dtype=np.float32)
    adv, ret = gae(rewards, values, np.array([1.0], np.float32), gamma=0.5, lam=0.9)
    d2 = 2.0 + 0.5 * 1.0 - 0.0  # 2.5
    d1 = 0.0 + 0.5 * 0.0 - 1.0  # -1.0
    d0 = 1.0 + 0.5 * 1.0 - 0.5  # 1.0
    a2, a1 = d2, d1 + 0.45 * d2
    a0 = d0 + 0.45 * a1
    assert adv[:, 0] == pytest.approx([a0, a1, a2])
    assert ret[:, 0] == pytest.approx([a0 + 0.5, a1 + 1.0, a2])


def test_gae_keeps_parallel_environments_apart():
    rewards = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    values = np.zeros_like(rewards)
    adv, _ = gae(rewards, values, np.zeros(2, np.float32), gamma=1.0, lam=1.0)
    assert adv.tolist() == [[1.0, 1.0], [0.0, 1.0]]


def toy_engine(seed=0):
    cfg = replace(FocalConfig(), update_epochs=4, minibatch_size=32, lr=3e-3, alpha=0.0)
    return FocalEngine(3, config=cfg, seed=seed)


def test_decider_learns_to_call_the_rewarded_model():
    """Reward +1 when model 1 is in the pool, -1 otherwise: P(call model 1) must rise."""
    engine = toy_engine()
    (probe,) = engine.decide("s", 2, greedy=False)
    before = torch.sigmoid(engine.decider.distribution(torch.from_numpy(probe.state)).logits)[1].item()
    with torch.no_grad():
        engine.decider.heads.bias[1] = -1.0  # start unlikely
    start = torch.sigmoid(engine.decider.distribution(torch.from_numpy(probe.state)).logits)[1].item()
    for _ in range(15):
        for decision in engine.decide("s", 2, greedy=False, rollouts=64):
            engine.remember(decision, None, 1.0 if decision.pool[1] else -1.0)
        engine.update(train_decider=True, train_fusion=False, envs=64)
    (probe,) = engine.decide("s", 2, greedy=False)
    after = torch.sigmoid(engine.decider.distribution(torch.from_numpy(probe.state)).logits)[1].item()
    assert before > 0.5 and start < 0.3 and after > 0.9


def test_fusion_learns_the_rewarded_answer():
    """Choice 2 of 3 is always right while the models say otherwise: its probability must rise."""
    engine = toy_engine()
    probs = np.array([[0.6, 0.3, 0.1], [0.5, 0.3, 0.2], [0.7, 0.2, 0.1]], dtype=np.float32)
    (decision,) = engine.decide("s", 3, greedy=True)
    start = engine.fuse(decision, probs, greedy=True).distribution[2]
    for _ in range(20):
        for decision in engine.decide("s", 3, greedy=False, rollouts=32):
            answer = engine.fuse(decision, probs, greedy=False)
            engine.remember(decision, answer, 1.0 if answer.answer == 2 else -1.0)
        engine.update(train_decider=False, train_fusion=True, envs=32)
    (decision,) = engine.decide("s", 3, greedy=True)
    after = engine.fuse(decision, probs, greedy=True)
    assert start < 0.2 and after.distribution[2] > 0.8 and after.answer == 2


def test_updates_are_deterministic_under_a_seed():
    def run():
        engine = toy_engine(seed=7)
        for decision in engine.decide("s", 2, greedy=False, rollouts=16):
            engine.remember(decision, engine.fuse(decision, np.array([[0.9, 0.1]] * 3, np.float32), greedy=False), 1.0)
        engine.update(envs=16)
        return engine.policy_state()

    a, b = run(), run()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_policy_state_round_trip():
    trained = toy_engine(seed=3)
    for decision in trained.decide("s", 2, greedy=False, rollouts=16):
        trained.remember(decision, trained.fuse(decision, np.array([[0.9, 0.1]] * 3, np.float32), greedy=False), 1.0)
    trained.update(envs=16)
    fresh = toy_engine(seed=4)
    fresh.load_policy_state(trained.policy_state())
    assert all(torch.equal(a, b) for a, b in zip(trained.policy_state().values(), fresh.policy_state().values()))
    probs = np.array([[0.2, 0.8], [0.6, 0.4], [0.5, 0.5]], np.float32)
    (a,) = trained.decide("t", 2, greedy=True)
    (b,) = fresh.decide("t", 2, greedy=True)
    assert np.array_equal(a.pool, b.pool)
    assert np.allclose(trained.fuse(a, probs, greedy=True).distribution, fresh.fuse(b, probs, greedy=True).distribution)
