"""Recorded-outputs datasets: load, validate and slice a dataset directory.

The format (one directory per dataset) is documented in README.md ("Dataset format"):
``probs.npy`` [N, M, C] float, ``choice_mask.npy`` [N, C] bool, ``labels.npy`` [N] int,
``task.npy`` [N] int, ``models.json`` and ``tasks.json``.
Every problem is raised as a :class:`DatasetError` that names the file and the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rlens.evaluation.open_ended import SampledTask
    from rlens.models.answers import Extractor

PROB_SUM_TOLERANCE = 1e-2


class DatasetError(ValueError):
    """A dataset directory is missing a file or holds inconsistent data."""

    def __init__(self, file: str | Path, problem: str):
        self.file = str(file)
        self.problem = problem
        super().__init__(f"{self.file}: {problem}")


@dataclass(frozen=True)
class RecordedDataset:
    """Every model's answer distribution over the choices of every question, in stream order."""

    name: str
    probs: np.ndarray  # float32 [N, M, C]; 0 in padded columns
    choice_mask: np.ndarray  # bool [N, C]
    labels: np.ndarray  # int64 [N]
    task: np.ndarray  # int64 [N]
    model_names: list[str]
    model_costs: np.ndarray  # float64 [M], cost of one call of each model
    task_names: dict[int, str]
    sampled: list[SampledTask] | None = (
        None  # open-ended: the recorded samples the choices come from; None: multiple choice
    )
    extractor: Extractor = "line"  # open-ended: how an answer is read from a sample or a reference

    @property
    def open_ended(self) -> bool:
        """The choices are the answers the models gave (:mod:`rlens.evaluation.open_ended`)."""
        return self.sampled is not None

    @property
    def n_questions(self) -> int:
        return self.probs.shape[0]

    @property
    def n_models(self) -> int:
        return self.probs.shape[1]

    def task_name(self, task_id: int) -> str:
        return self.task_names.get(int(task_id), f"task_{int(task_id)}")

    def subset(self, index: np.ndarray) -> "RecordedDataset":
        """The questions at ``index`` (in that order), with the same models and tasks."""
        return RecordedDataset(
            name=self.name,
            probs=self.probs[index],
            choice_mask=self.choice_mask[index],
            labels=self.labels[index],
            task=self.task[index],
            model_names=self.model_names,
            model_costs=self.model_costs,
            task_names=self.task_names,
            sampled=None if self.sampled is None else [self.sampled[i] for i in index],
            extractor=self.extractor,
        )


def shared_data_dir() -> Path:
    """Where the shared datasets live: ``$RLENS_SHARED_DATA`` or ``../shared/datasets``."""
    from rlens.settings import settings

    return settings().shared_data


def _load_array(directory: Path, filename: str) -> np.ndarray:
    path = directory / filename
    if not path.is_file():
        raise DatasetError(path, "file is missing")
    try:
        return np.load(path, allow_pickle=False)
    except Exception as exc:  # numpy raises several types for corrupt files
        raise DatasetError(path, f"not a readable .npy array ({exc.__class__.__name__}: {exc})") from None


def _load_json_list(path: Path, required: bool) -> list[dict] | None:
    if not path.is_file():
        if required:
            raise DatasetError(path, "file is missing")
        return None
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetError(path, f"not valid JSON ({exc})") from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise DatasetError(path, "must be a JSON list of objects")
    return value


def read_models(path: Path, n_models: int | None) -> tuple[list[str], np.ndarray]:
    """``models.json``: the models' names and costs (``n_models``: how many the arrays hold, if known)."""
    entries = _load_json_list(path, required=True)
    assert entries is not None
    if n_models is None:
        n_models = len(entries)
    if len(entries) != n_models or not entries:
        raise DatasetError(
            path, f"lists {len(entries)} models but probs.npy has {n_models} on axis 1" if entries else "lists no model"
        )
    names: list[str | None] = [None] * n_models
    costs = np.ones(n_models)
    for position, entry in enumerate(entries):
        index = entry.get("index", position)
        if not isinstance(index, int) or not 0 <= index < n_models or names[index] is not None:
            raise DatasetError(path, f"entry {position} has a bad or repeated index {index!r}")
        names[index] = str(entry.get("name", f"model_{index}"))
        cost = entry.get("cost", 1.0)
        if not isinstance(cost, (int, float)) or not np.isfinite(cost) or cost <= 0:
            raise DatasetError(path, f"model {index} has cost {cost!r}; costs must be positive numbers")
        costs[index] = float(cost)
    return [str(n) for n in names], costs


def _tasks(path: Path, task_ids: np.ndarray) -> dict[int, str]:
    entries = _load_json_list(path, required=False)
    names = {int(t): f"task_{int(t)}" for t in np.unique(task_ids)}
    for position, entry in enumerate(entries or []):
        if not isinstance(entry.get("id"), int):
            raise DatasetError(path, f"entry {position} has no integer 'id'")
        names[entry["id"]] = str(entry.get("name", f"task_{entry['id']}"))
    return names


