"""A trained RL-Focal policy as one file: every agent's weights (safetensors) with the pool's model names in its
metadata. `rlens replay` writes its run's (``policy.safetensors`` beside ``results.json``); `rlens replay
--pretrained` and the learner's ``--warm-start`` start from one, on other tasks of the same pool."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from rlens.focal.engine import FocalEngine

POLICY_FILE = "policy.safetensors"


def save_policy(engine: FocalEngine, models: list[str], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in engine.policy_state().items()}
    save_file(tensors, str(path), metadata={"models": json.dumps(models)})
    return path


def policy_path(source: Path) -> Path | None:
    """The policy file ``source`` is, or holds (a replay's output folder); None if neither."""
    if source.is_file() and source.suffix == ".safetensors":
        return source
    inside = source / POLICY_FILE
    return inside if inside.is_file() else None


def load_policy(engine: FocalEngine, models: list[str], path: Path) -> None:
    """``engine`` with the file's weights; ValueError when they are another pool's or another architecture's."""
    with safe_open(str(path), framework="pt") as f:
        saved = json.loads((f.metadata() or {}).get("models", "null"))
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if saved != models:
        raise ValueError(f"{path}: a policy for models {saved}, this pool is {models}")
    current = engine.policy_state()
    wrong = sorted(k for k in current if k not in tensors or tensors[k].shape != current[k].shape)
    if wrong or set(tensors) - set(current):
        raise ValueError(f"{path}: the policy does not fit this engine's agents (tensors {wrong[:3]} differ)")
    engine.load_policy_state(tensors)
