"""Agent shapes, masking, the never-empty pool and the Fusion agent's starting point."""

import numpy as np
import pytest
import torch

from rlens.focal.agents import CentralCritic, Decider, Fusion
from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.focal.metrics import METRIC_NAMES
from rlens.focal.window import OutcomeWindow
from rlens.focal.features import (
    critic_state,
    critic_state_dim,
    decider_obs_dim,
    decider_observation,
    model_features_in_decider_obs,
    fusion_feature_dim,
    fusion_observation,
    reliability_weighted_log_probs,
)


def test_decider_never_returns_an_empty_pool():
    decider = Decider(obs_dim=15, n_models=4, hidden=8, model_features=slice(3, 15))
    with torch.no_grad():
        decider.heads.bias.fill_(-20.0)  # every head says "do not call"
        decider.heads.bias[2] = -10.0
    pools, logp = decider.act(torch.zeros(16, 15), greedy=False)
    assert pools.shape == (16, 4) and logp.shape == (16,)
    assert (pools.sum(1) == 1).all() and (pools[:, 2] == 1).all()  # the most likely model alone
    greedy, _ = decider.act(torch.zeros(15), greedy=True)
    assert greedy.tolist() == [0.0, 0.0, 1.0, 0.0]


def test_decider_log_prob_counts_the_empty_draw_in_the_fallback_pool():
    """P(pool) is the Bernoulli draws' probability, except for the most likely model alone, which also gets the
    probability of the empty draw that never_empty turns into it (hand-computed)."""
    logits = torch.tensor([[2.0, -1.0, -3.0]] * 3)
    pools = torch.tensor([[1.0, 0, 0], [0, 1, 0], [1, 1, 0]])
    s = torch.sigmoid(logits[0])
    expected = torch.stack([(1 - s[1]) * (1 - s[2]), (1 - s[0]) * s[1] * (1 - s[2]), s[0] * s[1] * (1 - s[2])]).log()
    assert torch.allclose(Decider.log_prob(logits, pools), expected, atol=1e-6)
    decider = Decider(obs_dim=15, n_models=4, hidden=8, model_features=slice(3, 15))
    obs = torch.randn(32, 15)
    drawn, logp = decider.act(obs, greedy=False, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(logp, Decider.log_prob(decider.logits(obs), drawn), atol=1e-6)


def test_untrained_decider_calls_the_models_close_to_the_most_reliable():
    window = OutcomeWindow(n_models=4, size=64)
    for row in range(20):  # right 12, 11, 6, 9 times of 20 -> reliability 13/22, 12/22, 7/22, 10/22
        window.push(np.array([int(row >= 12), int(row >= 11), int(row >= 6), int(row >= 9)]), label=0, reward=0.0)
    obs = torch.from_numpy(decider_observation(window, np.ones(4, bool), 2, METRIC_NAMES, 16))
    features = obs[model_features_in_decider_obs(4, len(METRIC_NAMES))].reshape(3, 4)
    assert features[1].tolist() == pytest.approx([0.0, -1 / 22, -6 / 22, -3 / 22])  # gap to the best
    assert features[2].tolist() == pytest.approx([0.0, 1 / 3, 1.0, 2 / 3])  # rank
    decider = Decider(len(obs), 4, hidden=8, model_features=model_features_in_decider_obs(4, len(METRIC_NAMES)))
    pool, _ = decider.act(obs, greedy=True)
    assert pool.tolist() == [1.0, 1.0, 0.0, 0.0]  # logit 1 + 10 * gap > 0 only within 0.1 of the best


@pytest.mark.parametrize("n_models, n_choices", [(2, 2), (5, 19), (32, 7)])
def test_fusion_masks_invalid_choices_for_any_pool_size(n_models, n_choices):
    fusion = Fusion(
        fusion_feature_dim(n_models), hidden=16, reliability_weighted_log_probs=reliability_weighted_log_probs(n_models)
    )
    features = torch.randn(3, n_choices, fusion_feature_dim(n_models))
    mask = torch.ones(3, n_choices, dtype=torch.bool)
    mask[0, 1:] = False
    mask[0, 0] = True
    mask[1, -1] = False
    with torch.no_grad():
        probs = fusion.distribution(features, mask).probs
    assert probs.shape == (3, n_choices)
    assert torch.allclose(probs.sum(1), torch.ones(3))
    assert probs[0, 0].item() == pytest.approx(1.0) and probs[1, -1].item() == 0.0


def test_untrained_fusion_is_the_reliability_weighted_log_linear_pool():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(4), size=3).astype(np.float32)  # 3 models, 4 choices
    pool = np.array([True, False, True])
    reliability = np.array([0.9, 0.5, 0.3], np.float32)
    features = fusion_observation(probs * pool[:, None], pool, reliability, np.zeros(4, np.float32))
    fusion = Fusion(fusion_feature_dim(3), hidden=16, reliability_weighted_log_probs=reliability_weighted_log_probs(3))
    got = fusion.distribution(torch.from_numpy(features), torch.ones(4, dtype=torch.bool)).probs.detach().numpy()
    expected = np.exp(2 / 3 * (0.9 * np.log(probs[0]) + 0.3 * np.log(probs[2])))
    assert got == pytest.approx(expected / expected.sum(), rel=1e-4)


