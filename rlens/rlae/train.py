"""RLAE training, read top to bottom (CleanRL style): the agent acting in the decoder, rollouts, the training loop.

Each iteration decodes a batch of training prompts with the token ensemble while the agent sets the weights at
every span start (sampled actions; tokens are picked greedily from the mixture), scores each output by exact match
with its reference, and keeps the episode's spans with the reward on the last one. Every ``episodes_per_update``
episodes one PPO / MAPPO update runs and a checkpoint is written (policy, Adam state, RNG states, progress), so an
interrupted run resumes after its last update with the same result as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from rlens.checkpoint import CheckpointStore, load_optimizer, optimizer_tensors
from rlens.rlae.agent import Policy, RLAEConfig, Span, make_policy, update
from rlens.rlae.decode import EnsembleOutput, SpanView, SpanWeightedDecoder
from rlens.rlae.observe import SentenceEncoder, obs_dim, observation
from rlens.zoo.tasks import GenerationTask, exact_match

STOP = ["\n"]  # the zoo's answers are one line


class RLAEAgent:
    """The policy and the frozen sentence encoder: turns each :class:`SpanView` into [B, M] weights."""

    def __init__(self, policy: Policy, encoder: SentenceEncoder, cfg: RLAEConfig, n_models: int):
        self.policy, self.encoder, self.cfg, self.n_models = policy, encoder, cfg, n_models

    def weights_fn(
        self,
        prompts: list[str],
        greedy: bool,
        generator: torch.Generator | None = None,
        record: list[list[Span]] | None = None,
    ) -> Callable[[SpanView], np.ndarray]:
        """The decoder's weights callback for one batch; each active row's decision is appended to ``record[row]``."""
        prompt_embeddings: list[np.ndarray] = []  # "prompt" observations: every prompt's embedding, once

        def weights(view: SpanView) -> np.ndarray:
            out = np.full((len(prompts), self.n_models), 1.0 / self.n_models)
            rows = np.flatnonzero(view.active)
            if self.cfg.observe == "text":
                embeddings = self.encoder.encode([prompts[i] + view.texts[i] for i in rows])
            else:
                if not prompt_embeddings:
                    prompt_embeddings.append(self.encoder.encode(prompts))
                embeddings = prompt_embeddings[0][rows]
            obs = observation(embeddings, view.index, view.entropy[rows], view.agreement[rows], self.cfg.max_spans)
            with torch.no_grad():
                action, logp, value = self.policy.act(torch.from_numpy(obs), greedy=greedy, generator=generator)
            out[rows] = self.policy.weights(action).double().numpy()
            if record is not None:
                for k, i in enumerate(rows):
                    record[i].append(Span(obs[k], action[k].numpy(), float(logp[k]), float(value[k])))
            return out

        return weights

    def decode(
        self,
        decoder: SpanWeightedDecoder,
        prompts: list[str],
        greedy: bool,
        generator: torch.Generator | None = None,
        stop: list[str] = STOP,
    ) -> tuple[list[EnsembleOutput], list[list[Span]]]:
        """A batch decoded under this agent's weights, its span and token budget: each prompt's output and the span
        decisions it took (what training, evaluation and the workers run)."""
        record: list[list[Span]] = [[] for _ in prompts]
        weights = self.weights_fn(prompts, greedy, generator, record)
        cfg = self.cfg
        return decoder.generate_batch(prompts, weights, max_tokens=cfg.max_tokens, span=cfg.span, stop=stop), record


def rollout(
    ensemble: SpanWeightedDecoder,
    agent: RLAEAgent,
    tasks: list[GenerationTask],
    greedy: bool,
    generator: torch.Generator | None = None,
) -> tuple[list[EnsembleOutput], list[list[Span]], np.ndarray]:
    """Decode ``tasks`` with the agent's weights; (outputs, each episode's spans with its reward, rewards)."""
    outputs, record = agent.decode(ensemble, [t.prompt for t in tasks], greedy, generator)
    rewards = np.array([float(exact_match(o.text, t.reference)) for o, t in zip(outputs, tasks)])
    for spans, reward in zip(record, rewards):
        spans[-1].reward, spans[-1].last = float(reward), True
    return outputs, record, rewards


@dataclass
class TrainState:
    episodes: int = 0
    updates: int = 0
    # (episodes so far, mean reward of the update's episodes)
    curve: list[tuple[int, float]] = field(default_factory=list)


class RLAETrainer:
    """Offline training on prompts + references, checkpointed under ``out_dir``; resumes from its latest checkpoint."""

    def __init__(
        self,
        ensemble: SpanWeightedDecoder,
        encoder: SentenceEncoder,
        model_names: list[str],
        cfg: RLAEConfig,
        out_dir: Path,
        seed: int = 0,
    ):
        self.ensemble, self.model_names, self.cfg, self.seed = ensemble, model_names, cfg, seed
        self.policy = make_policy(obs_dim(len(model_names)), len(model_names), cfg, seed)
        self.agent = RLAEAgent(self.policy, encoder, cfg, len(model_names))
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=cfg.lr, eps=1e-5)
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.state = TrainState()
        self.store = CheckpointStore(Path(out_dir), keep=2)
        restored = self.store.load_latest()
        if restored is not None:
            try:
                self._restore(*restored)
            except ValueError:
                self.store.close()  # not our run: leave the directory to whoever owns it
                raise

    def _restore(self, tensors: dict[str, dict[str, torch.Tensor]], state: dict) -> None:
        # a run may be extended to more episodes
        settings = {
            **asdict(self.cfg),
            "episodes": state["config"]["episodes"],
        }
        if state["models"] != self.model_names or state["config"] != settings or state["seed"] != self.seed:
            raise ValueError(
                f"{self.store.directory} holds a run with other models, settings or seed; pick another output directory"
            )
        self.policy.load_state_dict(tensors["policy"])
        load_optimizer(self.optimizer, tensors["optimizer"], state["optimizer"])
        self.generator.set_state(tensors["optimizer"]["rng.torch"])
        self.rng.bit_generator.state = state["rng_numpy"]
        self.state = TrainState(state["episodes"], state["updates"], [tuple(p) for p in state["curve"]])

    def checkpoint(self) -> Path:
        adam, meta = optimizer_tensors(self.optimizer)
        payload = {
            "models": self.model_names,
            "config": asdict(self.cfg),
            "seed": self.seed,
            "optimizer": meta,
            "rng_numpy": self.rng.bit_generator.state,
            **asdict(self.state),
        }
        return self.store.save(
            self.state.updates,
            {"policy": self.policy.state_dict(), "optimizer": {**adam, "rng.torch": self.generator.get_state()}},
            payload,
        )

    def run(
        self, tasks: list[GenerationTask], progress: Callable[[int, float], None] = lambda n, reward: None
    ) -> TrainState:
        """Train until ``cfg.episodes`` episodes; ``progress(new_episodes, mean_reward_of_the_last_update)``."""
        cfg = self.cfg
        if not tasks:
            raise ValueError("training needs at least one task")
        progress(self.state.episodes, self.state.curve[-1][1] if self.state.curve else 0.0)
        while self.state.episodes < cfg.episodes:
            spans: list[Span] = []
            rewards: list[float] = []
            while len(rewards) < cfg.episodes_per_update:
                batch = [
                    tasks[i]
                    for i in self.rng.choice(
                        len(tasks), size=min(cfg.rollout_batch, cfg.episodes_per_update - len(rewards))
                    )
                ]
                _, record, batch_rewards = rollout(
                    self.ensemble, self.agent, batch, greedy=False, generator=self.generator
                )
                spans += [s for episode in record for s in episode]
                rewards += batch_rewards.tolist()
            update(self.policy, self.optimizer, spans, cfg, self.generator)
            self.state.episodes += len(rewards)
            self.state.updates += 1
            self.state.curve.append((self.state.episodes, float(np.mean(rewards))))
            self.checkpoint()
            progress(len(rewards), self.state.curve[-1][1])
        return self.state


def load_agent(run_dir: Path, encoder: SentenceEncoder) -> tuple[RLAEAgent, list[str], dict]:
    """The trained agent of a ``rlens rlae train`` run (its latest checkpoint), its model names and its state."""
    restored = CheckpointStore(Path(run_dir), lock=False).load_latest()
    if restored is None:
        raise FileNotFoundError(
            f"{run_dir} holds no RLAE checkpoint: train one with `rlens rlae train --out {run_dir}`"
        )
    tensors, state = restored
    cfg = RLAEConfig(**{"observe": "text", **state["config"]})  # runs saved before `observe` existed embedded the text
    policy = make_policy(obs_dim(len(state["models"])), len(state["models"]), cfg, state["seed"])
    policy.load_state_dict(tensors["policy"])
    return RLAEAgent(policy.eval(), encoder, cfg, len(state["models"])), state["models"], state
