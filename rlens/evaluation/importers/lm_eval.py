"""Build a recorded-outputs dataset from lm-evaluation-harness ``--log_samples`` files of several models.

Each model contributes ``samples_<task>_<timestamp>.jsonl`` files (the Open LLM Leaderboard per-sample
details use the same format): one JSON object per line with ``doc_id``, the per-choice log-likelihoods in
``filtered_resps`` (or ``resps``) as ``[loglikelihood, is_greedy]`` pairs, the ``target`` (choice index or
choice text) and the request ``arguments`` (context, continuation) from which choice texts are read.
Questions are joined across models by (task, doc_id); those missing for some model are dropped and counted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlens.records.dataset import save_dataset
from rlens.records.recorded import DatasetError, RecordedDataset

SAMPLES_NAME = re.compile(r"^samples_(?P<task>.+?)(?:_(?P<stamp>\d{4}-\d{2}-\d{2}T[0-9.\-:]+))?\.jsonl$")


@dataclass
class Sample:
    loglikelihoods: list[float]
    target: int
    choices: list[str]


@dataclass
class ImportSummary:
    out: Path
    n_questions: int
    n_models: int
    tasks: list[str]
    dropped: int  # questions missing for at least one model


def task_name(path: Path) -> str:
    match = SAMPLES_NAME.match(path.name)
    return match.group("task") if match else path.stem


def _loglikelihood(value, path: Path, line: int) -> float:
    """One choice's response: [ll, is_greedy], [[ll, is_greedy]] (unfiltered) or a bare number / numeric string."""
    while isinstance(value, list) and value:
        value = value[0]
    try:
        ll = float(value)
    except (TypeError, ValueError):
        raise DatasetError(path, f"line {line}: a response {value!r} is not a log-likelihood") from None
    if not np.isfinite(ll) and ll != -np.inf:
        raise DatasetError(path, f"line {line}: log-likelihood {value!r} is not a number")
    return ll


def _choices(arguments, n: int) -> list[str]:
    if isinstance(arguments, dict):  # lm-eval >= 0.4: {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
        pairs = [arguments[k] for k in sorted(arguments, key=lambda k: int(re.sub(r"\D", "", k) or 0))]
        texts = [p.get("arg_1", "") if isinstance(p, dict) else "" for p in pairs]
    elif isinstance(arguments, list):  # older: [[context, continuation], ...]
        texts = [p[1] if isinstance(p, list) and len(p) > 1 else "" for p in arguments]
    else:
        texts = []
    texts = [str(t).strip() for t in texts]
    return texts if len(texts) == n else [f"choice_{i}" for i in range(n)]


def _target(value, choices: list[str], path: Path, line: int) -> int:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, bool):
        value = str(value)
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit() and value.strip() not in choices):
        index = int(value)
    elif isinstance(value, str) and value.strip() in choices:
        index = choices.index(value.strip())
    else:
        raise DatasetError(
            path, f"line {line}: target {value!r} is neither a choice index nor one of the choices {choices}"
        )
    if not 0 <= index < len(choices):
        raise DatasetError(path, f"line {line}: target index {index} is outside the {len(choices)} choices")
    return index


def read_samples(path: Path) -> dict[int, Sample]:
    """doc_id -> Sample for one samples_*.jsonl file."""
    samples: dict[int, Sample] = {}
    with path.open() as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(path, f"line {line_no}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or "doc_id" not in record:
                raise DatasetError(path, f"line {line_no}: no 'doc_id' (is this an lm-eval --log_samples file?)")
            responses = record.get("filtered_resps", record.get("resps"))
            if not isinstance(responses, list) or len(responses) < 2:
                raise DatasetError(
                    path,
                    f"line {line_no}: 'filtered_resps'/'resps' must list one log-likelihood per choice (at least 2); multiple-choice tasks only",
                )
            lls = [_loglikelihood(r, path, line_no) for r in responses]
            choices = _choices(record.get("arguments"), len(lls))
            if "target" not in record:
                raise DatasetError(path, f"line {line_no}: no 'target'")
            samples[int(record["doc_id"])] = Sample(lls, _target(record["target"], choices, path, line_no), choices)
    if not samples:
        raise DatasetError(path, "holds no samples")
    return samples


def _sample_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    if source.is_dir():
        files = sorted(source.rglob("samples_*.jsonl"))
        if files:
            return files
        raise DatasetError(source, "holds no samples_*.jsonl files")
    raise DatasetError(source, "no such file or directory")


def import_lm_eval(models: dict[str, Path], out: Path, costs: dict[str, float] | None = None) -> ImportSummary:
    """Join the per-sample files of several models into a dataset directory at ``out``."""
    if len(models) < 1:
        raise DatasetError(out, "give at least one model (NAME=PATH)")
    per_model: dict[str, dict[str, tuple[Path, dict[int, Sample]]]] = {}
    for name, source in models.items():
        tasks: dict[str, tuple[Path, dict[int, Sample]]] = {}
        for path in _sample_files(Path(source)):
            task = task_name(path)
            if task in tasks:
                raise DatasetError(path, f"task {task!r} appears twice for model {name!r} (also in {tasks[task][0]})")
            tasks[task] = (path, read_samples(path))
        per_model[name] = tasks
    names = list(models)
    first = per_model[names[0]]
    task_order = [t for t in first if all(t in per_model[n] for n in names)]
    if not task_order:
        raise DatasetError(out, "the models share no task (task names come from samples_<task>_<timestamp>.jsonl)")

    rows, dropped = [], 0
    for task_id, task in enumerate(task_order):
        docs = [set(per_model[n][task][1]) for n in names]
        common = sorted(set.intersection(*docs))
        dropped += len(set.union(*docs)) - len(common)
        for doc in common:
            samples = [per_model[n][task][1][doc] for n in names]
            n_choices = len(samples[0].loglikelihoods)
            for n, s in zip(names, samples):
                if len(s.loglikelihoods) != n_choices or s.target != samples[0].target:
                    raise DatasetError(
                        per_model[n][task][0],
                        f"doc_id {doc}: {len(s.loglikelihoods)} choices / target {s.target}, but model {names[0]!r} has {n_choices} / {samples[0].target}",
                    )
            rows.append((task_id, samples))

    c_max = max(len(s[0].loglikelihoods) for _, s in rows)
    n_rows, n_models = len(rows), len(names)
    probs = np.zeros((n_rows, n_models, c_max), dtype=np.float32)
    mask = np.zeros((n_rows, c_max), dtype=bool)
    labels = np.zeros(n_rows, dtype=np.int64)
    task_ids = np.zeros(n_rows, dtype=np.int64)
    choices_of_task: dict[int, list[str]] = {}
    for i, (task_id, samples) in enumerate(rows):
        c = len(samples[0].loglikelihoods)
        ll = np.array([s.loglikelihoods for s in samples], dtype=np.float64)
        ll = ll - ll.max(1, keepdims=True)
        probs[i, :, :c] = np.exp(ll) / np.exp(ll).sum(1, keepdims=True)
        mask[i, :c] = True
        labels[i], task_ids[i] = samples[0].target, task_id
        choices_of_task.setdefault(task_id, samples[0].choices)
    dataset = RecordedDataset(
        name=out.name,
        probs=probs,
        choice_mask=mask,
        labels=labels,
        task=task_ids,
        model_names=names,
        model_costs=np.array([(costs or {}).get(name, 1.0) for name in names]),
        task_names=dict(enumerate(task_order)),
    )
    save_dataset(dataset, out, choices_of_task)
    return ImportSummary(out, n_rows, n_models, task_order, dropped)
