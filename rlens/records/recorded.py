"""What a recorded dataset is, whatever its format: :class:`RecordedDataset` (every model's answer distribution over
the choices of every question, in stream order), :class:`SampledTask` (an open-ended task with every model's
samples), :class:`DatasetError`, and the ``models.json`` every dataset directory holds."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from rlens.records.answers import Extractor

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
        """The choices are the answers the models gave (:mod:`rlens.records.open_ended`)."""
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


def write_models(directory: Path, names: list[str], costs: np.ndarray) -> None:
    models = [{"index": i, "name": name, "cost": float(cost)} for i, (name, cost) in enumerate(zip(names, costs))]
    (directory / "models.json").write_text(json.dumps(models, indent=1))


class SampledTask(BaseModel):
    """One open-ended task and every model's sampled texts for it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt: str
    reference: str
    family: str = "default"
    samples: dict[str, list[str]] = Field(description="model name -> its sampled texts (an empty list: it gave none)")
