"""What the learner trains, per strategy: one small interface, :class:`OnlineTrainer`, and its two implementations.

The learner (:mod:`rlens.service.learner.core`) joins an experience with its feedback and hands the pair over:
:meth:`~OnlineTrainer.check` says whether an experience fits the pool (its shapes and ranges; one that does not
is dead-lettered before it is held), :meth:`~OnlineTrainer.reward` turns the feedback into a reward (or says why it
cannot), :meth:`~OnlineTrainer.window_row`
gives the outcome for the stream's Redis window (RL-Focal only), :meth:`~OnlineTrainer.remember` buffers the
transition, and when :meth:`~OnlineTrainer.update_due`, :meth:`~OnlineTrainer.update` runs one PPO update. The
trainer saves and restores itself in the learner's checkpoints and gives the tensors a policy message carries;
:meth:`~OnlineTrainer.snapshot` / :meth:`~OnlineTrainer.restore` let the learner undo an update whose weights are
not finite.

- :class:`FocalOnlineTrainer` (``rl_focal``): the FocalEngine's MAPPO on Decider + Fusion transitions.
- :class:`RLAEOnlineTrainer` (``rlae``): PPO / MAPPO on the RLAE agent's span decisions, with a per-stream
  rehearsal of earlier episodes against forgetting across task switches; the reward of a generation is the
  feedback's ``reward``, else exact match with its ``reference``.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import asdict, replace
from pathlib import Path
from typing import Generic, TypeVar

import numpy as np
import torch

from rlens.checkpoint import CheckpointStore, load_optimizer, optimizer_tensors
from rlens.focal.calibration import significant
from rlens.focal.features import LOG_FLOOR
from rlens.focal.engine import Answer as EngineAnswer
from rlens.focal.engine import Decision, FocalEngine
from rlens.focal.features import critic_state_dim, decider_obs_dim, fusion_feature_dim
from rlens.messages import MAX_CHOICES, Experience, Feedback, RLAEExperience
from rlens.records.answers import Extractor, label_of
from rlens.rlae.agent import Policy, RLAEConfig, Span, update
from rlens.rlae.observe import obs_dim
from rlens.service.common.windows import CalibrationRows
from rlens.focal.checkpoint import Groups, load_engine, save_engine
from rlens.zoo.tasks import exact_match


class FeedbackError(ValueError):
    """Feedback that cannot train on its experience (it goes to the dead-letter topic with this reason)."""


E = TypeVar("E", Experience, RLAEExperience)  # the experience message a trainer learns from


class OnlineTrainer(ABC, Generic[E]):
    strategy: str
    experience: type[E]  # the experience message this trainer learns from
    optimizer: torch.optim.Optimizer

    @abstractmethod
    def check(self, experience: E) -> str | None:
        """Why ``experience`` cannot be trained on with this pool (wrong sizes, values out of range), or None."""

    @abstractmethod
    def reward(self, experience: E, feedback: Feedback) -> float:
        """The transition's reward; :class:`FeedbackError` when the feedback does not fit the experience."""

    def window_row(self, experience: E, feedback: Feedback) -> tuple[list[int], int] | None:
        """(per-model predictions, label) for the stream's Redis window, or None when the strategy keeps none."""
        return None

    def calibration_rows(self, experience: E, label: int) -> CalibrationRows | None:
        """The called models' rows for the stream's calibrations (:mod:`rlens.focal.calibration`), or None."""
        return None

    @abstractmethod
    def confidence(self, experience: E) -> float:
        """A label-free signal of the answer (drift detection before any feedback), in [0, 1] where possible."""

    @abstractmethod
    def composition(self, experience: E) -> list[float]:
        """Per model, its part in the answer: in the Decider's pool (1) or not (rl_focal), its mean weight (rlae)."""

    @abstractmethod
    def remember(self, experience: E, feedback: Feedback, reward: float) -> None:
        """Buffer the transition of a joined pair (``reward``: :meth:`reward` of it)."""

    @abstractmethod
    def update_due(self) -> bool: ...

    @abstractmethod
    def clear(self) -> None:
        """Drop the buffered transitions (after an update that was undone)."""

    @abstractmethod
    def update(self) -> dict:
        """One update on the buffered transitions; its statistics."""

    @abstractmethod
    def policy_tensors(self) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def load_policy(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def snapshot(self) -> tuple[dict, dict]:
        """A copy of the weights and the optimizer state (taken before an update)."""
        return copy.deepcopy(self.policy_tensors()), copy.deepcopy(self.optimizer.state_dict())

    def restore(self, snapshot: tuple[dict, dict]) -> None:
        tensors, optimizer = snapshot
        self.load_policy(tensors)
        self.optimizer.load_state_dict(optimizer)

    @abstractmethod
    def save(self, store: CheckpointStore, version: int, state: dict, extra: Groups | None = None) -> Path:
        """A checkpoint of the trainer plus the learner's JSON-able ``state`` and its own groups of tensors."""

    @abstractmethod
    def load(self, store: CheckpointStore) -> tuple[dict, Groups] | None:
        """Restore from the newest checkpoint; the learner's state and every group of tensors, or None without one."""

    @abstractmethod
    def warm_start(self, source: Path) -> None:
        """Start from offline training (first start only)."""


class FocalOnlineTrainer(OnlineTrainer[Experience]):
    strategy, experience = "rl_focal", Experience

    def __init__(self, engine: FocalEngine, models: list[str], extractor: Extractor = "line"):
        """``extractor``: how an open-ended query's feedback reference is read (as the workers read the samples)."""
        self.engine, self.models, self.extractor = engine, models, extractor
        self.optimizer = engine.optimizer
        m, k, marginal = len(models), len(engine.cfg.metrics), engine.cfg.marginal_diversity
        self.dims = {
            "decider_state": decider_obs_dim(m, k, marginal),
            "critic_state": critic_state_dim(m, k, marginal),
            "pool": m,
            "predictions": m,
        }
        self.fusion_dim = fusion_feature_dim(m)

    def check(self, experience: Experience) -> str | None:
        for field, size in self.dims.items():
            if len(getattr(experience, field)) != size:
                return f"{field} has {len(getattr(experience, field))} values, this pool needs {size}"
        n = experience.n_choices
        if experience.candidates is None and n < 2:
            return f"a multiple-choice query has at least 2 choices, this one {n}"
        if experience.candidates is not None and (len(experience.candidates) != n or n >= MAX_CHOICES):
            return f"an open-ended query's {len(experience.candidates)} candidates must be its {n} choices, at most {MAX_CHOICES - 1}"
        if len(experience.fusion_features) != n or any(
            len(row) != self.fusion_dim for row in experience.fusion_features
        ):
            return f"fusion_features must be [{n} choices, {self.fusion_dim}]"
        if experience.answer_index >= n or max(experience.predictions) >= n:
            return f"answer_index or a prediction is not one of the {n} choices"
        if not any(experience.pool):
            return "the pool is empty"
        return None

    def label(self, experience: Experience, feedback: Feedback) -> int | None:
        """The correct choice the feedback gives: its ``label``, or (open-ended) its ``reference`` among the
        candidates, ``n_choices`` when none of them; None for a bare reward. :class:`FeedbackError` when it does not fit."""
        qid, n = experience.query_id, experience.n_choices
        if feedback.label is not None and feedback.label >= n:
            raise FeedbackError(
                f"label {feedback.label} is not one of query {qid}'s {n} {'candidates' if experience.candidates is not None else 'choices'}"
            )
        if feedback.label is not None or feedback.reference is None:
            return feedback.label
        if experience.candidates is None:
            if feedback.reward is None:
                raise FeedbackError(
                    f"feedback for multiple-choice query {qid} needs a label or a reward, got only a reference"
                )
            return None
        return label_of(feedback.reference, experience.candidates, self.extractor)

    def reward(self, experience: Experience, feedback: Feedback) -> float:
        label = self.label(experience, feedback)
        if feedback.reward is not None:
            return feedback.reward
        return self.engine.reward(np.asarray(experience.pool, dtype=bool), experience.answer_index == label)

    def window_row(self, experience: Experience, feedback: Feedback) -> tuple[list[int], int]:
        label = self.label(experience, feedback)
        return experience.predictions, -1 if label is None else label

    def calibration_rows(self, experience: Experience, label: int) -> CalibrationRows | None:
        """Each called model's log-probabilities (from the query's logged behaviour) with the label, for a
        multiple-choice query whose label is one of its choices, when the engine keeps calibrations."""
        behaviour = experience.behaviour
        if not self.engine.cfg.calibration_rows or behaviour is None or experience.candidates is not None:
            return None
        if not 0 <= label < experience.n_choices:
            return None
        called = [m for m, p in enumerate(behaviour.model_probs) if len(p) == experience.n_choices]
        if not called:
            return None
        # every called model's row at once: one pass of NumPy's per-call cost, not one per model
        logp = significant(np.log(np.maximum(np.array([behaviour.model_probs[m] for m in called]), LOG_FLOOR)))
        rows = dict(zip(called, logp.tolist()))
        pool = tuple(int(m) for m in np.flatnonzero(np.asarray(experience.pool, dtype=bool)))
        return CalibrationRows(experience.n_choices, label, rows, pool)

    def confidence(self, experience: Experience) -> float:
        """The Fusion agent's probability of the answer it chose."""
        return math.exp(experience.answer_logp)

    def composition(self, experience: Experience) -> list[float]:
        return [float(chosen) for chosen in experience.pool]

    def remember(self, experience: Experience, feedback: Feedback, reward: float) -> None:
        """The Decider's reward is ``reward``; the Fusion agent's is the answer's correctness (no cost), or the
        feedback's own reward when it gives one."""
        pool = np.asarray(experience.pool, dtype=bool)
        decision = Decision(
            experience.stream,
            pool,
            pool,
            np.asarray(experience.decider_state, np.float32),
            experience.pool_logp,
            experience.explored,
        )
        features = np.asarray(experience.fusion_features, np.float32)
        answer = EngineAnswer(
            experience.answer_index,
            np.zeros(len(features)),
            features,
            experience.answer_logp,
            np.asarray(experience.critic_state, np.float32),
        )
        label = self.label(experience, feedback)
        fusion_reward = (
            feedback.reward
            if feedback.reward is not None
            else self.engine.fusion_reward(experience.answer_index == label)
        )
        self.engine.remember(decision, answer, reward, fusion_reward, label=-1 if label is None else label)

    def update_due(self) -> bool:
        return self.engine.update_due()

    def clear(self) -> None:
        self.engine.clear_buffer()

    def update(self) -> dict:
        return self.engine.update()

    def policy_tensors(self) -> dict[str, torch.Tensor]:
        return self.engine.policy_state()

    def load_policy(self, tensors: dict[str, torch.Tensor]) -> None:
        self.engine.load_policy_state(tensors)

    def save(self, store: CheckpointStore, version: int, state: dict, extra: Groups | None = None) -> Path:
        return save_engine(store, self.engine, version, state, extra)

    def load(self, store: CheckpointStore) -> tuple[dict, Groups] | None:
        return load_engine(store, self.engine)

    def warm_start(self, source: Path) -> None:
        """Algorithm 1 on a recorded dataset of the pool's models, or a trained policy of them (an `rlens replay`
        output folder or its ``policy.safetensors``: trained on other tasks)."""
        from rlens.records.dataset import load_dataset
        from rlens.focal.policy_file import load_policy, policy_path
        from rlens.focal.schedule import warm_start

        if (policy := policy_path(source)) is not None:
            load_policy(self.engine, self.models, policy)
            self.engine.reset_windows()
            return
        data = load_dataset(source)
        if data.model_names != self.models:
            raise ValueError(f"warm-start dataset models {data.model_names} are not the pool's {self.models}")
        warm_start(self.engine, data)
        self.engine.reset_windows()


Episode = tuple[str, list[Span]]  # (stream, the spans of one generation, its reward on the last)
REHEARSAL_STREAMS = 16  # rehearsal memory: the streams updated most recently, sharing its budget


class RLAEOnlineTrainer(OnlineTrainer[RLAEExperience]):
    """PPO / MAPPO on the agent's span decisions, every ``cfg.episodes_per_update`` rewarded generations.

    A stream that switches task (blocks of one family, then another) makes plain online PPO forget: each update
    fits the family of the moment. So every update also replays ``rehearsal`` episodes of earlier updates in all,
    shared evenly by the :data:`REHEARSAL_STREAMS` streams updated most recently (each keeps its latest; at least
    one each): with one stream key, the memory reaches back over several task blocks. Their ratios are taken against
    the policy that acted, so the clipped objective pulls the policy back toward what earned reward there, and their
    values come from the current critic.
    """

    strategy, experience = "rlae", RLAEExperience

    def __init__(self, policy: Policy, cfg: RLAEConfig, models: list[str], seed: int = 0, rehearsal: int = 0):
        self.policy, self.cfg, self.models, self.rehearsal = policy, cfg, models, rehearsal
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr, eps=1e-5)
        self.generator = torch.Generator().manual_seed(seed)
        self.fresh: list[Episode] = []  # since the last update
        self.memory: OrderedDict[str, list[list[Span]]] = OrderedDict()  # per stream, its latest earlier episodes

    @property
    def episodes(self) -> int:
        return len(self.fresh)

    def check(self, experience: RLAEExperience) -> str | None:
        dim, m = obs_dim(len(self.models)), len(self.models)
        for k, span in enumerate(experience.spans):
            if len(span.obs) != dim or len(span.action) != m:
                return f"span {k}: obs has {len(span.obs)} values and action {len(span.action)}, this pool needs {dim} and {m}"
            if self.cfg.variant == "ppo" and (min(span.action) <= 0 or abs(sum(span.action) - 1) > 1e-3):
                return f"span {k}: a ppo action is a weight vector (positive, summing to 1)"
        if len(experience.spans) > -(-self.cfg.max_tokens // self.cfg.span):
            return f"{len(experience.spans)} spans, more than max_tokens / span allows"
        return None

    def confidence(self, experience: RLAEExperience) -> float:
        """The agent's value estimate (its expected exact match), averaged over the spans."""
        return sum(span.value for span in experience.spans) / len(experience.spans)

    def composition(self, experience: RLAEExperience) -> list[float]:
        actions = torch.tensor([span.action for span in experience.spans], dtype=torch.float32)
        return self.policy.weights(actions).mean(0).tolist()

    def reward(self, experience: RLAEExperience, feedback: Feedback) -> float:
        if feedback.reward is not None:
            return feedback.reward
        if feedback.reference is None:
            raise FeedbackError(
                f"feedback for open-ended query {experience.query_id} needs a reference text or a reward, got only a label"
            )
        return float(exact_match(experience.text, feedback.reference))

    def remember(self, experience: RLAEExperience, feedback: Feedback, reward: float) -> None:
        spans = [
            Span(np.asarray(s.obs, np.float32), np.asarray(s.action, np.float32), s.logp, s.value)
            for s in experience.spans
        ]
        spans[-1].reward, spans[-1].last = reward, True
        self.fresh.append((experience.stream, spans))

    def update_due(self) -> bool:
        return len(self.fresh) >= self.cfg.episodes_per_update

    def clear(self) -> None:
        self.fresh = []

    def update(self) -> dict:
        replayed = [s for episodes in self.memory.values() for episode in episodes for s in episode]
        if replayed:
            with torch.no_grad():
                values = self.policy.critic(torch.from_numpy(np.stack([s.obs for s in replayed]))).squeeze(-1).tolist()
            replayed = [replace(s, value=v) for s, v in zip(replayed, values)]
        stats = update(
            self.policy,
            self.optimizer,
            [s for _, spans in self.fresh for s in spans] + replayed,
            self.cfg,
            self.generator,
        )
        rewards = [spans[-1].reward for _, spans in self.fresh]
        stats = {
            **stats,
            "episodes": len(rewards),
            "mean_reward": float(np.mean(rewards)),
            "rehearsed": sum(s.last for s in replayed),
        }
        if self.rehearsal:
            for stream, spans in self.fresh:
                self.memory.setdefault(stream, []).append(spans)
                self.memory.move_to_end(stream)
            while len(self.memory) > REHEARSAL_STREAMS:
                self.memory.popitem(last=False)
            share = max(1, self.rehearsal // len(self.memory))  # the budget, shared evenly (at least one each)
            for kept in self.memory.values():
                del kept[:-share]
        self.fresh = []
        return stats

    def policy_tensors(self) -> dict[str, torch.Tensor]:
        """A copy: a candidate's weights must not move while the learner trains on."""
        return {k: v.detach().clone() for k, v in self.policy.state_dict().items()}

    def load_policy(self, tensors: dict[str, torch.Tensor]) -> None:
        self.policy.load_state_dict(tensors)

    def save(self, store: CheckpointStore, version: int, state: dict, extra: Groups | None = None) -> Path:
        adam, meta = optimizer_tensors(self.optimizer)
        episodes = self.fresh + [(stream, spans) for stream, kept in self.memory.items() for spans in kept]
        spans = [s for _, episode in episodes for s in episode]
        dim, m = obs_dim(len(self.models)), len(self.models)
        tensors = {
            "obs": torch.from_numpy(np.stack([s.obs for s in spans])) if spans else torch.zeros(0, dim),
            "action": torch.from_numpy(np.stack([s.action for s in spans])) if spans else torch.zeros(0, m),
        }
        payload = {
            **state,
            "models": self.models,
            "config": asdict(self.cfg),
            "optimizer": meta,
            "fresh": len(self.fresh),
            "episodes": [[stream, [[s.logp, s.value, s.reward] for s in episode]] for stream, episode in episodes],
        }
        return store.save(
            version,
            {
                "policy": self.policy.state_dict(),
                "optimizer": {**adam, "rng.torch": self.generator.get_state()},
                "episodes": tensors,
                **(extra or {}),
            },
            payload,
        )

    def load(self, store: CheckpointStore) -> tuple[dict, Groups] | None:
        restored = store.load_latest()
        if restored is None:
            return None
        tensors, state = restored
        self._check_run(store.directory, state)
        self.policy.load_state_dict(tensors["policy"])
        load_optimizer(self.optimizer, tensors["optimizer"], state["optimizer"])
        self.generator.set_state(tensors["optimizer"]["rng.torch"])
        obs, action, row = tensors["episodes"]["obs"].numpy(), tensors["episodes"]["action"].numpy(), 0
        episodes: list[Episode] = []
        for stream, spans in state["episodes"]:
            episode = [
                Span(obs[row + k], action[row + k], logp, value, reward)
                for k, (logp, value, reward) in enumerate(spans)
            ]
            episode[-1].last = True
            episodes.append((stream, episode))
            row += len(spans)
        self.fresh, self.memory = episodes[: state["fresh"]], OrderedDict()
        for stream, episode in episodes[state["fresh"] :]:
            self.memory.setdefault(stream, []).append(episode)
        return state, tensors

    def warm_start(self, source: Path) -> None:
        """The policy of an offline ``rlens rlae train`` run (its latest checkpoint) over the same models."""
        restored = CheckpointStore(Path(source), lock=False).load_latest()
        if restored is None:
            raise ValueError(f"{source} holds no RLAE checkpoint: train one with `rlens rlae train --out {source}`")
        tensors, state = restored
        self._check_run(source, state)
        self.policy.load_state_dict(tensors["policy"])

    def _check_run(self, where: Path, state: dict) -> None:
        if state["models"] != self.models:
            raise ValueError(f"{where} was trained on models {state['models']}, the pool is {self.models}")
        # runs before `observe` saw the text
        theirs = {
            k: state["config"].get(k, "text" if k == "observe" else None)
            for k in ("variant", "span", "max_tokens", "observe")
        }
        ours = {k: getattr(self.cfg, k) for k in theirs}
        if theirs != ours:
            raise ValueError(
                f"{where} holds an RLAE agent with {theirs}, the settings ask for {ours} (RLENS_RLAE_VARIANT / _SPAN / _MAX_TOKENS / _OBSERVE)"
            )