def test_fusion_ignores_models_outside_the_pool():
    engine = FocalEngine(3, config=FocalConfig(), seed=0)
    (decision,) = engine.decide("s", 4, greedy=True)
    decision.pool[:] = [True, True, False]
    probs = np.full((3, 4), 0.25, dtype=np.float32)
    a = engine.fuse(decision, probs)
    probs[2] = [1.0, 0.0, 0.0, 0.0]  # a model not in the pool changes its answer
    b = engine.fuse(decision, probs)
    assert np.array_equal(a.distribution, b.distribution)


def test_engine_shapes_and_reward():
    cfg = FocalConfig()
    engine = FocalEngine(5, model_costs=np.array([4.0, 1, 1, 1, 1]), config=cfg, seed=1)
    decisions = engine.decide("task", n_choices=3, greedy=False, rollouts=6)
    assert len(decisions) == 6 and decisions[0].state.shape == (decider_obs_dim(5, len(cfg.metrics)),)
    assert all(d.pool.any() for d in decisions)
    assert engine.reward(np.array([True, False, False, False, False]), True) == pytest.approx(1 - cfg.alpha * 0.5)
    assert engine.reward(np.ones(5, bool), False) == pytest.approx(-1 - cfg.alpha)
    answer = engine.fuse(decisions[0], np.full((5, 3), 1 / 3, np.float32))
    assert answer.critic_state.shape == (critic_state_dim(5, len(cfg.metrics)),)
    assert answer.critic_state[-1] == pytest.approx(decisions[0].pool.sum() / 5)  # the fused pool's share


def test_critic_state_summarises_the_fused_pool_only():
    probs = np.array([[0.8, 0.2], [0.3, 0.7], [0.6, 0.4]], np.float32)
    state = critic_state(np.array([0.5], np.float32), probs, np.array([True, False, True]))
    h = lambda p: -(p * np.log(p) + (1 - p) * np.log(1 - p)) / np.log(2)  # noqa: E731
    # decider state | top prob | normalised entropy | agrees with the pool's plurality (choice 0) | pool share
    expected = [0.5, 0.8, 0.0, 0.6, h(0.8), 0.0, h(0.6), 1.0, 0.0, 1.0, 2 / 3]
    np.testing.assert_allclose(state, expected, rtol=1e-5)


def test_critic_heads_decider_head_reads_only_the_decider_observation():
    critic = CentralCritic(decider_dim=4, state_dim=7, hidden=8)
    state = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    changed = state.clone()
    changed[:, 4:] += 1.0  # the pool's answers change, the Decider's observation does not
    a, b = critic(state), critic(changed)
    assert a.shape == (3, 2)
    assert torch.equal(a[:, 0], b[:, 0]) and not torch.allclose(a[:, 1], b[:, 1])
