"""The RLAE agents that set the ensemble weights span by span, and their PPO / MAPPO update (pure torch).

Read top to bottom, CleanRL style: :class:`RLAEConfig` (every hyper-parameter), the two policies, :class:`Span`
(one decision), :func:`gae_over_spans`, :func:`update`.

- ``ppo``: one agent. A Dirichlet over the M weights (concentrations from an MLP), and a critic.
- ``mappo``: one agent per model, each emitting its own weight logit (a Gaussian around its network's mean) from
  the shared observation; the weights are the softmax of the logits (jointly normalised), and a centralized critic
  values the joint observation. The joint log-probability is the sum over the agents.

An episode is one generation; its reward (the final output's quality) arrives after the last span, so GAE runs
over the spans of each episode with the value bootstrapped at 0 after the last one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn
from torch.distributions import Dirichlet, Normal

from rlens.focal.agents import mlp, output_layer


@dataclass(frozen=True)
class RLAEConfig:
    variant: Literal["ppo", "mappo"] = "ppo"
    span: int = 8  # tokens per span: the weights change every span
    max_tokens: int = 16  # generated tokens per episode at most (union tokens)
    episodes: int = 6144  # training episodes (one generation each)
    rollout_batch: int = 32  # generations decoded together
    episodes_per_update: int = 128  # whole episodes gathered before each PPO update
    hidden: int = 128
    gamma: float = 1.0  # episodic: the only reward is the final one
    gae_lambda: float = 0.95
    clip: float = 0.2
    lr: float = 1e-3
    update_epochs: int = 4
    minibatch_size: int = 64
    ent_coef: float = 0.001
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    min_concentration: float = 0.05  # ppo: Dirichlet concentrations stay above this
    init_log_std: float = -0.5  # mappo: the agents' exploration noise on their logits, at the start
    observe: Literal["prompt", "text"] = (
        "prompt"  # what MiniLM embeds: the prompt once per generation, or prompt + text at every span
    )

    @property
    def max_spans(self) -> int:
        return -(-self.max_tokens // self.span)


class DirichletPolicy(nn.Module):
    """``ppo``: the action is the weight vector itself, drawn from a Dirichlet."""

    def __init__(self, obs_dim: int, n_models: int, cfg: RLAEConfig):
        super().__init__()
        self.actor, self.critic, self.floor = (
            mlp(obs_dim, cfg.hidden, n_models),
            mlp(obs_dim, cfg.hidden, 1),
            cfg.min_concentration,
        )
        with torch.no_grad():  # start near uniform weights with moderate spread (concentration about 2 each)
            output_layer(self.actor).weight.mul_(0.01)
            output_layer(self.actor).bias.fill_(2.0)

    def distribution(self, obs: torch.Tensor) -> Dirichlet:
        return Dirichlet(nn.functional.softplus(self.actor(obs)) + self.floor)

    def act(
        self, obs: torch.Tensor, greedy: bool = False, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(action, its log-probability, value); the weights are the action. Greedy: the Dirichlet's mean."""
        dist = self.distribution(obs)
        if greedy:
            action = dist.mean
        else:
            with torch.random.fork_rng(devices=[]):  # torch's Dirichlet sampler reads the global RNG: seed it from ours
                torch.manual_seed(
                    int(torch.randint(1 << 62, (1,), generator=generator)) if generator is not None else torch.seed()
                )
                action = dist.sample().clamp_min(1e-6)
            action = action / action.sum(-1, keepdim=True)
        return action, dist.log_prob(action), self.critic(obs).squeeze(-1)

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dist = self.distribution(obs)
        return dist.log_prob(action), dist.entropy(), self.critic(obs).squeeze(-1)

    @staticmethod
    def weights(action: torch.Tensor) -> torch.Tensor:
        return action


