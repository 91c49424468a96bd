"""MAPPO for the two RL-Focal agents: shared GAE advantage from the centralized critic, clipped surrogates.

Read top to bottom: :class:`Transition` (one answered query), :func:`gae`, :func:`mappo_update`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from rlens.focal.agents import CentralCritic, Decider, Fusion
from rlens.focal.config import FocalConfig


@dataclass
class Transition:
    """What the learner needs from one answered query."""

    state: np.ndarray  # Decider observation [S]
    critic_state: np.ndarray  # centralized critic's input
    pool: np.ndarray  # Decider action, float [M]
    pool_logp: float
    reward: float
    fusion_features: np.ndarray | None = None  # [C, F]; None when the Fusion agent did not act
    answer: int = -1
    answer_logp: float = 0.0


def gae(rewards: np.ndarray, values: np.ndarray, next_value: np.ndarray, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation, arrays [steps, envs] (``next_value`` [envs]); returns (advantages, returns)."""
    advantages = np.zeros_like(rewards, dtype=np.float32)
    last = np.zeros(rewards.shape[1], dtype=np.float32)
    for t in reversed(range(len(rewards))):
        following = next_value if t == len(rewards) - 1 else values[t + 1]
        delta = rewards[t] + gamma * following - values[t]
        last = delta + gamma * lam * last
        advantages[t] = last
    return advantages, advantages + values


def _pad_fusion(batch: list[Transition]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack per-choice features of different choice counts into [B, Cmax, F] plus a validity mask."""
    c_max = max(t.fusion_features.shape[0] for t in batch)
    feature_dim = batch[0].fusion_features.shape[1]
    features = np.zeros((len(batch), c_max, feature_dim), dtype=np.float32)
    mask = np.zeros((len(batch), c_max), dtype=bool)
    for i, t in enumerate(batch):
        c = t.fusion_features.shape[0]
        features[i, :c], mask[i, :c] = t.fusion_features, True
    return torch.from_numpy(features), torch.from_numpy(mask)


def mappo_update(
    decider: Decider,
    fusion: Fusion,
    critic: CentralCritic,
    optimizer: torch.optim.Optimizer,
    batch: list[Transition],
    envs: int,
    cfg: FocalConfig,
    train_decider: bool,
    train_fusion: bool,
    generator: torch.Generator,
) -> dict[str, float]:
    """Several epochs of minibatch PPO on ``batch`` for the selected agents and the critic.

    ``batch`` is step-major over ``envs`` parallel environments (transition i belongs to environment i % envs);
    each environment's last value bootstraps its GAE. Values come from the critic as it is now, which is the
    critic that was current when the batch was collected (it only changes here).
    """
    if len(batch) % envs:
        raise ValueError(f"{len(batch)} transitions do not split into {envs} environments")
    states = torch.from_numpy(np.stack([t.state for t in batch]))
    critic_states = torch.from_numpy(np.stack([t.critic_state for t in batch]))
    with torch.no_grad():
        values = critic(critic_states).numpy().reshape(-1, envs)
    rewards = np.array([t.reward for t in batch], dtype=np.float32).reshape(-1, envs)
    advantages, returns = gae(rewards, values, values[-1], cfg.gamma, cfg.gae_lambda)
    advantages, returns = advantages.reshape(-1), returns.reshape(-1)
    pools = torch.from_numpy(np.stack([t.pool for t in batch]).astype(np.float32))
    old_pool_logp = torch.tensor([t.pool_logp for t in batch])
    adv_all, ret_all = torch.from_numpy(advantages), torch.from_numpy(returns)
    if train_fusion:
        features, choice_mask = _pad_fusion(batch)
        answers = torch.tensor([t.answer for t in batch])
        old_answer_logp = torch.tensor([t.answer_logp for t in batch])

    def clipped_surrogate(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        ratio = (logp - old).exp()
        return torch.max(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip, 1 + cfg.clip)).mean()

    networks = [decider, fusion, critic]
    stats = {"policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0}  # the sums over the agents, and each trained agent's own
    n_steps = 0
    for _ in range(cfg.update_epochs):
        order = torch.randperm(len(batch), generator=generator)
        for start in range(0, len(batch), cfg.minibatch_size):
            mb = order[start : start + cfg.minibatch_size]
            adv = adv_all[mb]
            if len(mb) > 1:
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            policy_loss = torch.zeros(())
            entropy = torch.zeros(())
            per_agent = {}
            if train_decider:
                dist = decider.distribution(states[mb])
                per_agent["decider"] = (clipped_surrogate(dist.log_prob(pools[mb]).sum(-1), old_pool_logp[mb], adv), dist.entropy().sum(-1).mean())
            if train_fusion:
                dist = fusion.distribution(features[mb], choice_mask[mb])
                per_agent["fusion"] = (clipped_surrogate(dist.log_prob(answers[mb]), old_answer_logp[mb], adv), dist.entropy().mean())
            for agent, (agent_loss, agent_entropy) in per_agent.items():
                policy_loss = policy_loss + agent_loss
                entropy = entropy + agent_entropy
                stats[f"{agent}_policy_loss"] = stats.get(f"{agent}_policy_loss", 0.0) + float(agent_loss.detach())
                stats[f"{agent}_entropy"] = stats.get(f"{agent}_entropy", 0.0) + float(agent_entropy.detach())
            value_loss = 0.5 * (critic(critic_states[mb]) - ret_all[mb]).pow(2).mean()
            loss = policy_loss - cfg.ent_coef * entropy + cfg.vf_coef * value_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for network in networks:  # each network's gradient is clipped on its own (the critic's is the largest)
                nn.utils.clip_grad_norm_(network.parameters(), cfg.max_grad_norm)
            optimizer.step()
            stats["policy_loss"] += float(policy_loss.detach())
            stats["value_loss"] += float(value_loss.detach())
            stats["entropy"] += float(entropy.detach())
            n_steps += 1
    return {k: v / max(n_steps, 1) for k, v in stats.items()}
