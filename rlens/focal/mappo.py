"""MAPPO for the two RL-Focal agents: each agent's GAE advantage of its own reward from its head of the
centralized critic, clipped surrogates on the transitions whose actions were sampled.

Read top to bottom: :class:`Transition` (one answered query), :func:`gae`, :func:`mappo_update`.

On-policy: a transition is ``explored`` when both agents sampled their actions from their policies (the warm start,
and online the exploration share); its logged log-probabilities are those of the actions taken, so the PPO ratio is
exact. Greedy online transitions (the mode, not a sample) train only the critic: a state's value is a baseline
whatever policy reached it, but a greedy action has no sampling probability to weigh a policy gradient with.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.distributions import Bernoulli

from rlens.focal.agents import CentralCritic, Decider, Fusion
from rlens.focal.config import FocalConfig
from rlens.focal.features import padded_choices


@dataclass
class Transition:
    """What the learner needs from one answered query."""

    state: np.ndarray  # Decider observation [S]
    critic_state: np.ndarray  # centralized critic's input (Decider observation + the fused pool's answers)
    pool: np.ndarray  # Decider action, float [M]
    pool_logp: float
    reward: float  # the Decider's: +-1 for the final answer minus the pool's cost
    fusion_reward: float  # the Fusion agent's: +-1 for its answer (no cost: it does not choose the pool)
    explored: bool = True  # both actions were sampled from the policies (False: greedy, trains only the critic)
    fusion_features: np.ndarray | None = None  # [C, F]; None when the Fusion agent did not act
    answer: int = -1
    answer_logp: float = 0.0
    label: int = -1  # the correct choice when the feedback gave it (-1: a bare reward)


def gae(
    rewards: np.ndarray, values: np.ndarray, next_value: np.ndarray, gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
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
    """Stack per-choice features of different choice counts into [B, Cmax, F] plus a validity mask (every transition
    of a batch the Fusion agent trains on has acted: a warm-start pass either runs the Fusion agent or does not)."""
    rows = [t.fusion_features for t in batch if t.fusion_features is not None]
    if len(rows) < len(batch):
        raise ValueError("a transition in the Fusion agent's batch has no features: the Fusion agent did not act on it")
    features, mask = padded_choices(rows)
    return torch.from_numpy(features), torch.from_numpy(mask)


def _normalised(adv: torch.Tensor) -> torch.Tensor:
    return (adv - adv.mean()) / (adv.std() + 1e-8) if len(adv) > 1 else adv


def _returns_and_advantages(
    critic: CentralCritic, critic_states: torch.Tensor, batch: list[Transition], envs: int, cfg: FocalConfig
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Each critic head's GAE returns [N, 2] and advantages (head 0: the Decider's rewards, 1: the Fusion's), from
    the critic's values now; each environment's last value bootstraps its GAE."""
    with torch.no_grad():
        values = critic(critic_states).numpy()  # [N, 2]
    returns_of, advantages_of = {}, {}
    for head, rewards in ((0, [t.reward for t in batch]), (1, [t.fusion_reward for t in batch])):
        v = values[:, head].reshape(-1, envs)
        adv, ret = gae(np.array(rewards, dtype=np.float32).reshape(-1, envs), v, v[-1], cfg.gamma, cfg.gae_lambda)
        advantages_of[head], returns_of[head] = torch.from_numpy(adv.reshape(-1)), torch.from_numpy(ret.reshape(-1))
    return torch.stack([returns_of[0], returns_of[1]], -1), advantages_of


