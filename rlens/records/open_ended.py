"""Recorded samples of open-ended tasks, and the dataset RL-Focal replays from them.

A samples directory holds ``models.json`` (as in every dataset: names and costs), ``samples.jsonl`` (one task per
line: ``{"prompt", "reference", "family", "samples": {model name: [texts]}}``) and optionally
``open_ended.json`` (``{"extractor": "line" | "number"}``, default line). :func:`rlens.records.dataset.load_dataset`
reads such a directory as an open-ended :class:`RecordedDataset` (:func:`sampled_dataset`): a question's choices are
the union of the answers extracted from the models' samples (:func:`rlens.records.answers.pool_choices`), each model's
distribution the frequency of each answer among its samples, plus one last column that no model ever picks, "none of
these": the label when no model gave the reference (so every model, and any fusion, is wrong there). A model none of
whose samples holds an answer has a zero row (it counts as not answering). The ``replay`` backend serves the recorded
texts to ``generate`` requests, so the streaming service can run on the same samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from rlens.records.recorded import DatasetError, RecordedDataset, SampledTask, read_models, write_models
from rlens.records.answers import Extractor, label_of, pool_choices

SAMPLES_FILE = "samples.jsonl"
OPTIONS_FILE = "open_ended.json"


def is_samples_dir(directory: Path) -> bool:
    return (directory / SAMPLES_FILE).is_file() and not (directory / "probs.npy").exists()


def save_samples(
    directory: Path,
    tasks: list[SampledTask],
    model_names: list[str],
    model_costs: np.ndarray,
    extractor: Extractor = "line",
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    write_models(directory, model_names, model_costs)
    with (directory / SAMPLES_FILE).open("w") as f:
        f.writelines(task.model_dump_json() + "\n" for task in tasks)
    (directory / OPTIONS_FILE).write_text(json.dumps({"extractor": extractor}))
    return directory


def load_samples(directory: Path) -> RecordedDataset:
    """A samples directory as an open-ended dataset; :class:`DatasetError` names the file and line of any problem."""
    path = directory / SAMPLES_FILE
    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            tasks.append(SampledTask.model_validate_json(line))
        except ValidationError as exc:
            first = exc.errors()[0]
            raise DatasetError(
                path, f"line {number}: {'.'.join(str(p) for p in first['loc']) or 'the line'}: {first['msg']}"
            ) from None
    if not tasks:
        raise DatasetError(path, "holds no task")
    extractor: Extractor = "line"
    if (directory / OPTIONS_FILE).is_file():
        try:
            extractor = json.loads((directory / OPTIONS_FILE).read_text()).get("extractor", "line")
        except (json.JSONDecodeError, AttributeError):
            raise DatasetError(directory / OPTIONS_FILE, 'must be a JSON object like {"extractor": "line"}') from None
        if extractor not in ("line", "number"):
            raise DatasetError(directory / OPTIONS_FILE, f"unknown extractor {extractor!r}: line or number")
    model_names, costs = read_models(directory / "models.json", None)
    for number, task in enumerate(tasks, 1):
        if unknown := sorted(set(task.samples) - set(model_names)):
            raise DatasetError(path, f"line {number}: samples of {', '.join(unknown)}, which models.json does not list")
    return sampled_dataset(directory.name, tasks, model_names, costs, extractor)


def sampled_dataset(
    name: str,
    tasks: list[SampledTask],
    model_names: list[str],
    model_costs: np.ndarray,
    extractor: Extractor = "line",
    families: list[str] | None = None,
) -> RecordedDataset:
    """The open-ended dataset of recorded samples (see the module docstring); task ids are positions in
    ``families`` (default: the families in order of first appearance)."""
    choices = [pool_choices([task.samples.get(m) for m in model_names], extractor) for task in tasks]
    width = max(max(len(c) for c, _ in choices), 1) + 1  # + "none of these"
    probs = np.zeros((len(tasks), len(model_names), width), np.float32)
    mask = np.zeros((len(tasks), width), bool)
    labels = np.zeros(len(tasks), np.int64)
    for n, ((candidates, p), task) in enumerate(zip(choices, tasks)):
        probs[n, :, : len(candidates)] = p
        mask[n, : max(len(candidates), 1)] = True  # no candidate at all: one empty answer that no model gave
        label = label_of(task.reference, candidates, extractor)
        labels[n] = label if label < len(candidates) else width - 1
    families = families or list(dict.fromkeys(task.family for task in tasks))
    task_ids = np.array([families.index(task.family) for task in tasks], np.int64)
    return RecordedDataset(
        name,
        probs,
        mask,
        labels,
        task_ids,
        list(model_names),
        np.asarray(model_costs, np.float64),
        dict(enumerate(families)),
        sampled=tasks,
        extractor=extractor,
    )
