"""RLAE agents: GAE over the spans of episodes (hand-computed), seeded sampling, and PPO / MAPPO updates that make a
rewarded weighting more likely on a toy two-model task."""

import numpy as np
import pytest
import torch

from rlens.rlae.agent import RLAEConfig, Span, gae_over_spans, make_policy, update


def test_gae_over_spans_matches_a_hand_computation():
    # episode 1: spans 0, 1 (reward 1 at the end); episode 2: spans 2, 3 (reward 0.5); gamma 1, lambda 0.5
    advantages, returns = gae_over_spans(
        np.array([0, 1, 0, 0.5]), np.array([0.2, 0.4, 0.1, 0.3]), np.array([False, True, False, True]), 1.0, 0.5
    )
    np.testing.assert_allclose(advantages, [0.5, 0.6, 0.3, 0.2], atol=1e-6)
    np.testing.assert_allclose(returns, [0.7, 1.0, 0.4, 0.5], atol=1e-6)


@pytest.mark.parametrize("variant", ["ppo", "mappo"])
def test_sampling_is_seeded_and_weights_are_on_the_simplex(variant):
    cfg = RLAEConfig(variant=variant, hidden=16)
    policy = make_policy(3, 4, cfg, seed=1)
    obs = torch.ones(5, 3)
    a1, lp1, _ = policy.act(obs, generator=torch.Generator().manual_seed(7))
    a2, lp2, _ = policy.act(obs, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a1, a2) and torch.equal(lp1, lp2)
    weights = policy.weights(a1)
    assert (weights >= 0).all() and torch.allclose(weights.sum(-1), torch.ones(5))
    assert torch.allclose(policy.evaluate(obs, a1)[0], lp1, atol=1e-5)


@pytest.mark.parametrize("variant", ["ppo", "mappo"])
def test_updates_make_the_rewarded_weighting_more_likely(variant):
    """Two models; an episode is two spans; reward 1 when the last span trusts model 0 more (w0 > 0.5)."""
    cfg = RLAEConfig(variant=variant, hidden=32, lr=3e-3, minibatch_size=64)
    policy = make_policy(2, 2, cfg, seed=0)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    generator = torch.Generator().manual_seed(0)
    obs = np.array([[1.0, 0.0], [1.0, 1.0]], dtype=np.float32)  # the observation at span 0 and span 1

    def rewarded_share(n: int = 400) -> float:
        with torch.no_grad():
            actions, _, _ = policy.act(torch.from_numpy(obs[1]).expand(n, -1), generator=generator)
        return float((policy.weights(actions)[:, 0] > 0.5).float().mean())

    before = rewarded_share()
    for _ in range(25):
        spans = []
        for _ in range(64):
            with torch.no_grad():
                actions, logps, values = policy.act(torch.from_numpy(obs), generator=generator)
            reward = float(policy.weights(actions)[1, 0] > 0.5)
            spans += [
                Span(obs[0], actions[0].numpy(), float(logps[0]), float(values[0])),
                Span(obs[1], actions[1].numpy(), float(logps[1]), float(values[1]), reward=reward, last=True),
            ]
        update(policy, optimizer, spans, cfg, generator)
    after = rewarded_share()
    assert 0.3 < before < 0.7
    assert after > 0.9, (before, after)


def test_update_rejects_a_cut_episode():
    cfg = RLAEConfig(hidden=8)
    policy = make_policy(2, 2, cfg)
    with pytest.raises(ValueError, match="whole episodes"):
        update(policy, torch.optim.Adam(policy.parameters()), [Span(np.zeros(2), np.array([0.5, 0.5]), 0.0, 0.0)], cfg)


def test_the_ranker_learns_which_model_to_trust_per_kind_of_question(encoder):
    """Model 0 answers sums right and model 1 words; the ranker, trained on other tasks, picks the right one."""
    from rlens.rlae.ranker import AnswerRanker
    from rlens.zoo.fewshot import fewshot_split

    def answers(tasks):
        right = {t.prompt: t.reference for t in tasks}
        return [[right[t.prompt] if (t.family == "add") == (m == 0) else "x" for t in tasks] for m in range(2)]

    train, test = fewshot_split(["add", "uppercase"], 48, seed=0), fewshot_split(["add", "uppercase"], 24, seed=1)
    ranker = AnswerRanker(encoder, 2).fit(train, answers(train))
    chosen = ranker.choose(test, answers(test))
    assert chosen.tolist() == [0 if t.family == "add" else 1 for t in test]