def _clipped_surrogate(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, clip: float) -> torch.Tensor:
    """PPO's clipped policy loss."""
    ratio = (logp - old).exp()
    return torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)).mean()


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
    critic that was current when the batch was collected (it only changes here). The policy losses use the
    explored transitions (the Fusion's, those where it acted); each critic head learns its agent's returns.
    """
    if len(batch) % envs:
        raise ValueError(f"{len(batch)} transitions do not split into {envs} environments")
    states = torch.from_numpy(np.stack([t.state for t in batch]))
    critic_states = torch.from_numpy(np.stack([t.critic_state for t in batch]))
    returns, advantages_of = _returns_and_advantages(critic, critic_states, batch, envs, cfg)
    explored = torch.tensor([t.explored for t in batch])
    acted = torch.tensor([t.fusion_features is not None for t in batch])
    pools = torch.from_numpy(np.stack([t.pool for t in batch]).astype(np.float32))
    old_pool_logp = torch.tensor([t.pool_logp for t in batch])
    labelled = torch.tensor([t.label >= 0 for t in batch]) & acted
    supervise = train_fusion and cfg.label_coef > 0 and bool(labelled.any())
    train_fusion = train_fusion and bool((acted & explored).any())
    if train_fusion or supervise:
        features, choice_mask = _pad_fusion(batch)
        answers = torch.tensor([max(t.answer, 0) for t in batch])
        labels = torch.tensor([max(t.label, 0) for t in batch])
        old_answer_logp = torch.tensor([t.answer_logp for t in batch])

    networks = [decider, fusion, critic]
    # the sums over the agents, and each trained agent's own
    stats = {"policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0}
    surrogate = functools.partial(_clipped_surrogate, clip=cfg.clip)
    n_steps = 0
    for _ in range(cfg.update_epochs):
        order = torch.randperm(len(batch), generator=generator)
        for start in range(0, len(batch), cfg.minibatch_size):
            mb = order[start : start + cfg.minibatch_size]
            per_agent = {}
            if train_decider and (mb_d := mb[explored[mb]]).numel():
                logits = decider.logits(states[mb_d])
                # of the draws: a regulariser
                entropy_d = Bernoulli(logits=logits, validate_args=False).entropy().sum(-1).mean()
                per_agent["decider"] = (
                    surrogate(
                        decider.log_prob(logits, pools[mb_d]), old_pool_logp[mb_d], _normalised(advantages_of[0][mb_d])
                    ),
                    entropy_d,
                )
            if train_fusion and (mb_f := mb[explored[mb] & acted[mb]]).numel():
                dist = fusion.distribution(features[mb_f], choice_mask[mb_f])
                per_agent["fusion"] = (
                    surrogate(dist.log_prob(answers[mb_f]), old_answer_logp[mb_f], _normalised(advantages_of[1][mb_f])),
                    dist.entropy().mean(),
                )
            # off-policy-safe: a label is right whatever was answered
            if supervise and (mb_l := mb[labelled[mb]]).numel():
                label_loss = nn.functional.cross_entropy(fusion.scores(features[mb_l], choice_mask[mb_l]), labels[mb_l])
                stats["label_loss"] = stats.get("label_loss", 0.0) + float(label_loss.detach())
            else:
                label_loss = torch.zeros(())
            policy_loss = torch.zeros(())
            entropy = torch.zeros(())
            for agent, (agent_loss, agent_entropy) in per_agent.items():
                policy_loss = policy_loss + agent_loss
                entropy = entropy + agent_entropy
                stats[f"{agent}_policy_loss"] = stats.get(f"{agent}_policy_loss", 0.0) + float(agent_loss.detach())
                stats[f"{agent}_entropy"] = stats.get(f"{agent}_entropy", 0.0) + float(agent_entropy.detach())
            predicted = critic(critic_states[mb])
            value_loss = 0.5 * (predicted[:, 0] - returns[mb, 0]).pow(2).mean()
            if acted[mb].any():
                value_loss = value_loss + 0.5 * (predicted[acted[mb], 1] - returns[mb, 1][acted[mb]]).pow(2).mean()
            loss = policy_loss - cfg.ent_coef * entropy + cfg.vf_coef * value_loss + cfg.label_coef * label_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for network in networks:  # each network's gradient is clipped on its own (the critic's is the largest)
                nn.utils.clip_grad_norm_(network.parameters(), cfg.max_grad_norm, foreach=True)
            optimizer.step()
            stats["policy_loss"] += float(policy_loss.detach())
            stats["value_loss"] += float(value_loss.detach())
            stats["entropy"] += float(entropy.detach())
            n_steps += 1
    return {**{k: v / max(n_steps, 1) for k, v in stats.items()}, "explored_share": float(explored.float().mean())}
