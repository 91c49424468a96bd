"""The learner's checkpoints: everything needed to resume exactly, written atomically, without pickle.

A checkpoint is a directory ``v{version:08d}-{n:06d}`` holding ``policy.safetensors`` (every agent's weights),
``optimizer.safetensors`` (Adam's moment tensors and the torch RNG state) and ``state.json`` (Adam's step counts and
hyper-parameters, consumer offsets, pending joins, recent query ids, the experience buffer, counters, the numpy RNG
state). It is written to a temporary directory, fsynced and renamed; ``LATEST`` (also replaced by rename) names
the newest. A crash at any point leaves the previous checkpoint intact. The last ``keep`` are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlens.focal.engine import FocalEngine
from rlens.focal.mappo import Transition


def transition_to_json(t: Transition) -> dict:
    return {
        "state": t.state.tolist(), "critic_state": t.critic_state.tolist(), "pool": t.pool.tolist(), "pool_logp": t.pool_logp,
        "reward": t.reward, "fusion_features": None if t.fusion_features is None else t.fusion_features.tolist(),
        "answer": t.answer, "answer_logp": t.answer_logp,
    }


def transition_from_json(d: dict) -> Transition:
    return Transition(
        state=np.asarray(d["state"], np.float32), critic_state=np.asarray(d["critic_state"], np.float32), pool=np.asarray(d["pool"], np.float32),
        pool_logp=d["pool_logp"], reward=d["reward"], fusion_features=None if d["fusion_features"] is None else np.asarray(d["fusion_features"], np.float32),
        answer=d["answer"], answer_logp=d["answer_logp"],
    )


def _optimizer_tensors(engine: FocalEngine) -> tuple[dict[str, torch.Tensor], dict]:
    state = engine.optimizer.state_dict()
    tensors = {"rng.torch": engine.torch_rng.get_state()}
    steps = {}
    for index, slots in state["state"].items():
        for name, value in slots.items():
            if name == "step":
                steps[str(index)] = float(value)
            else:
                tensors[f"adam.{index}.{name}"] = value.contiguous()
    return tensors, {"param_groups": state["param_groups"], "steps": steps}


def _load_optimizer(engine: FocalEngine, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict = {}
    for key, value in tensors.items():
        if key.startswith("adam."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    for index, step in meta["steps"].items():
        state.setdefault(int(index), {})["step"] = torch.tensor(step)
    engine.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    engine.torch_rng.set_state(tensors["rng.torch"])


class CheckpointStore:
    def __init__(self, directory: Path, keep: int = 3):
        self.directory = Path(directory)
        self.keep = keep
        self.directory.mkdir(parents=True, exist_ok=True)
        self.count = 0

    def save(self, engine: FocalEngine, version: int, state: dict) -> Path:
        """Write one checkpoint of ``engine`` plus the learner's JSON-able ``state``; returns its directory."""
        self.count += 1
        name = f"v{version:08d}-{self.count:06d}"
        tmp = self.directory / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file({k: v.contiguous() for k, v in engine.policy_state().items()}, tmp / "policy.safetensors")
        tensors, optimizer_meta = _optimizer_tensors(engine)
        save_file(tensors, tmp / "optimizer.safetensors")
        payload = {
            **state, "version": version, "optimizer": optimizer_meta, "rng_numpy": engine.rng.bit_generator.state,
            "buffer": [transition_to_json(t) for t in engine.buffer],
        }
        (tmp / "state.json").write_text(json.dumps(payload))
        for path in tmp.iterdir():
            with path.open("rb") as f:
                os.fsync(f.fileno())
        final = self.directory / name
        os.replace(tmp, final)
        latest_tmp = self.directory / ".LATEST.tmp"
        latest_tmp.write_text(name)
        os.replace(latest_tmp, self.directory / "LATEST")
        self._prune()
        return final

    def _prune(self) -> None:
        kept = sorted(p for p in self.directory.iterdir() if p.is_dir() and p.name.startswith("v"))
        for old in kept[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def load_latest(self, engine: FocalEngine) -> dict | None:
        """Restore ``engine`` (weights, optimizer, RNGs, buffer) from the newest checkpoint; its state, or None."""
        latest = self.directory / "LATEST"
        if not latest.is_file():
            return None
        path = self.directory / latest.read_text().strip()
        state = json.loads((path / "state.json").read_text())
        engine.load_policy_state(load_file(path / "policy.safetensors"))
        _load_optimizer(engine, load_file(path / "optimizer.safetensors"), state["optimizer"])
        engine.rng.bit_generator.state = state["rng_numpy"]
        engine.buffer = [transition_from_json(t) for t in state["buffer"]]
        self.count = int(path.name.rsplit("-", 1)[1])
        return state