def load_dataset(directory: str | Path) -> RecordedDataset:
    """Load and validate a dataset directory; raise :class:`DatasetError` on any problem."""
    directory = Path(directory)
    if not directory.exists():
        raise DatasetError(
            directory,
            "no such dataset directory. Datasets come from `rlens import lm-eval` (lm-evaluation-harness outputs), "
            "`rlens zoo record`, or a shared datasets folder (RLENS_SHARED_DATA, default ../shared/datasets, holds "
            "bbh_dev where the project provides it); the bundled stream needs none: `rlens demo`",
        )
    if not directory.is_dir():
        raise DatasetError(directory, "not a directory (expected a dataset directory with probs.npy, ...)")
    from rlens.evaluation.open_ended import is_samples_dir, load_samples

    if is_samples_dir(directory):
        return load_samples(directory)
    probs = _load_array(directory, "probs.npy")
    mask = _load_array(directory, "choice_mask.npy")
    labels = _load_array(directory, "labels.npy")
    task = _load_array(directory, "task.npy")

    if probs.ndim != 3 or not np.issubdtype(probs.dtype, np.floating):
        raise DatasetError(
            directory / "probs.npy",
            f"must be a float array [questions, models, choices], got {probs.dtype} {probs.shape}",
        )
    n, m, c = probs.shape
    if n == 0 or m == 0 or c < 2:
        raise DatasetError(
            directory / "probs.npy", f"needs at least 1 question, 1 model and 2 choice columns, got shape {probs.shape}"
        )
    if mask.shape != (n, c) or mask.dtype != np.bool_:
        raise DatasetError(directory / "choice_mask.npy", f"must be bool [{n}, {c}], got {mask.dtype} {mask.shape}")
    for name, arr in (("labels.npy", labels), ("task.npy", task)):
        if arr.shape != (n,) or not np.issubdtype(arr.dtype, np.integer):
            raise DatasetError(directory / name, f"must be an integer array [{n}], got {arr.dtype} {arr.shape}")
    if not np.isfinite(probs).all() or (probs < 0).any():
        raise DatasetError(directory / "probs.npy", "holds NaN, infinite or negative probabilities")
    n_valid = mask.sum(1)
    if (n_valid < 2).any():
        row = int(np.argmax(n_valid < 2))
        raise DatasetError(
            directory / "choice_mask.npy",
            f"question {row} has {int(n_valid[row])} valid choices; at least 2 are needed",
        )
    if (probs * ~mask[:, None, :]).max() > 0:
        row = int(np.argmax((probs * ~mask[:, None, :]).max(axis=(1, 2)) > 0))
        raise DatasetError(
            directory / "probs.npy", f"question {row} puts probability on a choice that choice_mask.npy marks invalid"
        )
    sums = probs.sum(2)
    if np.abs(sums - 1).max() > PROB_SUM_TOLERANCE:
        row, model = (int(i) for i in np.unravel_index(int(np.argmax(np.abs(sums - 1))), sums.shape))
        raise DatasetError(
            directory / "probs.npy",
            f"question {row}, model {model}: probabilities sum to {sums[row, model]:.4f}, not 1",
        )
    if (labels < 0).any() or (labels >= c).any() or not mask[np.arange(n), np.clip(labels, 0, c - 1)].all():
        row = int(np.argmax((labels < 0) | (labels >= c) | ~mask[np.arange(n), np.clip(labels, 0, c - 1)]))
        raise DatasetError(
            directory / "labels.npy",
            f"question {row} has label {int(labels[row])}, which is not one of its valid choices",
        )

    model_names, costs = read_models(directory / "models.json", m)
    task_names = _tasks(directory / "tasks.json", task)
    return RecordedDataset(
        name=directory.name,
        probs=(probs / sums[:, :, None]).astype(np.float32),
        choice_mask=mask,
        labels=labels.astype(np.int64),
        task=task.astype(np.int64),
        model_names=model_names,
        model_costs=costs,
        task_names=task_names,
    )


def write_models(directory: Path, names: list[str], costs: np.ndarray) -> None:
    models = [{"index": i, "name": name, "cost": float(cost)} for i, (name, cost) in enumerate(zip(names, costs))]
    (directory / "models.json").write_text(json.dumps(models, indent=1))


def save_dataset(
    dataset: RecordedDataset, directory: str | Path, task_choices: dict[int, list[str]] | None = None
) -> Path:
    """Write ``dataset`` in the recorded-outputs format (used by importers and tests)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    np.save(directory / "probs.npy", dataset.probs.astype(np.float32))
    np.save(directory / "choice_mask.npy", dataset.choice_mask.astype(bool))
    np.save(directory / "labels.npy", dataset.labels.astype(np.int64))
    np.save(directory / "task.npy", dataset.task.astype(np.int64))
    write_models(directory, dataset.model_names, dataset.model_costs)
    tasks = [
        {"id": tid, "name": name, "choices": (task_choices or {}).get(tid, [])}
        for tid, name in sorted(dataset.task_names.items())
    ]
    (directory / "tasks.json").write_text(json.dumps(tasks, indent=1))
    return directory
