"""GAE against a hand computation; MAPPO updates move both agents toward rewarded actions on toy problems."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.focal.features import critic_state
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
    before = torch.sigmoid(engine.decider.logits(torch.from_numpy(probe.state)))[1].item()
    with torch.no_grad():
        engine.decider.heads.bias[1] = -1.0  # start unlikely
    start = torch.sigmoid(engine.decider.logits(torch.from_numpy(probe.state)))[1].item()
    for _ in range(15):
        for decision in engine.decide("s", 2, greedy=False, rollouts=64):
            reward = 1.0 if decision.pool[1] else -1.0
            engine.remember(
                decision, None, reward, reward, critic_state(decision.state, np.full((3, 2), 0.5), decision.pool)
            )
        engine.update(train_decider=True, train_fusion=False, envs=64)
    (probe,) = engine.decide("s", 2, greedy=False)
    after = torch.sigmoid(engine.decider.logits(torch.from_numpy(probe.state)))[1].item()
    assert before > 0.5 and start < 0.3 and after > 0.9


def test_fusion_learns_the_rewarded_answer():
    """Choice 2 of 3 is always right while the models say otherwise: its probability must rise."""
    engine = toy_engine()
    probs = np.array([[0.6, 0.3, 0.1], [0.5, 0.3, 0.2], [0.7, 0.2, 0.1]], dtype=np.float32)
    (decision,) = engine.decide("s", 3, greedy=True)
    start = engine.fuse(decision, probs).distribution[2]
    for _ in range(20):
        for decision in engine.decide("s", 3, greedy=False, rollouts=32):
            answer = engine.fuse(decision, probs)
            engine.remember(decision, answer, 1.0 if answer.answer == 2 else -1.0, 1.0 if answer.answer == 2 else -1.0)
        engine.update(train_decider=False, train_fusion=True, envs=32)
    (decision,) = engine.decide("s", 3, greedy=True)
    after = engine.fuse(decision, probs)
    assert start < 0.2 and after.distribution[2] > 0.8 and after.answer == 2


def test_updates_are_deterministic_under_a_seed():
    def run():
        engine = toy_engine(seed=7)
        for decision in engine.decide("s", 2, greedy=False, rollouts=16):
            engine.remember(decision, engine.fuse(decision, np.array([[0.9, 0.1]] * 3, np.float32)), 1.0, 1.0)
        engine.update(envs=16)
        return engine.policy_state()

    a, b = run(), run()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_policy_state_round_trip():
    trained = toy_engine(seed=3)
    for decision in trained.decide("s", 2, greedy=False, rollouts=16):
        trained.remember(decision, trained.fuse(decision, np.array([[0.9, 0.1]] * 3, np.float32)), 1.0, 1.0)
    trained.update(envs=16)
    fresh = toy_engine(seed=4)
    fresh.load_policy_state(trained.policy_state())
    assert all(torch.equal(a, b) for a, b in zip(trained.policy_state().values(), fresh.policy_state().values()))
    probs = np.array([[0.2, 0.8], [0.6, 0.4], [0.5, 0.5]], np.float32)
    (a,) = trained.decide("t", 2, greedy=True)
    (b,) = fresh.decide("t", 2, greedy=True)
    assert np.array_equal(a.pool, b.pool)
    assert np.allclose(trained.fuse(a, probs).distribution, fresh.fuse(b, probs).distribution)


def test_logged_log_probabilities_are_those_of_the_sampled_actions():
    """Explored decisions: the empirical frequency of each pool and each answer matches exp(logged log-prob)."""
    engine = toy_engine(seed=11)
    with torch.no_grad():
        engine.decider.heads.bias.copy_(torch.tensor([0.3, -0.4, 0.1]))
    probs = np.array([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.4, 0.4, 0.2]], np.float32)
    decisions = engine.decide("s", 3, greedy=False, rollouts=4000)
    assert all(d.explored for d in decisions)
    pools, logged = {}, {}
    for d in decisions:
        pools[d.pool.tobytes()] = pools.get(d.pool.tobytes(), 0) + 1
        logged[d.pool.tobytes()] = d.pool_logp
    for pool, count in pools.items():
        assert count / 4000 == pytest.approx(np.exp(logged[pool]), abs=0.03)
    (d,) = engine.decide("s", 3, greedy=False)
    answers = [engine.fuse(d, probs) for _ in range(3000)]
    for choice in range(3):
        taken = [a for a in answers if a.answer == choice]
        assert len(taken) / 3000 == pytest.approx(np.exp(taken[0].answer_logp), abs=0.03)
    (g,) = engine.decide("s", 3, greedy=True)
    greedy = engine.fuse(g, probs)
    assert not g.explored and greedy.answer == int(np.argmax(greedy.distribution))
    assert greedy.answer_logp == pytest.approx(np.log(greedy.distribution.max()), abs=1e-5)


def test_greedy_transitions_train_only_the_critic():
    engine = toy_engine(seed=2)
    probs = np.array([[0.9, 0.1]] * 3, np.float32)
    before = engine.policy_state()
    for decision in engine.decide("s", 2, greedy=True, rollouts=8):
        engine.remember(decision, engine.fuse(decision, probs), 1.0, 1.0)
    assert not engine.update_due()  # nothing explored yet
    stats = engine.update(envs=8)
    after = engine.policy_state()
    assert stats["explored_share"] == 0.0 and "decider_policy_loss" not in stats and "fusion_policy_loss" not in stats
    assert all(torch.equal(before[k], after[k]) for k in before if not k.startswith("critic."))
    assert not all(torch.equal(before[k], after[k]) for k in before if k.startswith("critic."))


def test_each_agent_has_its_own_reward():
    """The Decider pays the pool's cost, the Fusion agent does not: returns differ by exactly the cost term."""
    cfg = replace(FocalConfig(), alpha=0.5)
    engine = FocalEngine(2, config=cfg, seed=0)
    (decision,) = engine.decide("s", 2, greedy=False)
    correct = True
    assert engine.reward(decision.pool, correct) == pytest.approx(1.0 - 0.5 * decision.pool.sum() / 2)
    assert engine.fusion_reward(correct) == 1.0 and engine.fusion_reward(False) == -1.0


