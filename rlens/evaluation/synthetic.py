"""Seeded synthetic recorded-outputs datasets of any shape (scale tests and benchmarks of the replay).

Each model has an accuracy per task (uniform in [0.3, 0.85]); each question a difficulty shared by every model, so
errors are correlated; a model that is right puts most of its mass on the label, one that is wrong on a wrong
choice. Tasks come in blocks, in stream order, like bbh_dev. With ``families``, the models are dealt into that many
families (model j in family j mod families) and the wrong members of a family name the same wrong choice, drawn per
question and family: models trained alike make the same mistakes, which a vote that takes them as independent
counts again and again.
"""

from __future__ import annotations

import numpy as np

from rlens.records.recorded import RecordedDataset


def synthetic_dataset(
    n_questions: int, n_models: int, n_tasks: int = 1, n_choices: int = 4, seed: int = 0, families: int = 0
) -> RecordedDataset:
    if n_questions < 1 or n_models < 1 or n_tasks < 1 or n_choices < 2:
        raise ValueError("a synthetic dataset needs at least 1 question, 1 model, 1 task and 2 choices")
    rng = np.random.default_rng(seed)
    task = np.repeat(np.arange(n_tasks), -(-n_questions // n_tasks))[:n_questions]
    labels = rng.integers(0, n_choices, n_questions)
    accuracy = rng.uniform(0.3, 0.85, (n_tasks, n_models))
    difficulty = rng.normal(0.0, 1.0, n_questions)
    logit = np.log(accuracy[task] / (1 - accuracy[task])) - difficulty[:, None]  # [N, M]
    correct = rng.random((n_questions, n_models)) < 1 / (1 + np.exp(-logit))
    if families:
        shared = rng.integers(1, n_choices, (n_questions, families))
        wrong = (labels[:, None] + shared[:, np.arange(n_models) % families]) % n_choices
    else:
        wrong = (labels[:, None] + rng.integers(1, n_choices, (n_questions, n_models))) % n_choices
    top = np.where(correct, labels[:, None], wrong)
    probs = rng.dirichlet(np.ones(n_choices), (n_questions, n_models)).astype(np.float32)
    confidence = rng.uniform(0.4, 0.95, (n_questions, n_models)).astype(np.float32)
    probs *= (1 - confidence)[..., None]
    np.put_along_axis(probs, top[..., None], np.take_along_axis(probs, top[..., None], -1) + confidence[..., None], -1)
    return RecordedDataset(
        name=f"synthetic_{n_questions}x{n_models}" + (f"_f{families}" if families else ""),
        probs=probs,
        choice_mask=np.ones((n_questions, n_choices), dtype=bool),
        labels=labels.astype(np.int64),
        task=task.astype(np.int64),
        model_names=[f"model_{j}" for j in range(n_models)],
        model_costs=np.ones(n_models),
        task_names={t: f"task_{t}" for t in range(n_tasks)},
    )


def synthetic_samples(
    n_tasks: int, n_models: int, n_families: int = 2, n_samples: int = 5, block: int = 50, seed: int = 0
) -> RecordedDataset:
    """A seeded open-ended dataset of recorded samples (:mod:`rlens.records.open_ended`): arithmetic-like
    references, families in blocks of ``block`` tasks, and specialists: model j samples the reference with
    probability 0.85 on family ``j % n_families`` and 0.25 on the others, a near miss otherwise, and now and then
    an empty sample."""
    from rlens.records.open_ended import sampled_dataset
    from rlens.records.recorded import SampledTask

    if n_tasks < 1 or n_models < 1 or n_families < 1 or n_samples < 1 or block < 1:
        raise ValueError("synthetic samples need at least 1 task, model, family, sample and a block of 1")
    rng = np.random.default_rng(seed)
    names = [f"model_{j}" for j in range(n_models)]
    tasks = []
    for i in range(n_tasks):
        family = (i // block) % n_families
        reference = int(rng.integers(0, 100))
        skill = np.where(np.arange(n_models) % n_families == family, 0.85, 0.25)
        samples = {}
        for j, name in enumerate(names):
            right = rng.random(n_samples) < skill[j]
            misses = reference + rng.integers(1, 4, n_samples)
            samples[name] = [
                "" if rng.random() < 0.05 else f" {reference if r else int(m)}" for r, m in zip(right, misses)
            ]
        tasks.append(
            SampledTask(prompt=f"task {i}: ", reference=str(reference), family=f"family_{family}", samples=samples)
        )
    return sampled_dataset(f"synthetic_samples_{n_tasks}x{n_models}", tasks, names, np.ones(n_models))
