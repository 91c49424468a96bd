"""The NumPy greedy actor computes what the torch agents compute, on the same (live) weights."""

import numpy as np
import torch

from rlens.focal.agents import Decider, Fusion
from rlens.focal.greedy import GreedyActor


def _trained_agents(seed: int = 0) -> tuple[Decider, Fusion]:
    """Agents whose every weight is away from its special initialisation (zero heads, zero residual output)."""
    torch.manual_seed(seed)
    decider = Decider(obs_dim=20, n_models=4, hidden=8, model_features=slice(6, 18))
    fusion = Fusion(feature_dim=23, hidden=8, reliability_weighted_log_probs=slice(8, 12))
    with torch.no_grad():
        for p in [*decider.parameters(), *fusion.parameters()]:
            p.add_(0.5 * torch.randn_like(p))
    return decider, fusion


def test_greedy_pools_and_log_probs_equal_the_torch_deciders():
    decider, fusion = _trained_agents()
    actor = GreedyActor(decider, fusion)
    obs = torch.randn(256, 20)
    with torch.no_grad():
        # some observations give an empty draw: the fallback pool
        decider.heads.bias[:] = torch.tensor([-3.0, -3.0, -3.0, -3.0])
        logits = decider.logits(obs)
        pools, logp = decider.sample(logits, greedy=True)
    np_pools, np_logp = actor.pools(obs.numpy())
    assert np.allclose(actor.decider_logits(obs.numpy()), logits.numpy(), atol=1e-5)
    assert (np_pools == pools.numpy().astype(bool)).all()
    assert np.allclose(np_logp, logp.numpy(), atol=1e-5)
    assert (np_pools.sum(1) == 1).any() and (np_pools.sum(1) > 1).any()  # both cases were exercised


def test_fallback_pool_gets_the_empty_draws_probability():
    """Every logit negative: the greedy pool is the most likely model alone, with P = P(that draw) + P(empty draw)."""
    decider, fusion = _trained_agents()
    actor = GreedyActor(decider, fusion)
    logits = np.array([[-1.0, -0.5, -2.0, -3.0]], dtype=np.float32)
    actor.decider_logits = lambda obs: logits  # type: ignore[method-assign]
    pools, logp = actor.pools(np.zeros((1, 20), np.float32))
    s = 1 / (1 + np.exp(-logits[0]))
    empty = np.prod(1 - s)
    alone = s[1] * (1 - s[0]) * (1 - s[2]) * (1 - s[3])
    assert pools.tolist() == [[False, True, False, False]]
    assert np.isclose(logp[0], np.log(alone + empty), atol=1e-6)


def test_greedy_answers_equal_the_torch_fusions_with_padding():
    decider, fusion = _trained_agents(1)
    actor = GreedyActor(decider, fusion)
    features = torch.randn(64, 5, 23)
    mask = torch.ones(64, 5, dtype=torch.bool)
    mask[::2, 3:] = False  # half the queries have 3 choices, padded to 5
    with torch.no_grad():
        answers, logps, dists = fusion.act(features, mask, torch.zeros(64, dtype=torch.bool))
    np_answers, np_logps, np_dists = actor.answers(features.numpy(), mask.numpy())
    assert (np_answers == answers.numpy()).all()
    assert np.allclose(np_logps, logps.numpy(), atol=1e-5) and np.allclose(np_dists, dists.numpy(), atol=1e-6)
    assert (np_dists[::2, 3:] == 0).all() and np.allclose(np_dists.sum(1), 1, atol=1e-6)


def test_the_actor_reads_the_live_weights():
    """An optimiser step or a loaded state dict changes the parameters in place: the actor sees it at once."""
    decider, fusion = _trained_agents()
    actor = GreedyActor(decider, fusion)
    obs = np.random.default_rng(0).standard_normal((8, 20)).astype(np.float32)
    before = actor.decider_logits(obs)
    other, _ = _trained_agents(seed=7)
    decider.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert np.allclose(actor.decider_logits(obs), other.logits(torch.from_numpy(obs)).numpy(), atol=1e-5)
    assert not np.allclose(actor.decider_logits(obs), before)
    optimizer = torch.optim.SGD(fusion.parameters(), lr=0.1)
    features, mask = torch.randn(4, 3, 23), torch.ones(4, 3, dtype=torch.bool)
    fusion.scores(features, mask).sum().backward()
    optimizer.step()
    with torch.no_grad():
        assert np.allclose(
            actor.fusion_scores(features.numpy(), mask.numpy()), fusion.scores(features, mask).numpy(), atol=1e-5
        )
