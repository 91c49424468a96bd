"""The two agents and the centralized critic (torch modules).

* :class:`Decider`: shared MLP trunk branching into one Bernoulli head per model (action branching);
  the sampled pool is never empty (an empty draw becomes the single most likely model).
* :class:`Fusion`: one network shared across choices scores every choice from the per-choice features;
  a softmax over the valid choices gives the answer distribution. Works for any pool size and choice count.
* :class:`CentralCritic`: one value head per agent over the global state (MAPPO), each the baseline of its agent's
  own reward: the Decider's head reads the Decider observation, the Fusion's the whole critic state.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.distributions import Categorical


def mlp(n_in: int, hidden: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, n_out)
    )


def output_layer(net: nn.Sequential) -> nn.Linear:
    """The last layer of an :func:`mlp` (for its initialisation)."""
    layer = net[-1]
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"the network ends in {type(layer).__name__}, not a linear layer")
    return layer


class Decider(nn.Module):
    """logit_j = head_j(trunk(obs)) + u . phi_j, with phi_j = (r_j, r_j - max_i r_i, rank of j) the per-model
    features of the observation (``model_features`` slice: [reliability M | gap M | rank M]), u shared by all models.

    The per-model path starts with weight 10 on the gap to the most reliable model, so an untrained Decider
    calls the models within about 0.1 of the best one; the trunk and heads learn the rest (diversity, cost).
    """

    GAP_WEIGHT = 10.0

    def __init__(self, obs_dim: int, n_models: int, hidden: int, model_features: slice):
        super().__init__()
        self.n_models, self.model_features = n_models, model_features
        self.trunk = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.heads = nn.Linear(hidden, n_models)  # one Bernoulli logit per model
        self.per_model = nn.Linear(3, 1, bias=False)  # shared across models
        with torch.no_grad():
            self.heads.weight.zero_()
            self.heads.bias.fill_(1.0)
            self.per_model.weight.copy_(torch.tensor([[0.0, self.GAP_WEIGHT, 0.0]]))

    def logits(self, obs: torch.Tensor) -> torch.Tensor:
        phi = obs[..., self.model_features].unflatten(-1, (3, self.n_models)).transpose(-1, -2)  # [..., M, 3]
        return self.heads(self.trunk(obs)) + self.per_model(phi).squeeze(-1)

    @staticmethod
    def never_empty(pools: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Replace every empty pool by the single model with the highest logit."""
        empty = pools.sum(-1) == 0
        if empty.any():
            fallback = F.one_hot(logits.argmax(-1), logits.shape[-1]).to(pools.dtype)
            pools = torch.where(empty[..., None], fallback, pools)
        return pools

    @staticmethod
    def log_prob(logits: torch.Tensor, pools: torch.Tensor) -> torch.Tensor:
        """Log-probability of each (never-empty) pool under the policy: the Bernoulli draws' probability, plus, for
        the single most likely model's pool, the probability of the empty draw that :meth:`never_empty` turns into it."""
        logp = -F.binary_cross_entropy_with_logits(logits, pools, reduction="none").sum(-1)
        empty_logp = F.logsigmoid(-logits).sum(-1)
        fallback = F.one_hot(logits.argmax(-1), logits.shape[-1]).to(pools.dtype)
        return torch.where((pools == fallback).all(-1), torch.logaddexp(logp, empty_logp), logp)

    def act(
        self, obs: torch.Tensor, greedy: bool, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(pools, log-probability of each pool); computed without Distribution objects (hot path)."""
        return self.sample(self.logits(obs), greedy, generator)

    def sample(
        self, logits: torch.Tensor, greedy: bool, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pools drawn from (or, greedy, the mode of) given logits, and their log-probabilities."""
        pools = (logits > 0).float() if greedy else torch.bernoulli(torch.sigmoid(logits), generator=generator)
        pools = self.never_empty(pools, logits)
        return pools, self.log_prob(logits, pools)


class Fusion(nn.Module):
    """score(c) = linear(x_c) + MLP(x_c), starting as a reliability-weighted log-linear pool of the chosen models.

    The linear path is initialised to weight 2 / M on each model's reliability-weighted masked log-probability
    (features ``reliability_weighted_log_probs``: r_i log p_i(c)), the MLP's output layer to zero, so an
    untrained agent answers like a geometric-mean vote that trusts reliable models more; learning refines it.
    """

    def __init__(self, feature_dim: int, hidden: int, reliability_weighted_log_probs: slice):
        super().__init__()
        self.linear = nn.Linear(feature_dim, 1)
        self.residual = mlp(feature_dim, hidden, 1)
        with torch.no_grad():
            self.linear.weight.zero_()
            self.linear.bias.zero_()
            n_models = len(range(feature_dim)[reliability_weighted_log_probs])
            self.linear.weight[0, reliability_weighted_log_probs] = 2.0 / n_models
            output_layer(self.residual).weight.zero_()
            output_layer(self.residual).bias.zero_()

    def scores(self, features: torch.Tensor, choice_mask: torch.Tensor) -> torch.Tensor:
        """features [..., C, F], choice_mask bool [..., C] -> scores [..., C] (-1e9 on invalid choices)."""
        return (self.linear(features) + self.residual(features)).squeeze(-1).masked_fill(~choice_mask, -1e9)

    def distribution(self, features: torch.Tensor, choice_mask: torch.Tensor) -> Categorical:
        return Categorical(logits=self.scores(features, choice_mask), validate_args=False)

    def act(
        self,
        features: torch.Tensor,
        choice_mask: torch.Tensor,
        explore: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(answers [B], their log-probabilities [B], the distributions [B, C]) for features [B, C, F]: a sample
        where ``explore`` (bool [B]) is set, the mode elsewhere; computed without Distribution objects (hot path)."""
        log_probs = torch.log_softmax(self.scores(features, choice_mask), -1)
        probs = log_probs.exp()
        answers = probs.argmax(-1)
        if explore.any():
            answers[explore] = torch.multinomial(probs[explore], 1, generator=generator).squeeze(-1)
        return answers, log_probs.gather(-1, answers.unsqueeze(-1)).squeeze(-1), probs


class CentralCritic(nn.Module):
    """values(state) -> [..., 2]: the Decider's value (from ``state[..., :decider_dim]``) and the Fusion agent's."""

    def __init__(self, decider_dim: int, state_dim: int, hidden: int):
        super().__init__()
        self.decider_dim = decider_dim
        self.decider_value = mlp(decider_dim, hidden, 1)
        self.fusion_value = mlp(state_dim, hidden, 1)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.decider_value(state[..., : self.decider_dim]), self.fusion_value(state)], -1)
