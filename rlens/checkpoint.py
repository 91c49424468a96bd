"""Checkpoints that resume exactly, written atomically, verified on load, without pickle.

A checkpoint is a directory ``v{version:08d}-{n:06d}`` (``n`` counts writes, so it orders checkpoints even when
the version goes down) holding named safetensors files (weights, optimizer moments, torch RNG states),
``state.json`` (everything else) and ``MANIFEST.json`` (each file's SHA-256). It is written to a temporary
directory, every file and the directory fsynced, then renamed; ``LATEST`` (also replaced by rename, then the
directory fsynced) names the newest. Loading verifies the manifest; a checkpoint that does not verify (truncated,
altered, half-deleted) or an empty or dangling ``LATEST`` is skipped with a warning for the newest one that does.
The last ``keep`` are kept (by write count). A store holds an exclusive lock on its directory (``.lock``): a
second process, or a second store in one process, on the same directory is refused with :class:`CheckpointLockError`.
:func:`optimizer_tensors` / :func:`load_optimizer` turn an Adam optimizer into tensors plus JSON and back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlens.locks import LockedError, acquire, release

log = logging.getLogger("rlens.checkpoint")


class CheckpointLockError(LockedError):
    """Another store (another learner) holds the checkpoint directory."""


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_count(path: Path) -> int:
    try:
        return int(path.name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


class CheckpointStore:
    def __init__(self, directory: Path, keep: int = 3, lock: bool = True):
        """``lock`` False: a reader that never saves (a warm start, ``rlae generate``) takes no lock."""
        self.directory = Path(directory)
        self.keep = keep
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = self._acquire() if lock else None
        if self._lock is not None:  # temporary files of a writer that crashed: nobody else writes here now
            for stale in self.directory.glob(".*.tmp"):
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        self.count = max((_write_count(p) for p in self._candidates()), default=0)

    def _acquire(self):
        try:
            return acquire(self.directory / ".lock", f"checkpoint directory {self.directory}")
        except LockedError as exc:
            raise CheckpointLockError(f"{exc}: one learner per directory") from None

    def close(self) -> None:
        """Release the directory lock (also released when the process exits)."""
        release(self._lock)

    def save(self, version: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict) -> Path:
        """Write ``{name}.safetensors`` for each entry of ``tensors``, ``state.json`` and the manifest; returns the directory."""
        if self._lock is None:
            raise CheckpointLockError(f"{self.directory} was opened read-only (lock=False)")
        self.count += 1
        name = f"v{version:08d}-{self.count:06d}"
        tmp = self.directory / f".{name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for file, content in tensors.items():
            save_file({k: v.contiguous() for k, v in content.items()}, tmp / f"{file}.safetensors")
        (tmp / "state.json").write_text(json.dumps({**state, "version": version}))
        (tmp / "MANIFEST.json").write_text(json.dumps({p.name: _sha256(p) for p in sorted(tmp.iterdir())}))
        for path in tmp.iterdir():
            with path.open("rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        final = self.directory / name
        os.replace(tmp, final)
        latest_tmp = self.directory / f".LATEST.{os.getpid()}.tmp"
        latest_tmp.write_text(name)
        with latest_tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(latest_tmp, self.directory / "LATEST")
        fsync_dir(self.directory)
        self._prune()
        return final

    def _candidates(self) -> list[Path]:
        """Checkpoint directories, newest write first."""
        found = [p for p in self.directory.iterdir() if p.is_dir() and p.name.startswith("v") and _write_count(p) >= 0]
        return sorted(found, key=_write_count, reverse=True)

    def _prune(self) -> None:
        for old in self._candidates()[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path | None:
        """The newest checkpoint that verifies, or None."""
        named = self.directory / "LATEST"
        name = named.read_text().strip() if named.is_file() else ""
        first = self.directory / name if name else None
        ordered = ([first] if first is not None else []) + [p for p in self._candidates() if p != first]
        for path in ordered:
            if problem := self._problem(path):
                log.warning("checkpoint %s skipped: %s", path, problem)
                continue
            return path
        return None

    @staticmethod
    def _problem(path: Path) -> str | None:
        manifest = path / "MANIFEST.json"
        if not manifest.is_file():
            return "missing (or no MANIFEST.json)"
        try:
            expected = json.loads(manifest.read_text())
        except ValueError:
            return "MANIFEST.json is not JSON"
        for name, digest in expected.items():
            if not (path / name).is_file() or _sha256(path / name) != digest:
                return f"{name} is missing or does not match its checksum"
        return None

    def load_latest(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict] | None:
        """The newest verified checkpoint's tensors (by file name) and state, or None when there is none."""
        path = self.latest()
        if path is None:
            return None
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
