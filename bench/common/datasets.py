"""The benchmarks' named synthetic validation sets, beside recorded dataset directories (one resolver for all).

- ``synthetic-plain``, ``synthetic-families``: issue 57's long single-task streams (10,000 questions, 11 models,
  seed 0; the second with the models in 3 families that share their mistakes: :mod:`bench.accuracy.long_streams`).
- ``synthetic-switches-G`` (G = 1, 2, 3): many short tasks, as bbh_dev, on which the models' order changes from task
  to task: 12 tasks of 250 questions, 5 models, each model's accuracy drawn per task (generator seed G). Under the
  stream protocol each task starts on an empty window, so this set shows what a new stream's first pools cost (a
  model lucky on its first rows kept alone, the others judged on two or three rows), which bbh_dev's tuning half and
  the bundled stream barely do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from rlens.evaluation.synthetic import synthetic_dataset
from rlens.records.dataset import load_dataset
from rlens.records.recorded import RecordedDataset

SYNTHETIC: dict[str, Callable[[], RecordedDataset]] = {
    "synthetic-plain": lambda: synthetic_dataset(10_000, 11, seed=0),
    "synthetic-families": lambda: synthetic_dataset(10_000, 11, seed=0, families=3),
    **{f"synthetic-switches-{g}": (lambda g=g: synthetic_dataset(3_000, 5, n_tasks=12, seed=g)) for g in (1, 2, 3)},
}


def dataset(name: str) -> RecordedDataset:
    """A recorded dataset directory, or one of the named synthetic sets."""
    return SYNTHETIC[name]() if name in SYNTHETIC else load_dataset(Path(name))
