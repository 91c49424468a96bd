"""``rlens zoo record``: run every zoo model on a generated multiple-choice stream and save it as a dataset.

The stream is :func:`rlens.zoo.tasks.block_stream` (task families in blocks, so the stream has task switches). Each
model's choice probabilities are the softmax of its lm-eval log-likelihoods. Besides the usual dataset files the
directory gets ``questions.jsonl`` (prompt, choices, family of every row), so real backends can be asked the same
questions later. The bundled ``zoo_mc`` dataset (``rlens demo``) is made by this module.

:func:`record_samples` does the same for open-ended tasks (`rlens zoo record --samples N`: those of
:func:`rlens.zoo.tasks.generation_stream`): every model samples ``n`` texts of each task, saved as a samples directory (:mod:`rlens.records.open_ended`) that
``rlens replay`` replays and the ``replay`` backend serves to the streaming service.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from rlens.backends.base import ChoiceQuery, GenerationRequest
from rlens.records.dataset import save_dataset
from rlens.records.recorded import RecordedDataset
from rlens.records.open_ended import load_samples, save_samples
from rlens.records.recorded import SampledTask
from rlens.zoo.build import ZooModel, load_backend
from rlens.zoo.tasks import FAMILIES, N_CHOICES, GenerationTask, Question, block_stream

QUESTIONS_FILE = "questions.jsonl"


def record_stream(
    models: list[ZooModel],
    out: Path,
    blocks: int = 10,
    block_size: int = 120,
    seed: int = 0,
    families: list[str] | None = None,
    progress: Callable[[int], None] = lambda n: None,
) -> RecordedDataset:
    """Ask every model every question of the stream (its blocks cycling through ``families``, default every family);
    write and return the dataset. Task ids stay the index in :data:`FAMILIES`."""
    all_families = list(FAMILIES)
    questions = block_stream(families or all_families, blocks, block_size, seed)
    probs = np.zeros((len(questions), len(models), N_CHOICES), dtype=np.float32)
    for m, model in enumerate(models):
        backend = load_backend(model)
        for i, question in enumerate(questions):
            scores = backend.score_choices(ChoiceQuery(id=str(i), prompt=question.prompt, choices=question.choices))
            probs[i, m] = scores.probabilities()
            progress(1)
        del backend
    dataset = RecordedDataset(
        name=out.name,
        probs=probs,
        choice_mask=np.ones((len(questions), N_CHOICES), dtype=bool),
        labels=np.array([q.label for q in questions], dtype=np.int64),
        task=np.array([all_families.index(q.family) for q in questions], dtype=np.int64),
        model_names=[m.name for m in models],
        model_costs=np.array([m.cost for m in models]),
        task_names=dict(enumerate(all_families)),
    )
    save_dataset(dataset, out)
    write_questions(questions, out / QUESTIONS_FILE)
    return dataset


def write_questions(questions: list[Question], path: Path) -> None:
    with path.open("w") as f:
        for q in questions:
            f.write(json.dumps({"prompt": q.prompt, "choices": q.choices, "family": q.family}) + "\n")


def read_questions(path: Path) -> list[Question]:
    """The questions of a recorded stream (labels come from the dataset's ``labels.npy``, not from here)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Question(r["family"], r["prompt"], r["choices"], -1) for r in rows]


def record_samples(
    models: list[ZooModel],
    tasks: list[GenerationTask],
    out: Path,
    n: int = 5,
    temperature: float = 1.0,
    max_tokens: int = 8,
    seed: int = 0,
    progress: Callable[[int], None] = lambda n: None,
) -> RecordedDataset:
    """Every model samples ``n`` texts of every task (one line each: generation stops at a newline), with seed
    ``seed + task index``; write the samples directory and return it as an open-ended dataset."""
    samples: list[dict[str, list[str]]] = [{} for _ in tasks]
    for model in models:
        backend = load_backend(model)
        for i, task in enumerate(tasks):
            request = GenerationRequest(
                id=str(i),
                prompt=task.prompt,
                n=n,
                max_tokens=max_tokens,
                temperature=temperature,
                stop=["\n"],
                seed=seed + i,
            )
            samples[i][model.name] = backend.generate(request).texts
            progress(1)
        del backend
    sampled = [
        SampledTask(prompt=t.prompt, reference=t.reference, family=t.family, samples=s) for t, s in zip(tasks, samples)
    ]
    save_samples(out, sampled, [m.name for m in models], np.array([m.cost for m in models]))
    return load_samples(out)
