"""Checkpoints that resume exactly, written atomically, without pickle.

A checkpoint is a directory ``v{version:08d}-{n:06d}`` holding named safetensors files (weights, optimizer
moments, torch RNG states) and ``state.json`` (everything else). It is written to a temporary directory, fsynced
and renamed; ``LATEST`` (also replaced by rename) names the newest. A crash at any point leaves the previous
checkpoint intact. The last ``keep`` are kept. :func:`optimizer_tensors` / :func:`load_optimizer` turn an Adam
optimizer into tensors plus JSON and back.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


class CheckpointStore:
    def __init__(self, directory: Path, keep: int = 3):
        self.directory = Path(directory)
        self.keep = keep
        self.directory.mkdir(parents=True, exist_ok=True)
        self.count = 0

    def save(self, version: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict) -> Path:
        """Write ``{name}.safetensors`` for each entry of ``tensors`` and ``state.json``; returns the directory."""
        self.count += 1
        name = f"v{version:08d}-{self.count:06d}"
        tmp = self.directory / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for file, content in tensors.items():
            save_file({k: v.contiguous() for k, v in content.items()}, tmp / f"{file}.safetensors")
        (tmp / "state.json").write_text(json.dumps({**state, "version": version}))
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

    def latest(self) -> Path | None:
        latest = self.directory / "LATEST"
        return self.directory / latest.read_text().strip() if latest.is_file() else None

    def load_latest(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict] | None:
        """The newest checkpoint's tensors (by file name) and state, or None when there is none."""
        path = self.latest()
        if path is None:
            return None
        self.count = int(path.name.rsplit("-", 1)[1])
        tensors = {p.name.removesuffix(".safetensors"): load_file(p) for p in path.glob("*.safetensors")}
        return tensors, json.loads((path / "state.json").read_text())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Adam's moment tensors, and the rest (step counts, hyper-parameters) as JSON."""
    state = optimizer.state_dict()
    tensors, steps = {}, {}
    for index, slots in state["state"].items():
        for name, value in slots.items():
            if name == "step":
                steps[str(index)] = float(value)
            else:
                tensors[f"adam.{index}.{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "steps": steps}


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict = {}
    for key, value in tensors.items():
        if key.startswith("adam."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    for index, step in meta["steps"].items():
        state.setdefault(int(index), {})["step"] = torch.tensor(step)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
