"""RL-Focal engine: Decider -> (call the chosen models) -> Fusion, plus feedback and MAPPO updates.

The engine holds the agents, the critic, the per-stream outcome windows and the experience buffer. It does no
I/O: callers (the replay harness, later the streaming worker and learner) call :meth:`FocalEngine.decide`,
call the models in ``Decision.called``, then :meth:`FocalEngine.fuse`, and report the outcome with
:meth:`FocalEngine.record` once feedback arrives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import numpy as np
import torch

from rlens.focal.agents import CentralCritic, Decider, Fusion
from rlens.focal.config import FocalConfig
from rlens.focal.features import decider_obs_dim, decider_observation, fusion_feature_dim, fusion_observation, log_prob_features
from rlens.focal.mappo import Transition, mappo_update
from rlens.focal.window import OutcomeWindow


@dataclass
class Decision:
    key: Hashable  # stream key (task) the query belongs to
    pool: np.ndarray  # bool [M]: models whose answers the Fusion agent uses
    called: np.ndarray  # bool [M]: models to call (the pool, plus the rest of it on a window-refresh probe)
    state: np.ndarray  # Decider observation (= critic state)
    pool_logp: float
    value: float


@dataclass
class Answer:
    answer: int  # index among the question's valid choices
    distribution: np.ndarray  # [C_valid]
    features: np.ndarray  # Fusion observation [C_valid, F]
    answer_logp: float


class FocalEngine:
    def __init__(self, n_models: int, model_costs: np.ndarray | None = None, config: FocalConfig | None = None, seed: int = 0):
        self.cfg = config or FocalConfig()
        self.n_models = n_models
        costs = np.ones(n_models) if model_costs is None else np.asarray(model_costs, dtype=np.float64)
        self.cost_share = costs / costs.sum()
        torch.manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.torch_rng = torch.Generator().manual_seed(seed)
        state_dim = decider_obs_dim(n_models, len(self.cfg.metrics))
        self.decider = Decider(state_dim, n_models, self.cfg.hidden)
        self.fusion = Fusion(fusion_feature_dim(n_models), self.cfg.hidden, log_prob_features(n_models))
        self.critic = CentralCritic(state_dim, self.cfg.hidden)
        params = [*self.decider.parameters(), *self.fusion.parameters(), *self.critic.parameters()]
        self.optimizer = torch.optim.Adam(params, lr=self.cfg.lr, eps=1e-5)
        self.windows: dict[Hashable, OutcomeWindow] = {}
        self.previous_pool: dict[Hashable, np.ndarray] = {}
        self.buffer: list[Transition] = []
        self.updates = 0

    # --- acting -----------------------------------------------------------------------------------------
    def window(self, key: Hashable) -> OutcomeWindow:
        if key not in self.windows:
            self.windows[key] = OutcomeWindow(self.n_models, self.cfg.window)
        return self.windows[key]

    def reset_windows(self) -> None:
        self.windows.clear()
        self.previous_pool.clear()

    @torch.inference_mode()
    def decide(self, key: Hashable, n_choices: int, greedy: bool, probe: bool = False) -> Decision:
        """Choose the pool for one query of stream ``key`` (before any model is called)."""
        previous = self.previous_pool.get(key, np.ones(self.n_models, dtype=bool))
        state = decider_observation(self.window(key), previous, n_choices, self.cfg.metrics, self.cfg.recent_rewards)
        obs = torch.from_numpy(state)
        value = float(self.critic(obs))
        if self.cfg.use_decider:
            pool_t, logp = self.decider.act(obs, greedy, self.torch_rng)
            pool, pool_logp = pool_t.numpy().astype(bool), float(logp)
        else:
            pool, pool_logp = np.ones(self.n_models, dtype=bool), 0.0
        self.previous_pool[key] = pool
        called = np.ones(self.n_models, dtype=bool) if probe else pool
        return Decision(key, pool, called, state, pool_logp, value)

    @torch.inference_mode()
    def fuse(self, decision: Decision, probs: np.ndarray, greedy: bool) -> Answer:
        """Answer distribution over the valid choices from the pool's distributions ``probs`` [M, C_valid]."""
        window = self.window(decision.key)
        features = fusion_observation(probs * decision.pool[:, None], decision.pool, window.reliability(), window.label_prior(probs.shape[1]))
        mask = torch.ones(probs.shape[1], dtype=torch.bool)
        answer, logp, dist = self.fusion.act(torch.from_numpy(features), mask, greedy, self.torch_rng)
        return Answer(int(answer), dist.numpy().copy(), features, float(logp))

    def reward(self, pool: np.ndarray, correct: bool) -> float:
        """+1 / -1 for the final answer minus alpha times the pool's share of the whole pool's cost."""
        return (1.0 if correct else -1.0) - self.cfg.alpha * float(self.cost_share[pool].sum())

    # --- feedback and learning ----------------------------------------------------------------------------
    def record(self, decision: Decision, answer: Answer | None, predictions: np.ndarray, label: int, reward: float, learn: bool = True) -> None:
        """Feedback for one query: update its stream's window and keep the transition for the next update.

        ``predictions`` int [M] holds each called model's chosen choice and -1 for models not called;
        ``label`` is -1 when the feedback is a bare reward.
        """
        self.window(decision.key).push(predictions, label, reward)
        if learn:
            self.buffer.append(
                Transition(
                    state=decision.state,
                    pool=decision.pool.astype(np.float32),
                    pool_logp=decision.pool_logp,
                    value=decision.value,
                    reward=reward,
                    fusion_features=None if answer is None else answer.features,
                    answer=-1 if answer is None else answer.answer,
                    answer_logp=0.0 if answer is None else answer.answer_logp,
                )
            )

    def update(self, train_decider: bool = True, train_fusion: bool = True) -> dict[str, float]:
        """One MAPPO update on the buffered transitions (bootstrapped with the last state's value), then clear them."""
        if not self.buffer:
            return {}
        next_value = self.buffer[-1].value
        stats = mappo_update(
            self.decider,
            self.fusion,
            self.critic,
            self.optimizer,
            self.buffer,
            next_value,
            self.cfg,
            train_decider=train_decider and self.cfg.use_decider,
            train_fusion=train_fusion,
            generator=self.torch_rng,
        )
        self.buffer = []
        self.updates += 1
        return stats

    # --- checkpoints ----------------------------------------------------------------------------------------
    def policy_state(self) -> dict[str, torch.Tensor]:
        """Flat tensor dict of every network's weights (safetensors-compatible keys)."""
        state = {}
        for name, module in (("decider", self.decider), ("fusion", self.fusion), ("critic", self.critic)):
            state.update({f"{name}.{k}": v.detach().clone() for k, v in module.state_dict().items()})
        return state

    def load_policy_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, module in (("decider", self.decider), ("fusion", self.fusion), ("critic", self.critic)):
            prefix = f"{name}."
            module.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