class MultiAgentPolicy(nn.Module):
    """``mappo``: agent i emits logit_i ~ Normal(actor_i(obs), sigma_i); the action is the logits."""

    def __init__(self, obs_dim: int, n_models: int, cfg: RLAEConfig):
        super().__init__()
        actors = [mlp(obs_dim, cfg.hidden, 1) for _ in range(n_models)]
        self.actors = nn.ModuleList(actors)
        self.log_std = nn.Parameter(torch.full((n_models,), cfg.init_log_std))
        self.critic = mlp(obs_dim, cfg.hidden, 1)  # centralized: sees the joint observation
        with torch.no_grad():
            for actor in actors:
                output_layer(actor).weight.mul_(0.01)
                output_layer(actor).bias.zero_()

    def distribution(self, obs: torch.Tensor) -> Normal:
        return Normal(torch.cat([actor(obs) for actor in self.actors], -1), self.log_std.exp())

    def act(
        self, obs: torch.Tensor, greedy: bool = False, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dist = self.distribution(obs)
        noise = torch.randn(dist.mean.shape, generator=generator)
        action = dist.mean if greedy else dist.mean + dist.stddev * noise
        return action, dist.log_prob(action).sum(-1), self.critic(obs).squeeze(-1)

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dist = self.distribution(obs)
        return dist.log_prob(action).sum(-1), dist.entropy().sum(-1), self.critic(obs).squeeze(-1)

    @staticmethod
    def weights(action: torch.Tensor) -> torch.Tensor:
        return torch.softmax(action, -1)


Policy = DirichletPolicy | MultiAgentPolicy


def make_policy(obs_dim: int, n_models: int, cfg: RLAEConfig, seed: int = 0) -> Policy:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return (DirichletPolicy if cfg.variant == "ppo" else MultiAgentPolicy)(obs_dim, n_models, cfg)


@dataclass
class Span:
    """One weighting decision: the observation at the span's start, the action, and what followed."""

    obs: np.ndarray
    action: np.ndarray
    logp: float
    value: float
    reward: float = 0.0  # the episode's reward on its last span, 0 before
    last: bool = False  # the episode's last span


def gae_over_spans(
    rewards: np.ndarray, values: np.ndarray, last: np.ndarray, gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """GAE over consecutive spans of whole episodes (``last`` marks each episode's end, bootstrapped at 0)."""
    advantages = np.zeros_like(rewards, dtype=np.float32)
    running = 0.0
    for t in reversed(range(len(rewards))):
        following = 0.0 if last[t] else values[t + 1]
        if last[t]:
            running = 0.0
        delta = rewards[t] + gamma * following - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages, advantages + values


def update(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    spans: list[Span],
    cfg: RLAEConfig,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """PPO (clipped surrogate, value loss, entropy bonus, minibatch epochs) on whole episodes of spans."""
    if not spans or not spans[-1].last:
        raise ValueError("update needs whole episodes: the last span must end an episode")
    obs = torch.from_numpy(np.stack([s.obs for s in spans]).astype(np.float32))
    actions = torch.from_numpy(np.stack([s.action for s in spans]).astype(np.float32))
    old_logp = torch.tensor([s.logp for s in spans])
    values = np.array([s.value for s in spans], dtype=np.float32)
    advantages, returns = gae_over_spans(
        np.array([s.reward for s in spans], np.float32),
        values,
        np.array([s.last for s in spans]),
        cfg.gamma,
        cfg.gae_lambda,
    )
    advantages_t, returns_t = torch.from_numpy(advantages), torch.from_numpy(returns)
    stats = {"policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0}
    n = len(spans)
    for _ in range(cfg.update_epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, cfg.minibatch_size):
            idx = order[start : start + cfg.minibatch_size]
            logp, entropy, value = policy.evaluate(obs[idx], actions[idx])
            adv = advantages_t[idx]
            if len(idx) > 1:
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            ratio = (logp - old_logp[idx]).exp()
            policy_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip, 1 + cfg.clip)).mean()
            value_loss = 0.5 * (value - returns_t[idx]).pow(2).mean()
            loss = policy_loss + cfg.vf_coef * value_loss - cfg.ent_coef * entropy.mean()
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            optimizer.step()
            stats = {
                "policy_loss": policy_loss.item(),
                "value_loss": value_loss.item(),
                "entropy": entropy.mean().item(),
            }
    return stats