def test_supervised_fusion_fit_learns_the_labelled_answer():
    """Labels say choice 2 of 3 while the models prefer choice 0: cross-entropy moves the Fusion's mode to choice 2."""
    engine = FocalEngine(3, config=replace(toy_engine().cfg, fusion_supervised_epochs=40), seed=5)
    probs = np.array([[0.6, 0.3, 0.1], [0.5, 0.3, 0.2], [0.7, 0.2, 0.1]], np.float32)
    decisions = engine.decide("s", 3, greedy=False, rollouts=64)
    features = [engine.fusion_features(d, probs) for d in decisions]
    assert engine.fuse(decisions[0], probs).distribution.argmax() == 0
    stats = engine.fit_fusion(features, [2] * len(features))
    (g,) = engine.decide("s", 3, greedy=True)
    assert stats["accuracy"] > 0.9 and engine.fuse(g, probs).answer == 2
    # only the Fusion moved
    assert all(torch.equal(a, b) for a, b in zip(engine.decider.parameters(), toy_engine(seed=5).decider.parameters()))


def test_labels_train_the_fusion_on_greedy_transitions_too():
    """With label_coef > 0 a labelled greedy transition moves the Fusion toward its label (a label is right whatever
    was answered); the Decider, with no explored transition, stays put."""
    engine = FocalEngine(3, config=replace(toy_engine().cfg, label_coef=1.0), seed=4)
    probs = np.array([[0.6, 0.3, 0.1], [0.5, 0.3, 0.2], [0.7, 0.2, 0.1]], np.float32)
    (g,) = engine.decide("s", 3, greedy=True)
    start = engine.fuse(g, probs).distribution[2]
    decider_before = {k: v for k, v in engine.policy_state().items() if k.startswith("decider.")}
    for _ in range(10):
        for decision in engine.decide("s", 3, greedy=True, rollouts=32):
            answer = engine.fuse(decision, probs)
            engine.remember(decision, answer, -1.0, -1.0, label=2)
        stats = engine.update(envs=32)
    assert stats["label_loss"] > 0 and "fusion_policy_loss" not in stats
    assert engine.fuse(g, probs).distribution[2] > start + 0.3
    assert all(torch.equal(v, engine.policy_state()[k]) for k, v in decider_before.items())
