"""The learner's checkpoints of the RL-Focal engine (see :mod:`rlens.checkpoint` for the atomic store).

``policy.safetensors`` holds every agent's weights, ``optimizer.safetensors`` Adam's moments and the torch RNG
state, and ``state.json`` Adam's step counts, the numpy RNG state, the experience buffer and whatever the learner
adds (consumer offsets, the marks of the journals of pending joins and recent query ids, counters).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rlens.checkpoint import CheckpointStore, load_optimizer, optimizer_tensors
from rlens.focal.engine import FocalEngine
from rlens.focal.mappo import Transition


def transition_to_json(t: Transition) -> dict:
    return {
        "state": t.state.tolist(),
        "critic_state": t.critic_state.tolist(),
        "pool": t.pool.tolist(),
        "pool_logp": t.pool_logp,
        "reward": t.reward,
        "fusion_reward": t.fusion_reward,
        "explored": t.explored,
        "fusion_features": None if t.fusion_features is None else t.fusion_features.tolist(),
        "answer": t.answer,
        "answer_logp": t.answer_logp,
        "label": t.label,
    }


def transition_from_json(d: dict) -> Transition:
    return Transition(
        state=np.asarray(d["state"], np.float32),
        critic_state=np.asarray(d["critic_state"], np.float32),
        pool=np.asarray(d["pool"], np.float32),
        pool_logp=d["pool_logp"],
        reward=d["reward"],
        fusion_reward=d["fusion_reward"],
        explored=d["explored"],
        fusion_features=None if d["fusion_features"] is None else np.asarray(d["fusion_features"], np.float32),
        answer=d["answer"],
        answer_logp=d["answer_logp"],
        label=d["label"],
    )


Groups = dict[str, dict[str, torch.Tensor]]  # a checkpoint's named groups of tensors (one safetensors file each)


def save_engine(
    store: CheckpointStore, engine: FocalEngine, version: int, state: dict, extra: Groups | None = None
) -> Path:
    """One checkpoint of ``engine`` plus the learner's JSON-able ``state`` and ``extra`` groups of tensors; returns
    its directory."""
    adam, optimizer_meta = optimizer_tensors(engine.optimizer)
    payload = {
        **state,
        "optimizer": optimizer_meta,
        "rng_numpy": engine.rng.bit_generator.state,
        "buffer": [transition_to_json(t) for t in engine.buffer],
    }
    return store.save(
        version,
        {
            "policy": engine.policy_state(),
            "optimizer": {**adam, "rng.torch": engine.torch_rng.get_state()},
            **(extra or {}),
        },
        payload,
    )


def load_engine(store: CheckpointStore, engine: FocalEngine) -> tuple[dict, Groups] | None:
    """Restore ``engine`` (weights, optimizer, RNGs, buffer) from the newest checkpoint; its state and groups of
    tensors, or None."""
    restored = store.load_latest()
    if restored is None:
        return None
    tensors, state = restored
    engine.load_policy_state(tensors["policy"])
    load_optimizer(engine.optimizer, tensors["optimizer"], state["optimizer"])
    engine.torch_rng.set_state(tensors["optimizer"]["rng.torch"])
    engine.rng.bit_generator.state = state["rng_numpy"]
    engine.restore_buffer([transition_from_json(t) for t in state["buffer"]])
    return state, tensors
