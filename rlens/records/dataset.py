"""Loading a dataset directory (a multiple-choice one here, a samples one through :mod:`.open_ended`) and saving one.

The format (one directory per dataset) is documented in docs/reference.md ("Dataset format"):
``probs.npy`` [N, M, C] float, ``choice_mask.npy`` [N, C] bool, ``labels.npy`` [N] int,
``task.npy`` [N] int, ``models.json`` and ``tasks.json``.
Every problem is raised as a :class:`DatasetError` that names the file and the problem.
"""

from __future__ import annotations

import json
from pathlib import Path
import numpy as np

from rlens.records.open_ended import is_samples_dir, load_samples
from rlens.records.recorded import (
    PROB_SUM_TOLERANCE,
    DatasetError,
    RecordedDataset,
    _load_array,
    _load_json_list,
    read_models,
    write_models,
)


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
